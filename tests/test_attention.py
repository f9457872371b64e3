"""Attention backends agree: the compiled CPU kernels against the torch (SDPA) backend, and both
against a dense reference with sliding windows, soft-capping and custom scales."""

import numpy as np
import pytest
import torch

from metroserve.worker.attention import BatchLayout, TorchAttention, block_tables_to_slots
from metroserve.worker.attention.base import first_visible
from metroserve.worker.attention.cpu import CpuAttention
from metroserve.worker.attention.torch_backend import write_kv
from metroserve.worker.cpu_kernels import load_cpu_kernels
from metroserve.worker.kv_cache import KVCache


def random_layout(rng: torch.Generator, num_blocks: int, bs: int, query_lens: list[int], context_lens: list[int]):
    perm = torch.randperm(num_blocks, generator=rng).tolist()
    tables = []
    for ctx in context_lens:
        n = -(-ctx // bs)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
    seq_index = np.repeat(np.arange(len(query_lens)), query_lens)
    positions = np.concatenate([np.arange(ctx - q_len, ctx) for q_len, ctx in zip(query_lens, context_lens)])
    padded, slots = block_tables_to_slots(tables, seq_index, positions, bs, torch.device("cpu"))
    starts = np.cumsum([0, *query_lens[:-1]]).tolist()
    return BatchLayout(starts, list(query_lens), list(context_lens), tables, padded, slots)


def test_block_tables_to_slots():
    """Slot = block id * block size + offset; tables pad with block 0 to the longest."""
    tables, slots = block_tables_to_slots([[7, 2], [5]], np.array([0, 0, 0, 1]), np.array([0, 3, 4, 2]), 4,
                                          torch.device("cpu"))
    assert tables.tolist() == [[7, 2], [5, 0]] and tables.dtype == torch.int64
    assert slots.tolist() == [28, 31, 8, 22] and slots.dtype == torch.int64


# Block sizes other than 16 and contexts that are not multiples of 8 exercise the row lookup, the
# 8-key vector loop and its scalar tail; head_dim 128 takes the values in two 64-dim chunks; GQA
# groups of 1, 3 and 8 give the prefill kernel query tiles of 64, 63 (padded) and 64 columns.
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, bs",
                         [(4, 4, 16, 16), (9, 3, 64, 16), (8, 1, 32, 16), (16, 2, 128, 32), (6, 2, 64, 8)])
def test_cpu_kernel_matches_torch_backend(num_heads, num_kv_heads, head_dim, bs):
    if load_cpu_kernels() is None:
        pytest.skip("no C++ toolchain for the CPU kernel")
    rng = torch.Generator().manual_seed(num_heads)
    num_blocks = 3200 // bs
    cache = KVCache(1, num_blocks, bs, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    cache.k.normal_(generator=rng)
    cache.v.normal_(generator=rng)
    # Decodes with assorted context lengths (1, block edges, long), short chunks that attend row by
    # row, and prefill chunks with and without earlier context: 150 and 200 rows span several of
    # the prefill kernel's query tiles and 64-key tiles, with the diagonal inside a tile.
    query_lens = [1, 1, 1, 1, 1, 7, 33, 1, 150, 200]
    context_lens = [1, 16, 17, 300, 129, 7, 80, 2, 150, 523]
    layout = random_layout(rng, num_blocks, bs, query_lens, context_lens)
    total = sum(query_lens)
    # Q as the model passes it: a view of the fused Q/K rows, so rows are strided.
    q = torch.randn(total, num_heads + num_kv_heads, head_dim, generator=rng)[:, :num_heads]
    k = torch.randn(total, num_kv_heads, head_dim, generator=rng)
    v = torch.randn(total, num_kv_heads, head_dim, generator=rng)
    torch_backend, cpu_backend = TorchAttention(bs, decode_group_size=3), CpuAttention(bs)
    cache_copy = KVCache(1, num_blocks, bs, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    cache_copy.k.copy_(cache.k)
    cache_copy.v.copy_(cache.v)
    expected = torch_backend.forward(0, q, k, v, cache, torch_backend.prepare(layout))
    got = cpu_backend.forward(0, q, k, v, cache_copy, cpu_backend.prepare(layout))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert torch.equal(cache.k, cache_copy.k) and torch.equal(cache.v, cache_copy.v)


def dense_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layout: BatchLayout,
                    window: int | None, scale: float | None, softcap: float | None) -> torch.Tensor:
    """Each query token over its sequence's whole context in the pools, in float64, as Hugging Face's
    eager attention computes it: scores * scale, soft-capped, then the (sliding-window) causal mask
    that lets position p see keys (p - window, p]. Returns [T, H * D] float32."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    bs, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for table, start, q_len, ctx in zip(layout.block_tables, layout.query_start, layout.query_lens, layout.seq_lens):
        keys = torch.arange(ctx)
        slots = torch.tensor(table)[keys // bs] * bs + keys % bs
        k, v = (pool.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(num_heads // num_kv_heads, 1)
                for pool in (k_pool, v_pool))
        scores = torch.einsum("qhd,khd->hqk", q[start : start + q_len].double(), k)
        scores *= head_dim ** -0.5 if scale is None else scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        rows = torch.arange(ctx - q_len, ctx)[:, None]
        visible = keys[None, :] <= rows
        if window is not None:
            visible &= keys[None, :] > rows - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.float().view(len(q), -1)


def poison_unseen_blocks(cache: KVCache, layout: BatchLayout, window: int) -> None:
    """NaN in the blocks that end before every query of their sequence sees a key (block 0 aside:
    it pads tables), so that a backend that reads outside the window returns NaN."""
    bs = cache.k.shape[2]
    for table, q_len, ctx in zip(layout.block_tables, layout.query_lens, layout.seq_lens):
        unseen = first_visible(ctx - q_len + 1, window) // bs
        blocks = [b for b in table[:unseen] if b != 0]
        cache.k[0, blocks] = float("nan")
        cache.v[0, blocks] = float("nan")


# Decodes with a context of 1, inside a block, on and past a block edge and far longer than any
# window; speculative-verification rows (5 and 17 tokens) after context; prefill chunks after
# cached context and on their own (60 tokens, longer than most windows; 30, shorter than some).
WINDOW_QUERY_LENS = [1, 1, 1, 1, 1, 5, 17, 40, 60, 30]
WINDOW_CONTEXT_LENS = [1, 3, 16, 17, 300, 50, 117, 140, 60, 35]


def windowed_case(backend, window: int | None, scale: float | None, softcap: float | None,
                  query_lens: list[int] = WINDOW_QUERY_LENS, context_lens: list[int] = WINDOW_CONTEXT_LENS,
                  device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(backend's output, dense reference) for one batch of 6 query heads over 2 KV heads of 32 dims
    in blocks of 16; the blocks outside every window are NaN."""
    rng = torch.Generator().manual_seed(0)
    num_blocks, bs, num_heads, num_kv_heads, head_dim = 64, 16, 6, 2, 32
    cache = KVCache(1, num_blocks, bs, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    cache.k.normal_(generator=rng)
    cache.v.normal_(generator=rng)
    layout = random_layout(rng, num_blocks, bs, query_lens, context_lens)
    total = sum(query_lens)
    # Scores of a few units, so that a soft-cap of 2 to 3 changes them.
    q = 3 * torch.randn(total, num_heads + num_kv_heads, head_dim, generator=rng)[:, :num_heads]
    kv = torch.randn(total, 2 * num_kv_heads, head_dim, generator=rng)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    clean = KVCache(1, num_blocks, bs, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    clean.k.copy_(cache.k)
    clean.v.copy_(cache.v)
    if window is not None:
        poison_unseen_blocks(cache, layout, window)
    write_kv(0, k, v, clean, layout.slot_mapping)
    expected = dense_attention(q, clean.k[0], clean.v[0], layout, window, scale, softcap)
    cache.k, cache.v = cache.k.to(device), cache.v.to(device)
    moved = BatchLayout(layout.query_start, layout.query_lens, layout.seq_lens, layout.block_tables,
                        layout.block_table_tensor.to(device), layout.slot_mapping.to(device))
    got = backend.forward(0, q.to(device), k.to(device), v.to(device), cache, backend.prepare(moved, window),
                          scale, softcap)
    return got.cpu(), expected


WINDOWS = [None, 3, 16, 40, 1000]  # none, inside a block (16), one block, several, longer than every context
SCALES_AND_CAPS = [(None, None), (0.3, None), (None, 2.0), (0.2, 3.0)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("scale, softcap", SCALES_AND_CAPS)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_backend_matches_dense_reference(backend, window, scale, softcap):
    if backend == "cpu" and load_cpu_kernels() is None:
        pytest.skip("no C++ toolchain for the CPU kernel")
    attention = TorchAttention(16, decode_group_size=3) if backend == "torch" else CpuAttention(16)
    got, expected = windowed_case(attention, window, scale, softcap)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_windowed_torch_metadata_gathers_only_the_window():
    """A decode at 300 and a 40-token chunk after 100 with a window of 20 gather the blocks the window reaches."""
    layout = random_layout(torch.Generator().manual_seed(0), 64, 16, [1, 40], [300, 140])
    meta = TorchAttention(16).prepare(layout, sliding_window=20)
    (group,) = meta.decode_groups
    assert group.padded_len == 2 * 16  # keys 280..299: blocks 17 and 18
    assert group.block_ids.tolist() == layout.block_tables[0][17:19]
    (chunk,) = meta.prefills
    assert chunk.block_ids is not None and chunk.block_ids.tolist() == layout.block_tables[1][5:9]  # keys 81..139
    assert chunk.key_len == 140 - 80 and chunk.mask is not None and chunk.mask.sum(1).tolist() == [20] * 40
    plain = TorchAttention(16).prepare(layout)
    assert plain.decode_groups[0].padded_len == 304 and plain.prefills[0].key_len == 140


def test_importing_the_package_leaves_triton_and_the_cpu_kernels_unloaded():
    import subprocess
    import sys

    code = ("import sys, metroserve.worker.attention as a; a.TorchAttention; "
            "print(sorted(m for m in ('triton', 'metroserve.worker.cpu_kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"
