"""CPU attention backend: compiled kernels read K/V straight from the block pool.

The torch backend gathers each decode's whole context into a padded tensor every layer; on CPU
that copy costs as much as the attention itself. csrc/paged_decode_attention.cpp walks the block
table instead, and csrc/paged_prefill_attention.cpp does the same for prefill chunks (causal,
after any cached or earlier-chunk context), 1.6x faster than SDPA's flash kernel on the
throughput workload's prompts. Both are compiled once per machine with torch's C++ extension
loader (about 30 s, cached under ~/.cache/metroserve/kernels).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.attention import MAX_ROW_QUERY, BatchLayout, TorchAttention, query_rows
from worker.kv_cache import KVCache
from worker.model_files import cache_root

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_decode_attention.cpp", "paged_prefill_attention.cpp", "bindings.cpp")]
_kernel = None
_failed = False


def load_cpu_kernel(required: bool = False):
    """The compiled extension module, or None if it cannot be built here (raises if required)."""
    global _kernel, _failed
    if _kernel is not None or (_failed and not required):
        return _kernel
    from torch.utils.cpp_extension import load

    try:
        logger.info("building the CPU paged-attention kernels (once per machine)")
        build_dir = _build_directory()
        _kernel = load(name="metroserve_cpu_attention", sources=[str(p) for p in _SOURCES],
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
    prefill_start: torch.Tensor  # [p] first row of each prefill chunk in the flat batch
    prefill_query_lens: torch.Tensor  # [p]
    prefill_seq_lens: torch.Tensor  # [p] context after the chunk
    prefill_tables: torch.Tensor  # [p, max_blocks] int64
    decode_index: torch.Tensor  # [n] rows of the flat batch that attend as single-token queries
    block_tables: torch.Tensor  # [n, max_blocks] int64
    seq_lens: torch.Tensor  # [n] int64


class CpuAttention(TorchAttention):
    @staticmethod
    def supports(head_dim: int) -> bool:
        """The shapes the kernels are instantiated for (see csrc/)."""
        return head_dim in (16, 32, 64, 128, 256)

    def prepare(self, layout: BatchLayout) -> CpuMetadata:
        rows = query_rows(layout)
        chunks = [i for i, n in enumerate(layout.query_lens) if n > MAX_ROW_QUERY]
        return CpuMetadata(
            slot_mapping=layout.slot_mapping,
            prefill_start=torch.tensor([layout.query_start[i] for i in chunks], dtype=torch.int64),
            prefill_query_lens=torch.tensor([layout.query_lens[i] for i in chunks], dtype=torch.int64),
            prefill_seq_lens=torch.tensor([layout.seq_lens[i] for i in chunks], dtype=torch.int64),
            prefill_tables=layout.block_table_tensor[chunks],
            decode_index=torch.tensor(rows.token_index, dtype=torch.int64),
            block_tables=layout.block_table_tensor[rows.seq_index],
            seq_lens=torch.tensor(rows.seq_lens, dtype=torch.int64),
        )

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: CpuMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]. Returns [T, H * D]."""
        num_tokens, num_heads, head_dim = q.shape
        k_pool, v_pool = self.write_kv(layer, k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        scale = head_dim ** -0.5
        if metadata.prefill_start.numel():
            _kernel.paged_prefill_attention(q, k_pool, v_pool, metadata.prefill_tables, metadata.prefill_start,
                                            metadata.prefill_query_lens, metadata.prefill_seq_lens, scale, out)
        if metadata.decode_index.numel():
            qd = q.index_select(0, metadata.decode_index)
            od = _kernel.paged_decode_attention(qd, k_pool, v_pool, metadata.block_tables, metadata.seq_lens, scale)
            out.index_copy_(0, metadata.decode_index, od)
        return out.view(num_tokens, num_heads * head_dim)
