"""CPU attention backend: decodes read K/V straight from the block pool in a compiled kernel.

The torch backend gathers each decode's whole context into a padded tensor every layer; on CPU
that copy costs as much as the attention itself. The kernel in csrc/paged_decode_attention.cpp
walks the block table instead. It is compiled once per machine with torch's C++ extension
loader (about 30 s, cached under ~/.cache/metroserve/kernels); prefill chunks keep using SDPA.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.attention import BatchLayout, TorchAttention, _Prefill, query_rows
from worker.model_files import cache_root

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
_kernel = None
_failed = False


def load_cpu_kernel(required: bool = False):
    """The compiled extension module, or None if it cannot be built here (raises if required)."""
    global _kernel, _failed
    if _kernel is not None or (_failed and not required):
        return _kernel
    from torch.utils.cpp_extension import load

    try:
        logger.info("building the CPU paged-attention kernel (once per machine)")
        build_dir = _build_directory()
        _kernel = load(name="metroserve_paged_decode", sources=[str(_SOURCE)],
                       extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as e:  # no compiler, no headers, no ninja: fall back to the torch backend
        _failed = True
        if required:
            raise RuntimeError(f"cannot build the CPU attention kernel: {e}") from e
        logger.warning("CPU attention kernel unavailable (%s); using the torch backend", e)
    return _kernel


def _build_directory() -> Path:
    """A build folder per CPU feature set (the kernel is built with -march=native).

    torch's loader waits forever on a lock file left by a build that was killed; a lock older
    than any real build is removed so such a leftover cannot hang every later start.
    """
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    flags = next((line for line in lines if line.startswith("flags")), "")
    build_dir = cache_root() / "kernels" / f"cpu-{hashlib.sha256(flags.encode()).hexdigest()[:12]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > 600:
        lock.unlink(missing_ok=True)
    return build_dir


@dataclass
class CpuMetadata:
    slot_mapping: torch.Tensor
    prefills: list[_Prefill]
    decode_index: torch.Tensor  # [n] rows of the flat batch that attend as single-token queries
    block_tables: torch.Tensor  # [n, max_blocks] int64
    seq_lens: torch.Tensor  # [n] int64


class CpuAttention(TorchAttention):
    @staticmethod
    def supports(head_dim: int) -> bool:
        """The shapes the kernel is instantiated for (see csrc/paged_decode_attention.cpp)."""
        return head_dim in (16, 32, 64, 128, 256)

    def prepare(self, layout: BatchLayout) -> CpuMetadata:
        rows = query_rows(layout)
        return CpuMetadata(
            slot_mapping=layout.slot_mapping,
            prefills=self._prepare_prefills(layout),
            decode_index=torch.tensor(rows.token_index, dtype=torch.int64),
            block_tables=layout.block_table_tensor[rows.seq_index],
            seq_lens=torch.tensor(rows.seq_lens, dtype=torch.int64),
        )

    @staticmethod
    def _decode_attention(q, k_pool, v_pool, metadata: CpuMetadata, out: torch.Tensor) -> None:
        if metadata.decode_index.numel():
            qd = q.index_select(0, metadata.decode_index)
            od = _kernel.paged_decode_attention(qd, k_pool, v_pool, metadata.block_tables, metadata.seq_lens,
                                                q.shape[-1] ** -0.5)
            out.index_copy_(0, metadata.decode_index, od)
