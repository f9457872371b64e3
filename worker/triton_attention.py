"""Triton attention backend: paged attention and the KV write as two GPU kernels.

One kernel serves the whole mixed batch. The query tokens are cut into tiles of up to BLOCK_Q
tokens of one sequence (a decode is one tile of one token, a prefill chunk several); a program
takes one tile and one KV head, with that head's GQA group of query heads stacked as rows, and
walks the sequence's block table with an online softmax. Causality inside a chunk is a mask on
absolute positions, so earlier context from the prefix cache or previous chunks needs nothing
special. The KV write stores each new token's K and V in the slot the block manager gave it.

Both kernels also run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, set before
this module is imported): that is how CI checks them against the torch backend. Padded rows of
a CUDA-graph batch carry slot -1 (nothing written) and query length 0 (nothing computed).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from worker.attention import BatchLayout
from worker.kv_cache import KVCache

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_slot, stride_head,
                     NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, KV_HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = slot * stride_slot + h * stride_head + d
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _paged_attention_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                            seq_lens_ptr, query_start_ptr, tile_seq_ptr, tile_start_ptr, scale_log2,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_block, stride_slot, stride_head, stride_table,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                            HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    tile_start = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)

    # Row r of the tile is query token tile_start + r // GROUP_PAD, query head kv_head * GROUP + r % GROUP_PAD.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_index = tile_start + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_index < q_len) & (rows % GROUP_PAD < GROUP)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    token = (q_begin + q_index).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = seq_len - q_len + q_index  # absolute position: sees keys at positions <= its own

    # Keys up to the tile's last real query; a tile past its sequence's query (padding) reads none.
    last_pos = seq_len - q_len + tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    num_blocks = tl.where(tile_start < q_len, last_pos // BLOCK_SIZE + 1, 0)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    for b in range(0, num_blocks):
        block = tl.load(table + b).to(tl.int64)
        offsets = block * stride_block + slots[:, None] * stride_slot + kv_head * stride_head + d[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        k_pos = b * BLOCK_SIZE + slots
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] pool slot per new token, -1: write nothing
    block_tables: torch.Tensor  # [S, W]
    seq_lens: torch.Tensor  # [S] int32, context after this step
    query_start: torch.Tensor  # [S + 1] int32
    tile_seq: torch.Tensor  # [tiles] int32: the sequence of each query tile
    tile_start: torch.Tensor  # [tiles] int32: the tile's first query token inside its sequence
    block_q: int


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TritonAttention:
    """The attention backend interface (prepare once per step, forward per layer) over the two kernels."""

    # tl.dot wants at least 16 rows: decode tiles stack 16 query rows, mixed batches 64.
    DECODE_ROWS = 16
    PREFILL_ROWS = 64

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
        if block_size < 16:
            raise ValueError(f"the triton attention backend needs block_size >= 16, got {block_size}")
        self.block_size = block_size
        self.group = num_heads // num_kv_heads
        self.group_pad = _pow2(self.group)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        # float32 attends in full precision (as the torch backend does), not TF32.
        self.precision = "ieee" if dtype == torch.float32 else "tf32"

    def decode_block_q(self) -> int:
        return max(1, self.DECODE_ROWS // self.group_pad)

    def prepare(self, layout: BatchLayout) -> TritonMetadata:
        q_lens = np.asarray(layout.query_lens, dtype=np.int32)
        rows = self.DECODE_ROWS if q_lens.max(initial=1) <= self.decode_block_q() else self.PREFILL_ROWS
        block_q = max(1, rows // self.group_pad)
        tiles = -(-q_lens // block_q)
        tile_seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), tiles)
        first_tile = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(tiles, out=first_tile[1:])
        tile_start = (np.arange(len(tile_seq), dtype=np.int32) - first_tile[tile_seq]) * block_q
        query_start = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start[1:])
        # One host-to-device copy for the four small arrays.
        packed = torch.from_numpy(np.concatenate([
            np.asarray(layout.seq_lens, dtype=np.int32), query_start, tile_seq, tile_start]))
        packed = packed.to(layout.slot_mapping.device)
        s, t = len(q_lens), len(tile_seq)
        return TritonMetadata(layout.slot_mapping, layout.block_table_tensor, packed[:s], packed[s : 2 * s + 1],
                              packed[2 * s + 1 : 2 * s + 1 + t], packed[2 * s + 1 + t :], block_q)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: TritonMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (last dim contiguous). Returns [T, H * D]."""
        num_tokens, num_heads, head_dim = q.shape
        k_pool, v_pool = kv_cache.k[layer], kv_cache.v[layer]
        self.write_kv(k, v, k_pool, v_pool, metadata.slot_mapping)
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        self.attend(q, k_pool, v_pool, metadata, out)
        return out.view(num_tokens, num_heads * head_dim)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if k.shape[0] == 0:
            return
        _write_kv_kernel[(k.shape[0],)](
            k, v, k_pool, v_pool, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_pool.stride(1), k_pool.stride(2), NUM_KV_HEADS=self.num_kv_heads, KV_HEADS_PAD=_pow2(self.num_kv_heads),
            HEAD_DIM=self.head_dim, HEAD_DIM_PAD=_pow2(self.head_dim))

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, metadata: TritonMetadata,
               out: torch.Tensor) -> None:
        num_tiles = metadata.tile_seq.shape[0]
        if num_tiles == 0:
            return
        _paged_attention_kernel[(num_tiles, self.num_kv_heads)](
            out, q, k_pool, v_pool, metadata.block_tables, metadata.seq_lens, metadata.query_start,
            metadata.tile_seq, metadata.tile_start, self.scale_log2,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), metadata.block_tables.stride(0),
            GROUP=self.group, GROUP_PAD=self.group_pad, BLOCK_Q=metadata.block_q, HEAD_DIM=self.head_dim,
            HEAD_DIM_PAD=_pow2(self.head_dim), BLOCK_SIZE=self.block_size, PRECISION=self.precision)
