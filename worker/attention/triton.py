"""Triton attention backend: paged attention and the KV write as two GPU kernels.

One kernel serves the whole mixed batch. The query tokens are cut into tiles of up to BLOCK_Q
tokens of one sequence (a decode is one tile of one token, a prefill chunk several); a program
takes one tile and one KV head, with that head's GQA group of query heads stacked as rows, and
walks the sequence's block table with an online softmax. Causality inside a chunk is a mask on
absolute positions, so earlier context from the prefix cache or previous chunks needs nothing
special. A small decode batch splits each context among several programs (split-KV, as in
flash-decoding) and a second kernel merges their partial softmaxes. The KV write stores each new
token's K and V in the slot the block manager gave it.

A sliding window is a scalar argument (the metadata's sliding_window, 0: none): a tile's key
tiles start at the first key its first query sees, and keys before each query's window are
masked. Soft-capping (Gemma 2) maps scores through tanh before the mask. Both are compile-time
switches too, so a kernel without them is the plain causal one.

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

from metroserve.worker.attention.base import BatchLayout, window_size
from metroserve.worker.kv_cache import KVCache

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


# The block-table width changes from step to step; specializing on its divisibility by 16 would
# compile a second variant mid-run for no gain. Likewise the window's.
@triton.jit(do_not_specialize=["stride_table", "sliding_window"])
def _paged_attention_kernel(out_ptr, partial_acc_ptr, partial_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                            block_tables_ptr, seq_lens_ptr, query_start_ptr, tile_seq_ptr, tile_start_ptr, scale_log2,
                            sliding_window, softcap_log2,
                            num_heads, stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_block, stride_slot, stride_head, stride_table,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                            HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr, PRECISION: tl.constexpr,
                            HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    tile_start = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)

    # Row r of the tile is query token tile_start + r // GROUP_PAD, query head kv_head * GROUP + r % GROUP_PAD.
    rows = tl.arange(0, BLOCK_M)  # BLOCK_M = BLOCK_Q * GROUP_PAD
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
    kv_len = tl.where(tile_start < q_len, seq_len - q_len + tl.minimum(tile_start + BLOCK_Q, q_len), 0)
    # Keys from the first one the tile's first query sees (0 without a window).
    kv_first = tl.where(sliding_window > 0, tl.maximum(seq_len - q_len + tile_start - sliding_window + 1, 0), 0)
    # Keys go TILE_N at a time, whatever the block size: each key finds its block in the table.
    # Split-KV decode: this program walks one contiguous share of the key tiles (all when unsplit).
    window_tile = kv_first // TILE_N
    end_tile = tl.maximum(tl.cdiv(kv_len, TILE_N), window_tile)
    per_segment = tl.cdiv(end_tile - window_tile, NUM_SEGMENTS)
    first_tile = window_tile + segment * per_segment
    last_tile = tl.minimum(first_tile + per_segment, end_tile)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    # The block ids of a key tile are loaded one iteration ahead: K/V addresses that depended on a
    # load of the same iteration would keep the pipeliner from overlapping K/V loads with compute.
    next_pos = first_tile * TILE_N + tl.arange(0, TILE_N)
    next_block = tl.load(table + next_pos // BLOCK_SIZE, mask=next_pos < kv_len, other=0)
    for kv_tile in range(first_tile, last_tile):
        k_pos = kv_tile * TILE_N + tl.arange(0, TILE_N)
        k_ok = k_pos < kv_len
        if HAS_WINDOW:  # the first key tile may start before the window: read none of that
            k_ok = k_ok & (k_pos >= kv_first)
        block = next_block.to(tl.int64)
        next_pos = k_pos + TILE_N
        next_block = tl.load(table + next_pos // BLOCK_SIZE, mask=next_pos < kv_len, other=0)
        offsets = (block[:, None] * stride_block + (k_pos % BLOCK_SIZE)[:, None] * stride_slot
                   + kv_head * stride_head + d[None, :])
        k = tl.load(k_cache_ptr + offsets, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if HAS_SOFTCAP:  # c tanh(s / c) in natural-log units is this in base-2 units (softcap_log2 = c log2(e))
            s = softcap_log2 * (2.0 * tl.sigmoid(2.0 * s / softcap_log2) - 1.0)
        visible = k_pos[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SEGMENTS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # unnormalized partials, combined by _merge_segments_kernel
        part = (token * num_heads + head) * NUM_SEGMENTS + segment
        tl.store(partial_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=mask)
        tl.store(partial_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(partial_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_segments_kernel(out_ptr, partial_acc_ptr, partial_ml_ptr, num_heads, stride_ot, stride_oh,
                           NUM_SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * num_heads + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    m = tl.load(partial_ml_ptr + part * 2)
    l_i = tl.load(partial_ml_ptr + part * 2 + 1)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    d = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(partial_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :])
    total = tl.sum(l_i * w, 0)
    # total == 0 only for padded rows (nothing written, partials left at zero): output 0, never NaN.
    o = tl.where(total == 0.0, 0.0, tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total))
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] pool slot per new token, -1: write nothing
    block_tables: torch.Tensor  # [S, W]
    seq_lens: torch.Tensor  # [S] int32, context after this step
    query_start: torch.Tensor  # [S + 1] int32
    tile_seq: torch.Tensor  # [tiles] int32: the sequence of each query tile
    tile_start: torch.Tensor  # [tiles] int32: the tile's first query token inside its sequence
    block_q: int
    num_segments: int = 1  # > 1: split-KV decode (each tile's key tiles shared among this many programs)
    sliding_window: int = 0  # keys a query sees at most (its own included); 0: all before it


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TritonAttention:
    """The attention backend interface (prepare once per step, forward per layer) over the two kernels."""

    # tl.dot wants at least 16 rows: decode tiles stack 16 query rows, mixed batches 64.
    DECODE_ROWS = 16
    PREFILL_ROWS = 64
    # A decode batch of fewer programs (sequences x KV heads) than this leaves most of a GPU's
    # ~100+ SMs idle, each program walking a long context alone: split each context in segments.
    SPLIT_KV_BELOW = 128
    SPLIT_KV_SEGMENTS = 16

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 split_kv: bool = True):
        self.block_size = block_size
        # Keys per inner step: 64 in half precision; 32 in float32, whose K and V tiles take twice the shared memory.
        self.tile_n = 32 if dtype == torch.float32 else 64
        self.num_heads = num_heads
        self.group = num_heads // num_kv_heads
        self.group_pad = _pow2(self.group)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.split_kv = split_kv
        # float32 attends in full precision (as the torch backend does), not TF32.
        self.precision = "ieee" if dtype == torch.float32 else "tf32"

    def decode_block_q(self) -> int:
        return max(1, self.DECODE_ROWS // self.group_pad)

    def decode_segments(self, num_seqs: int) -> int:
        """Segments per decode tile; depends on the batch size only, so a captured graph can fix it."""
        small = num_seqs * self.num_kv_heads < self.SPLIT_KV_BELOW
        return self.SPLIT_KV_SEGMENTS if self.split_kv and small else 1

    def prepare(self, layout: BatchLayout, sliding_window: int | None = None) -> TritonMetadata:
        q_lens = np.asarray(layout.query_lens, dtype=np.int32)
        decode_only = q_lens.max(initial=1) <= self.decode_block_q()
        block_q = max(1, (self.DECODE_ROWS if decode_only else self.PREFILL_ROWS) // self.group_pad)
        tiles = -(-q_lens // block_q)
        tile_seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), tiles)
        first_tile = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(tiles, out=first_tile[1:])
        tile_start = (np.arange(len(tile_seq), dtype=np.int32) - first_tile[tile_seq]) * block_q
        query_start = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start[1:])
        # One host-to-device copy for the four small arrays, each starting on a 16-byte boundary:
        # Triton specializes kernels on pointer alignment, which must not change from step to step.
        parts = [np.asarray(layout.seq_lens, dtype=np.int32), query_start, tile_seq, tile_start]
        starts = np.cumsum([0] + [-(-len(p) // 4) * 4 for p in parts])
        packed = np.zeros(starts[-1], dtype=np.int32)
        for part, start in zip(parts, starts):
            packed[start : start + len(part)] = part
        device_packed = torch.from_numpy(packed).to(layout.slot_mapping.device)
        seq_lens, query_start_t, tile_seq_t, tile_start_t = (
            device_packed[start : start + len(part)] for part, start in zip(parts, starts))
        return TritonMetadata(layout.slot_mapping, layout.block_table_tensor, seq_lens, query_start_t, tile_seq_t,
                              tile_start_t, block_q, self.decode_segments(len(q_lens)) if decode_only else 1,
                              window_size(sliding_window))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: TritonMetadata, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (last dim contiguous). Returns [T, H * D]."""
        num_tokens, num_heads, head_dim = q.shape
        k_pool, v_pool = kv_cache.k[layer], kv_cache.v[layer]
        self.write_kv(k, v, k_pool, v_pool, metadata.slot_mapping)
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        self.attend(q, k_pool, v_pool, metadata, out, scale, softcap)
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
               out: torch.Tensor, scale: float | None = None, softcap: float | None = None) -> None:
        num_tiles, segments = metadata.tile_seq.shape[0], metadata.num_segments
        if num_tiles == 0:
            return
        head_dim_pad = _pow2(self.head_dim)
        # The kernel's softmax is in base 2: scores (and the cap) are scaled by log2(e).
        scale_log2 = (self.head_dim ** -0.5 if scale is None else scale) * math.log2(math.e)
        softcap_log2 = (softcap or 0.0) * math.log2(math.e)
        partial_acc = partial_ml = out  # unused without a split
        if segments > 1:
            num_tokens = q.shape[0]
            partial_acc = torch.empty((num_tokens, self.num_heads, segments, head_dim_pad), dtype=torch.float32,
                                      device=q.device)
            partial_ml = torch.zeros((num_tokens, self.num_heads, segments, 2), dtype=torch.float32, device=q.device)
        _paged_attention_kernel[(num_tiles, self.num_kv_heads, segments)](
            out, partial_acc, partial_ml, q, k_pool, v_pool, metadata.block_tables, metadata.seq_lens,
            metadata.query_start, metadata.tile_seq, metadata.tile_start, scale_log2, metadata.sliding_window,
            softcap_log2, self.num_heads,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), metadata.block_tables.stride(0),
            GROUP=self.group, GROUP_PAD=self.group_pad, BLOCK_Q=metadata.block_q,
            BLOCK_M=metadata.block_q * self.group_pad, HEAD_DIM=self.head_dim, HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=self.block_size, TILE_N=self.tile_n, NUM_SEGMENTS=segments, PRECISION=self.precision,
            HAS_WINDOW=metadata.sliding_window > 0, HAS_SOFTCAP=softcap is not None)
        if segments > 1:
            _merge_segments_kernel[(q.shape[0], self.num_heads)](
                out, partial_acc, partial_ml, self.num_heads, out.stride(0), out.stride(1),
                NUM_SEGMENTS=segments, HEAD_DIM=self.head_dim, HEAD_DIM_PAD=head_dim_pad)
