"""Compiled CPU kernels: paged attention (csrc/paged_*_attention.cpp) and its KV store
(csrc/kv_store.cpp), the decoder layer's fused elementwise steps (csrc/layer_ops.cpp), the
small-batch projection GEMM (csrc/packed_linear.cpp), its counterparts over GGUF-quantized weights
(csrc/quant_linear*.cpp) and a decode step's layers in one call (csrc/decode_stack.cpp,
worker/fused_decode.py), float32 arithmetic.

One extension, built with torch's C++ extension loader (under a minute on 2 cores) by
scripts/setup.sh (`python -m metroserve.worker.cpu_kernels`), else on the first engine start. The
sources include ATen's tensor and factory headers (and torch's pybind casters where they bind),
never <torch/extension.h>: parsing that alone took 27 s a file, most of a 164 s build. Builds
live under <cache root>/kernels (~/.cache/metroserve, or $METROSERVE_CACHE) in a folder keyed by
everything the library depends on, so checkouts, compilers and torch versions never overwrite each
other's builds, and a file lock per key makes processes that start together build once. Where it
cannot be built (no compiler), everything falls back to torch ops: the torch attention backend and
the model's torch code path.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import logging
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from metroserve.worker.model_files import cache_root

logger = logging.getLogger(__name__)

NAME = "metroserve_cpu_kernels"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("paged_decode_attention.cpp", "paged_prefill_attention.cpp",
                                         "layer_ops.cpp", "packed_linear.cpp", "quant_linear.cpp",
                                         "quant_linear_int8.cpp", "kv_store.cpp", "decode_stack.cpp", "bindings.cpp"))
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILDING = "building CPU kernels (about a minute, once per checkout and machine)..."

_kernels: ModuleType | None = None
_failed = False


@dataclass(frozen=True)
class KernelBuild:
    """One build of the extension: its inputs and the cache folder their key names."""

    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    inputs: dict[str, object]  # everything the key hashes, recorded in the marker for inspection
    directory: Path
    name: str = NAME  # the module's; Python keeps one extension module per name in a process

    @property
    def lock(self) -> Path:
        """Beside the folder, not in it, so removing a broken folder cannot pull a held lock away."""
        return self.directory.with_name(self.directory.name + ".lock")

    @property
    def marker(self) -> Path:
        """Written after a successful build: the library's path and the key's inputs."""
        return self.directory / "built.json"


@dataclass(frozen=True)
class KernelLoad:
    module: ModuleType
    build: KernelBuild
    built: bool  # False: loaded from an earlier build
    seconds: float


def kernel_build(sources: tuple[Path, ...] = SOURCES, cflags: tuple[str, ...] = CFLAGS,
                 ldflags: tuple[str, ...] = LDFLAGS, root: Path | None = None, name: str = NAME) -> KernelBuild:
    """The build of these sources with these flags by this machine's compiler and torch, as module `name`.

    The key covers what torch's loader would otherwise rebuild over in place (source paths and
    contents, flags) and what it does not check (headers, the CPU that -march=native targets, the
    compiler, torch and Python)."""
    sources = tuple(p.resolve() for p in sources)
    contents = hashlib.sha256()
    headers = sorted({h for p in sources for h in p.parent.glob("*.h")})
    for path in (*sources, *headers):
        contents.update(path.name.encode() + b"\0" + path.read_bytes())
    inputs = {
        "name": name,
        "sources": [str(p) for p in sources],
        "contents": contents.hexdigest(),
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "cpu": _cpu_flags(),
        "compiler": _compiler_identity(),
        "torch": _torch_version(),
        "python": sysconfig.get_config_var("EXT_SUFFIX") or sys.version,
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    directory = (root or cache_root() / "kernels") / f"cpu-{key}"
    return KernelBuild(sources, tuple(cflags), tuple(ldflags), inputs, directory, name)


def has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX tiles or AVX512-BF16 dot products), as
    oneDNN's bfloat16 kernels need to beat float32; elsewhere they convert and run slower."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's names: avx2, avx512_bf16, amx_bf16, ...); empty off Linux."""
    return set(_cpu_flags().split())


def _cpu_flags() -> str:
    """The CPU's feature flags: what -march=native turns into ISA flags."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("flags")), "")


def _compiler_identity() -> str:
    """The compiler torch's loader will run ($CXX or c++) and its --version banner."""
    from torch.utils.cpp_extension import get_cxx_compiler

    compiler = get_cxx_compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        version = f"unavailable: {e}"
    return f"{compiler}: {version.strip()}"


def _torch_version() -> str:
    import torch

    return torch.__version__


def load_or_build(build: KernelBuild, compile_fn: Callable[[KernelBuild], ModuleType] | None = None) -> KernelLoad:
    """The extension from its cache folder, compiled there first if no build finished yet.

    Holds the key's lock throughout, so of processes that start together one compiles and the rest
    wait for it and then load its library. compile_fn replaces torch's loader in tests."""
    start = time.perf_counter()
    build.directory.mkdir(parents=True, exist_ok=True)
    with _exclusive(build.lock):
        module = _load_built(build)
        built = module is None
        if module is None:
            logger.info(BUILDING)
            module = (compile_fn or _compile)(build)
            assert module.__file__ is not None  # an extension module is loaded from its library
            record = {"library": str(Path(module.__file__).resolve()), **build.inputs}
            partial = build.marker.with_suffix(".tmp")  # renamed into place: never half written
            partial.write_text(json.dumps(record, indent=1) + "\n")
            partial.replace(build.marker)
    return KernelLoad(module, build, built, time.perf_counter() - start)


@contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """An exclusive flock on lock; the kernel releases it when its holder dies, so a killed build
    cannot leave later starts waiting."""
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building the CPU kernels (%s)", lock)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load_built(build: KernelBuild) -> ModuleType | None:
    """The library a finished build left, or None when there is none (or it no longer loads)."""
    if not build.marker.exists():
        return None
    library = Path(json.loads(build.marker.read_text())["library"])
    try:
        return _import_library(library)
    except (ImportError, OSError) as e:
        logger.warning("the built CPU kernels in %s do not load (%s); rebuilding", build.directory, e)
        build.marker.unlink()
        library.unlink(missing_ok=True)  # else ninja would call the broken library up to date
        return None


def _import_library(library: Path) -> ModuleType:
    """Imports a built extension by path (its module name is the file's stem)."""
    import torch  # noqa: F401  the library links against libtorch, which importing torch loads

    spec = importlib.util.spec_from_file_location(library.name.split(".")[0], library)
    if spec is None or spec.loader is None:
        raise ImportError(f"not an extension module: {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(build: KernelBuild) -> ModuleType:
    """torch's loader, run under the key's lock (so no other of our processes uses the folder)."""
    from torch.utils.cpp_extension import load

    # torch's own lock file is left behind by a build that was killed, and its loader would wait on
    # it forever; holding our lock, nothing else can be building here.
    (build.directory / "lock").unlink(missing_ok=True)
    return load(name=build.name, sources=[str(p) for p in build.sources], extra_cflags=list(build.cflags),
                extra_ldflags=list(build.ldflags), build_directory=str(build.directory), verbose=False)


def load_cpu_kernels(required: bool = False) -> ModuleType | None:
    """The compiled extension module, or None if it cannot be built here (raises if required)."""
    global _kernels, _failed
    if _kernels is not None or (_failed and not required):
        return _kernels
    try:
        result = load_or_build(kernel_build())
        if result.built:
            logger.info("built the CPU kernels in %s (%.0f s)", result.build.directory, result.seconds)
        _kernels = result.module
    except Exception as e:  # no compiler, no headers, no ninja: fall back to torch ops
        _failed = True
        if required:
            raise RuntimeError(f"cannot build the CPU kernels: {e}") from e
        logger.warning("CPU kernels unavailable (%s); using torch ops", e)
    return _kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m metroserve.worker.cpu_kernels",
        description="Build the compiled CPU kernels into the cache (<cache root>/kernels, the root being "
                    "$METROSERVE_CACHE or ~/.cache/metroserve), so that the first engine start need not. "
                    "Does nothing when this build is already there. Exits 1 when it cannot build "
                    "(metroserve then runs on torch ops, slower).")
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)  # the building/waiting lines
    build = kernel_build()
    try:
        result = load_or_build(build)
    except Exception as e:
        print(f"cannot build the CPU kernels: {e}\nmetroserve will run on torch ops (slower).", file=sys.stderr)
        return 1
    done = "built" if result.built else "already built (nothing to do)"
    print(f"CPU kernels {done} in {build.directory} ({result.seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
