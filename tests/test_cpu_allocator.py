"""keep_freed_memory: large activation buffers come from the heap and stay mapped after free, so the
next step reuses them instead of page-faulting fresh memory in."""

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Run in a fresh interpreter: glibc's thresholds are process-wide and adapt to earlier frees.
PROBE = textwrap.dedent("""
    import ctypes, ctypes.util
    from metroserve.worker.cpu_allocator import keep_freed_memory

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def heap():
        for line in open("/proc/self/maps"):
            if line.rstrip().endswith("[heap]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                return lo, hi
        return 0, 0

    def probe():
        size = 30 << 20  # a large step's activation, under glibc's 32 MiB mmap ceiling
        p = libc.malloc(size)
        lo, hi = heap()
        in_heap = lo <= p < hi
        libc.free(p)
        kept = heap()[1] - heap()[0] >= size
        return in_heap, kept

    print(probe(), keep_freed_memory(), probe())
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc settings")
def test_large_buffers_come_from_the_heap_and_stay_after_free():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    # (in heap, still mapped after free): by default a fresh mmap, unmapped on free; then kept.
    assert out.strip() == "(False, False) True (True, True)", out
