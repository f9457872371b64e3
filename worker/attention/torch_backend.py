"""Paged attention from torch ops (SDPA), for any device; also the KV write the CPU backend reuses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metroserve.worker.attention.base import (
    MAX_ROW_QUERY,
    BatchLayout,
    QueryRows,
    first_visible,
    query_rows,
    window_size,
)
from metroserve.worker.kv_cache import KVCache


@dataclass
class _Prefill:
    start: int
    end: int
    block_ids: torch.Tensor | None  # None: the keys are the chunk's own K/V (no earlier context)
    key_len: int  # keys taken from the gathered blocks, from the first block's first position
    mask: torch.Tensor | None  # [q_len, key_len], True where attention is allowed; None: causal in the chunk


@dataclass
class _DecodeGroup:
    token_index: torch.Tensor  # [g] rows of the flat batch
    block_ids: torch.Tensor  # [g * blocks_per_seq], each row's blocks from the first one it sees
    padded_len: int
    mask: torch.Tensor  # [g, 1, 1, padded_len]


@dataclass
class TorchMetadata:
    slot_mapping: torch.Tensor
    prefills: list[_Prefill]
    decode_groups: list[_DecodeGroup]
    sliding_window: int = 0  # 0: none (already applied in the masks and gathers)


def write_kv(layer: int, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store this step's K/V in their slots (rounded to the pool's dtype, e.g. --kv-cache-dtype
    bfloat16); returns the layer's (k_pool, v_pool)."""
    k_pool, v_pool = kv_cache.k[layer], kv_cache.v[layer]
    k_pool.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k.to(k_pool.dtype))
    v_pool.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v.to(v_pool.dtype))
    return k_pool, v_pool


class TorchAttention:
    """Paged attention from torch ops, for any device.

    Single-token query rows (decodes, verification tokens) are batched: sorted by the context they
    see (with a sliding window, from the first block in it) and cut into groups so a group pads
    little, each group's blocks gathered with one index_select and attended with one SDPA call.
    Multi-token chunks (prefills) attend one sequence at a time; a chunk with no earlier context
    needs no gather at all, and a windowed chunk gathers only the blocks its window reaches.
    """

    def __init__(self, block_size: int, decode_group_size: int = 32):
        self.block_size = block_size
        self.decode_group_size = decode_group_size

    def prepare(self, layout: BatchLayout, sliding_window: int | None = None) -> TorchMetadata:
        window = window_size(sliding_window)
        return TorchMetadata(layout.slot_mapping, self._prepare_prefills(layout, window),
                             self._prepare_decodes(layout, query_rows(layout), window), window)

    def _prepare_prefills(self, layout: BatchLayout, window: int) -> list[_Prefill]:
        device = layout.slot_mapping.device
        bs = self.block_size
        prefills: list[_Prefill] = []
        for i, q_len in enumerate(layout.query_lens):
            if q_len <= MAX_ROW_QUERY:
                continue
            start, ctx = layout.query_start[i], layout.seq_lens[i]
            if ctx == q_len and not 0 < window < q_len:
                prefills.append(_Prefill(start, start + q_len, None, ctx, None))
                continue
            # Keys from the first block that the chunk's first query sees.
            first_block = first_visible(ctx - q_len + 1, window) // bs
            keys = torch.arange(first_block * bs, ctx, device=device)[None, :]
            rows = torch.arange(ctx - q_len, ctx, device=device)[:, None]  # query j's position
            mask = keys <= rows
            if window:
                mask &= keys > rows - window
            blocks = None if ctx == q_len else torch.tensor(layout.block_tables[i][first_block : -(-ctx // bs)],
                                                            device=device)
            prefills.append(_Prefill(start, start + q_len, blocks, ctx - first_block * bs, mask))
        return prefills

    def _prepare_decodes(self, layout: BatchLayout, rows: QueryRows, window: int) -> list[_DecodeGroup]:
        device = layout.slot_mapping.device
        bs = self.block_size
        # A row gathers its blocks from the first one it sees; its keys are local to that block.
        first_block = [first_visible(n, window) // bs for n in rows.seq_lens]
        local_lens = [n - b * bs for n, b in zip(rows.seq_lens, first_block)]
        groups: list[_DecodeGroup] = []
        order = sorted(range(len(rows.token_index)), key=lambda r: local_lens[r])
        for g0 in range(0, len(order), self.decode_group_size):
            members = order[g0 : g0 + self.decode_group_size]
            num_blocks = -(-local_lens[members[-1]] // bs)
            table = []
            for r in members:
                blocks = layout.block_tables[rows.seq_index[r]][first_block[r] : first_block[r] + num_blocks]
                table.append(blocks + [0] * (num_blocks - len(blocks)))
            lens = torch.tensor([local_lens[r] for r in members], device=device)[:, None]
            padded = num_blocks * bs
            keys = torch.arange(padded, device=device)[None, :]
            mask = keys < lens
            if window:
                mask &= keys >= lens - window
            groups.append(_DecodeGroup(
                token_index=torch.tensor([rows.token_index[r] for r in members], device=device),
                block_ids=torch.tensor(table, device=device).flatten(),
                padded_len=padded,
                mask=mask[:, None, None, :],
            ))
        return groups

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: TorchMetadata, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]. Returns [T, H * D]."""
        num_tokens, num_heads, head_dim = q.shape
        k_pool, v_pool = write_kv(layer, k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._prefill_attention(q, k, v, k_pool, v_pool, metadata.prefills, scale, softcap, out)
        self._decode_attention(q, k_pool, v_pool, metadata, scale, softcap, out)
        return out.view(num_tokens, num_heads * head_dim)

    @staticmethod
    def _prefill_attention(q, k, v, k_pool, v_pool, prefills: list[_Prefill], scale: float | None,
                           softcap: float | None, out: torch.Tensor) -> None:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        for p in prefills:
            qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
            if p.block_ids is None:
                ks, vs = k[p.start : p.end], v[p.start : p.end]
            else:
                ks = k_pool.index_select(0, p.block_ids).view(-1, num_kv_heads, head_dim)[: p.key_len]
                vs = v_pool.index_select(0, p.block_ids).view(-1, num_kv_heads, head_dim)[: p.key_len]
            o = attend(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), p.mask, scale, softcap)
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)

    @staticmethod
    def _decode_attention(q, k_pool, v_pool, metadata: TorchMetadata, scale: float | None, softcap: float | None,
                          out: torch.Tensor) -> None:
        num_kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
        for g in metadata.decode_groups:
            n = g.token_index.numel()
            qs = q.index_select(0, g.token_index).unsqueeze(2)  # [g, H, 1, D]
            ks = k_pool.index_select(0, g.block_ids).view(n, g.padded_len, num_kv_heads, head_dim).transpose(1, 2)
            vs = v_pool.index_select(0, g.block_ids).view(n, g.padded_len, num_kv_heads, head_dim).transpose(1, 2)
            o = attend(qs, ks, vs, g.mask, scale, softcap)
            out.index_copy_(0, g.token_index, o.squeeze(2))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
           softcap: float | None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q: [B, H, Lq, D], k, v: [B, Hkv, Lk, D] (H a multiple of Hkv).

    mask broadcasts to [B, H, Lq, Lk], True where attention is allowed; None is causal with q and k
    ending together. SDPA has no soft-capping, so with softcap the scores are computed explicitly
    (the softmax in float32, as Hugging Face's eager attention does)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        q_len, k_len = q.shape[-2], k.shape[-2]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs.to(v.dtype), v)
