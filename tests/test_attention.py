"""Attention backends agree: the compiled CPU kernels against the torch (SDPA) backend."""

import numpy as np
import pytest
import torch

from metroserve.worker.attention import BatchLayout, TorchAttention, block_tables_to_slots
from metroserve.worker.attention.cpu import CpuAttention
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


def test_importing_the_package_leaves_triton_and_the_cpu_kernels_unloaded():
    import subprocess
    import sys

    code = ("import sys, metroserve.worker.attention as a; a.TorchAttention; "
            "print(sorted(m for m in ('triton', 'metroserve.worker.cpu_kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"
