"""The CPU kernels' build cache (worker/cpu_kernels.py): one folder per key, reused by later
processes, and built once by processes that start together. Reuses the real build where it can."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from metroserve.worker.cpu_kernels import CSRC, SOURCES, kernel_build, load_cpu_kernels, load_or_build


@pytest.fixture(scope="module")
def real_build():
    """The build the engine uses on this machine, built if it is not yet."""
    if load_cpu_kernels() is None:
        pytest.skip("no C++ toolchain for the CPU kernels")
    build = kernel_build()
    assert build.marker.exists()
    return build


def _checkout(root: Path) -> tuple[Path, ...]:
    """A copy of the kernel sources, as a second checkout of the repository would have them."""
    shutil.copytree(CSRC, root / "csrc")
    return tuple(root / "csrc" / p.name for p in SOURCES)


def test_key_separates_checkouts_and_follows_every_input(tmp_path):
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    cache = tmp_path / "cache"
    build_a = kernel_build(a, root=cache)
    assert kernel_build(a, root=cache).directory == build_a.directory  # stable
    assert kernel_build(b, root=cache).directory != build_a.directory  # identical contents, other path
    assert kernel_build(a, cflags=("-O2",), root=cache).directory != build_a.directory
    (tmp_path / "a" / "csrc" / "vec.h").write_text("// changed\n")  # headers count, not only sources
    assert kernel_build(a, root=cache).directory != build_a.directory


def test_fresh_process_loads_without_rebuilding(real_build):
    library = real_build.directory / "metroserve_cpu_kernels.so"
    before = library.stat().st_mtime_ns
    out = subprocess.run([sys.executable, "-m", "metroserve.worker.cpu_kernels"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"already built (nothing to do) in {real_build.directory}" in out.stdout
    assert "building" not in out.stdout
    assert library.stat().st_mtime_ns == before


# Stands in for torch's loader: counts the compiles and "builds" by copying the real library. It takes
# a while, as a real build does (minutes), so that a builder the lock failed to hold back would
# find no finished build and compile too.
_BUILDER = """
import logging, shutil, sys, time
from pathlib import Path
from metroserve.worker.cpu_kernels import _import_library, kernel_build, load_or_build

logging.basicConfig(level=logging.INFO)
real, root, log = map(Path, sys.argv[1:])

def compile_fn(build):
    with open(log, "a") as f:
        f.write("compiled\\n")
    time.sleep(2)
    shutil.copy(real, build.directory / real.name)
    return _import_library(build.directory / real.name)

result = load_or_build(kernel_build(root=root), compile_fn)
print("built" if result.built else "loaded", result.module.__file__)
"""


def test_processes_starting_together_build_once(real_build, tmp_path):
    real = Path(real_build.directory / "metroserve_cpu_kernels.so")
    root, log = tmp_path / "kernels", tmp_path / "compiles.log"
    build = kernel_build(root=root)
    build.directory.mkdir(parents=True)
    with open(build.lock, "a") as held:
        # Both builders find the lock taken, so both are waiting when it is released.
        fcntl.flock(held, fcntl.LOCK_EX)
        errs = [tmp_path / f"builder{i}.err" for i in range(2)]
        procs = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(real), str(root), str(log)],
                                  stdout=subprocess.PIPE, stderr=err.open("w"), text=True) for err in errs]
        deadline = time.monotonic() + 120
        while not all("waiting for another process" in err.read_text() for err in errs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [err.read_text() for err in errs]
            time.sleep(0.1)
        fcntl.flock(held, fcntl.LOCK_UN)
    outputs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs), [err.read_text() for err in errs]
    assert log.read_text() == "compiled\n"
    assert sorted(word for word, _ in outputs) == ["built", "loaded"]
    assert {path for _, path in outputs} == {str(build.directory / real.name)}


def test_library_that_no_longer_loads_is_rebuilt(tmp_path):
    build = kernel_build(root=tmp_path)
    compiles = []

    def compile_fn(b):
        compiles.append(b)
        library = b.directory / "gone.so"  # never written: the next load finds no library
        return types.SimpleNamespace(__file__=os.fspath(library))

    assert load_or_build(build, compile_fn).built
    assert load_or_build(build, compile_fn).built
    assert len(compiles) == 2
