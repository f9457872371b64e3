"""What every attention backend shares: the step's batch layout, the backend interface, and the
block-table arithmetic.

The model runner describes a step's flat batch once (BatchLayout); a backend turns that into
whatever metadata its kernels want (prepare, once per step and sliding window) and then, per
layer, writes the new K/V into their slots and attends over each sequence's paged context (forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch

from metroserve.worker.kv_cache import KVCache


@dataclass
class BatchLayout:
    """One step's flat batch: sequence i owns query tokens [query_start[i], query_start[i] + query_lens[i])."""

    query_start: list[int]
    query_lens: list[int]
    seq_lens: list[int]  # context length after this step's tokens are written
    block_tables: list[list[int]]
    block_table_tensor: torch.Tensor  # [num_seqs, max_blocks] int64, the same tables padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] pool slot of each new token's K/V


M = TypeVar("M")


class AttentionBackend(Protocol[M]):
    """prepare builds the backend's metadata M once per step; forward consumes it in every layer.

    prepare(layout, sliding_window=w) is the metadata of the layers with window w: a query at
    position p sees the keys at positions (p - w, p], its last w tokens (Hugging Face's
    sliding_window_overlay); None is full causal attention. forward's scale multiplies q . k
    (None: head_dim ** -0.5); with softcap c (Gemma 2's attn_logit_softcapping) a score s becomes
    c * tanh(s / c) before the mask and the softmax.
    """

    def prepare(self, layout: BatchLayout, sliding_window: int | None = None) -> M: ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: M, scale: float | None = None, softcap: float | None = None) -> torch.Tensor: ...


def window_size(sliding_window: int | None) -> int:
    """The metadata's form of a window: 0 for none."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 (or None), got {sliding_window}")
    return sliding_window or 0


def first_visible(seq_len: int, window: int) -> int:
    """Position of the first key that the query at position seq_len - 1 sees (window 0: none)."""
    return max(0, seq_len - window) if window else 0


def block_tables_to_slots(block_tables: list[list[int]], seq_index: np.ndarray, positions: np.ndarray,
                          block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """BatchLayout's block_table_tensor and slot_mapping for tokens at positions[t] of sequences seq_index[t].

    The tables are padded with block 0 into one [num_seqs, max_blocks] int64 tensor; a token's slot
    in the pool is its block's id * block_size + its offset inside the block.
    """
    tables = np.zeros((len(block_tables), max(map(len, block_tables), default=0)), dtype=np.int64)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    slots = tables[seq_index, positions // block_size] * block_size + positions % block_size
    return torch.from_numpy(tables).to(device), torch.from_numpy(slots).to(device)


# Queries this short (decodes; speculative verification of up to 16 drafts) attend token by token:
# query token j of a sequence is a decode row whose context ends at its own position. Longer
# chunks (prefills) attend as one causal block. The torch and CPU backends split a batch this way.
MAX_ROW_QUERY = 17


@dataclass
class QueryRows:
    token_index: list[int]  # rows of the flat batch
    seq_lens: list[int]  # context each row sees (its own position + 1)
    seq_index: list[int]  # the row's sequence in the layout


def query_rows(layout: BatchLayout) -> QueryRows:
    rows = QueryRows([], [], [])
    for i, q_len in enumerate(layout.query_lens):
        if q_len <= MAX_ROW_QUERY:
            start, first_len = layout.query_start[i], layout.seq_lens[i] - q_len + 1
            rows.token_index.extend(range(start, start + q_len))
            rows.seq_lens.extend(range(first_len, first_len + q_len))
            rows.seq_index.extend([i] * q_len)
    return rows
