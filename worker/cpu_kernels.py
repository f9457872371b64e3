"""Compiled CPU kernels: paged attention (csrc/paged_*_attention.cpp), the decoder layer's fused
elementwise steps (csrc/layer_ops.cpp) and the small-batch projection GEMM (csrc/packed_linear.cpp),
float32.

One extension, built once per machine with torch's C++ extension loader (about 40 s, cached under
~/.cache/metroserve/kernels). Where it cannot be built (no compiler), everything falls back to
torch ops: the torch attention backend and the model's torch code path.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from metroserve.worker.model_files import cache_root

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name for name in
            ("paged_decode_attention.cpp", "paged_prefill_attention.cpp", "layer_ops.cpp", "packed_linear.cpp",
             "bindings.cpp")]
_kernels = None
_failed = False


def load_cpu_kernels(required: bool = False):
    """The compiled extension module, or None if it cannot be built here (raises if required)."""
    global _kernels, _failed
    if _kernels is not None or (_failed and not required):
        return _kernels
    from torch.utils.cpp_extension import load

    try:
        logger.info("building the CPU kernels (once per machine)")
        build_dir = _build_directory()
        _kernels = load(name="metroserve_cpu_kernels", sources=[str(p) for p in _SOURCES],
                       extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as e:  # no compiler, no headers, no ninja: fall back to torch ops
        _failed = True
        if required:
            raise RuntimeError(f"cannot build the CPU kernels: {e}") from e
        logger.warning("CPU kernels unavailable (%s); using torch ops", e)
    return _kernels


def _build_directory() -> Path:
    """A build folder per CPU feature set (the kernels are built with -march=native) and header
    contents (torch's loader rebuilds when a listed source changes, not when a header does).

    torch's loader waits forever on a lock file left by a build that was killed; a lock older
    than any real build is removed so such a leftover cannot hang every later start.
    """
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    flags = next((line for line in lines if line.startswith("flags")), "")
    key = hashlib.sha256(flags.encode())
    for header in sorted((Path(__file__).parent / "csrc").glob("*.h")):
        key.update(header.read_bytes())
    build_dir = cache_root() / "kernels" / f"cpu-{key.hexdigest()[:12]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > 600:
        lock.unlink(missing_ok=True)
    return build_dir
