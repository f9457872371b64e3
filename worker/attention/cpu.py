"""CPU attention backend: compiled kernels read K/V straight from the block pool.

The torch backend gathers each decode's whole context into a padded tensor every layer; on CPU
that copy costs as much as the attention itself. csrc/paged_decode_attention.cpp walks the block
table instead, and csrc/paged_prefill_attention.cpp does the same for prefill chunks (causal,
after any cached or earlier-chunk context), 1.6x faster than SDPA's flash kernel on the
throughput workload's prompts. Both are built with the other CPU kernels (cpu_kernels.py) and
take a sliding window (a windowed query's loops start at its first visible key) and a soft-cap
as plain arguments. The KV write is csrc/kv_store.cpp's store_kv: the torch backend's
index_copy_ pair, without its dispatch cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metroserve.worker.attention.base import MAX_ROW_QUERY, BatchLayout, query_rows, window_size
from metroserve.worker.cpu_kernels import load_cpu_kernels
from metroserve.worker.kv_cache import KVCache


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
    sliding_window: int = 0  # keys a query sees at most (its own included); 0: all before it
    decode_only: bool = False  # every row of the flat batch is a query row, in order: no gather or scatter


class CpuAttention:
    def __init__(self, block_size: int):
        self.block_size = block_size
        kernels = load_cpu_kernels(required=True)
        assert kernels is not None  # required: a failed build raises instead
        self.kernels = kernels

    @staticmethod
    def supports(head_dim: int) -> bool:
        """The shapes the kernels are instantiated for (see csrc/)."""
        return head_dim in (16, 32, 64, 128, 256)

    def prepare(self, layout: BatchLayout, sliding_window: int | None = None) -> CpuMetadata:
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
            sliding_window=window_size(sliding_window),
            decode_only=not chunks and rows.token_index == list(range(sum(layout.query_lens))),
        )

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: CpuMetadata, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]. Returns [T, H * D]."""
        num_tokens, num_heads, head_dim = q.shape
        k_pool, v_pool = kv_cache.k[layer], kv_cache.v[layer]
        self.kernels.store_kv(k, v, k_pool, v_pool, metadata.slot_mapping)
        scale = head_dim ** -0.5 if scale is None else scale
        window, cap = metadata.sliding_window, softcap or 0.0
        if metadata.decode_only:
            out = self.kernels.paged_decode_attention(q.contiguous(), k_pool, v_pool, metadata.block_tables,
                                                      metadata.seq_lens, scale, window, cap)
            return out.view(num_tokens, num_heads * head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if metadata.prefill_start.numel():
            self.kernels.paged_prefill_attention(q, k_pool, v_pool, metadata.prefill_tables, metadata.prefill_start,
                                                 metadata.prefill_query_lens, metadata.prefill_seq_lens, scale, window,
                                                 cap, out)
        if metadata.decode_index.numel():
            qd = q.index_select(0, metadata.decode_index)
            od = self.kernels.paged_decode_attention(qd, k_pool, v_pool, metadata.block_tables, metadata.seq_lens,
                                                     scale, window, cap)
            out.index_copy_(0, metadata.decode_index, od)
        return out.view(num_tokens, num_heads * head_dim)
