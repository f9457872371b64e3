"""Paged attention from torch ops (SDPA), for any device; also the KV write the CPU backend reuses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metroserve.worker.attention.base import MAX_ROW_QUERY, BatchLayout, QueryRows, query_rows
from metroserve.worker.kv_cache import KVCache


@dataclass
class _Prefill:
    start: int
    end: int
    block_ids: torch.Tensor | None  # None: no earlier context, attend within the chunk only
    context_len: int
    mask: torch.Tensor | None  # [q_len, context_len], True where attention is allowed


@dataclass
class _DecodeGroup:
    token_index: torch.Tensor  # [g] rows of the flat batch
    block_ids: torch.Tensor  # [g * blocks_per_seq]
    padded_len: int
    mask: torch.Tensor  # [g, 1, 1, padded_len]


@dataclass
class TorchMetadata:
    slot_mapping: torch.Tensor
    prefills: list[_Prefill]
    decode_groups: list[_DecodeGroup]


def write_kv(layer: int, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store this step's K/V in their slots; returns the layer's (k_pool, v_pool)."""
    k_pool, v_pool = kv_cache.k[layer], kv_cache.v[layer]
    k_pool.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_pool.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
    return k_pool, v_pool


class TorchAttention:
    """Paged attention from torch ops, for any device.

    Single-token query rows (decodes, verification tokens) are batched: sorted by context length
    and cut into groups so a group pads little, each group's blocks gathered with one index_select
    and attended with one SDPA call. Multi-token chunks (prefills) attend one sequence at a time;
    a chunk with no earlier context needs no gather at all.
    """

    def __init__(self, block_size: int, decode_group_size: int = 32):
        self.block_size = block_size
        self.decode_group_size = decode_group_size

    def prepare(self, layout: BatchLayout) -> TorchMetadata:
        return TorchMetadata(layout.slot_mapping, self._prepare_prefills(layout),
                             self._prepare_decodes(layout, query_rows(layout)))

    def _prepare_prefills(self, layout: BatchLayout) -> list[_Prefill]:
        device = layout.slot_mapping.device
        bs = self.block_size
        prefills: list[_Prefill] = []
        for i, q_len in enumerate(layout.query_lens):
            if q_len <= MAX_ROW_QUERY:
                continue
            start, ctx = layout.query_start[i], layout.seq_lens[i]
            if ctx == q_len:
                prefills.append(_Prefill(start, start + q_len, None, ctx, None))
                continue
            blocks = torch.tensor(layout.block_tables[i][: -(-ctx // bs)], device=device)
            # Query j sits at position ctx - q_len + j and sees keys up to it.
            rows = torch.arange(ctx - q_len, ctx, device=device)[:, None]
            mask = torch.arange(ctx, device=device)[None, :] <= rows
            prefills.append(_Prefill(start, start + q_len, blocks, ctx, mask))
        return prefills

    def _prepare_decodes(self, layout: BatchLayout, rows: QueryRows) -> list[_DecodeGroup]:
        device = layout.slot_mapping.device
        bs = self.block_size
        groups: list[_DecodeGroup] = []
        order = sorted(range(len(rows.token_index)), key=lambda r: rows.seq_lens[r])
        for g0 in range(0, len(order), self.decode_group_size):
            members = order[g0 : g0 + self.decode_group_size]
            num_blocks = -(-rows.seq_lens[members[-1]] // bs)
            tables = [layout.block_tables[rows.seq_index[r]] for r in members]
            table = [t[:num_blocks] + [0] * (num_blocks - min(num_blocks, len(t))) for t in tables]
            lens = torch.tensor([rows.seq_lens[r] for r in members], device=device)
            padded = num_blocks * bs
            mask = (torch.arange(padded, device=device)[None, :] < lens[:, None])[:, None, None, :]
            groups.append(_DecodeGroup(
                token_index=torch.tensor([rows.token_index[r] for r in members], device=device),
                block_ids=torch.tensor(table, device=device).flatten(),
                padded_len=padded,
                mask=mask,
            ))
        return groups

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: TorchMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]. Returns [T, H * D]."""
        num_tokens, num_heads, head_dim = q.shape
        k_pool, v_pool = write_kv(layer, k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._prefill_attention(q, k, v, k_pool, v_pool, metadata.prefills, out)
        self._decode_attention(q, k_pool, v_pool, metadata, out)
        return out.view(num_tokens, num_heads * head_dim)

    @staticmethod
    def _prefill_attention(q, k, v, k_pool, v_pool, prefills: list[_Prefill], out: torch.Tensor) -> None:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        for p in prefills:
            qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
            if p.block_ids is None:
                ks = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
                vs = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                ks = k_pool.index_select(0, p.block_ids).view(-1, num_kv_heads, head_dim)[: p.context_len]
                vs = v_pool.index_select(0, p.block_ids).view(-1, num_kv_heads, head_dim)[: p.context_len]
                o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                                   attn_mask=p.mask, enable_gqa=True)
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)

    @staticmethod
    def _decode_attention(q, k_pool, v_pool, metadata: TorchMetadata, out: torch.Tensor) -> None:
        num_kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
        for g in metadata.decode_groups:
            n = g.token_index.numel()
            qs = q.index_select(0, g.token_index).unsqueeze(2)  # [g, H, 1, D]
            ks = k_pool.index_select(0, g.block_ids).view(n, g.padded_len, num_kv_heads, head_dim).transpose(1, 2)
            vs = v_pool.index_select(0, g.block_ids).view(n, g.padded_len, num_kv_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=g.mask, enable_gqa=True)
            out.index_copy_(0, g.token_index, o.squeeze(2))
