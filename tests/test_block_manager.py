"""BlockManager unit tests: ref counts, prefix hits, LRU eviction order, copy-on-write."""

from metroserve.common.sampling_params import SamplingParams
from metroserve.worker.block_manager import BlockManager
from metroserve.worker.sequence import Request


def make_seq(tokens, salt=None):
    return Request("r", None, list(tokens), SamplingParams(), cache_salt=salt).seqs[0]


def compute(bm, seq):
    """Allocate and 'compute' the whole sequence, as the engine would over its steps."""
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - len(cached) * bm.block_size, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return len(cached) * bm.block_size


def test_prefix_hit_reuses_blocks_and_caps_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(range(12))
    assert compute(bm, a) == 0
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 16
    b = make_seq(range(12))
    # 12 tokens = 3 full blocks, but the last token must be computed: only 2 blocks hit.
    assert compute(bm, b) == 8
    assert b.block_table[:2] == a_blocks[:2]
    c = make_seq(list(range(12)) + [99])
    assert compute(bm, c) == 12
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 16 and all(r == 0 for r in bm.ref_cnt)


def test_salt_separates_caches():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(9), salt="alice")
    compute(bm, a)
    assert compute(bm, make_seq(range(9), salt="bob")) == 0
    assert compute(bm, make_seq(range(9), salt="alice")) == 8


def test_eviction_takes_chain_tail_first_and_unhashed_blocks_before_cached():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(range(13))  # 3 full blocks + 1 partial
    compute(bm, a)
    table = list(a.block_table)
    bm.free(a)
    order = list(bm.free_queue)
    assert order[0] == table[3], "the partial (unhashed) block goes first"
    assert order.index(table[2]) < order.index(table[1]) < order.index(table[0]), "tail before head"
    # Allocating 4 fresh blocks evicts the partial one, two unused, then the chain tail only.
    b = make_seq([1000 + i for i in range(16)])
    bm.allocate(b, 16)
    assert bm.stats.evictions == 1
    bm.free(b)
    assert compute(bm, make_seq(list(range(8)) + [7000])) == 8, "the chain head survived"


def test_allocate_refuses_when_full_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = make_seq(range(12))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_fork_copy_on_write_for_shared_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(range(6))  # one full block + a partial one
    compute(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert bm.ref_cnt[parent.block_table[1]] == 2
    child.token_ids.append(42)
    assert bm.allocate(child, 1)
    src, dst = bm.pending_copies.pop()
    assert src == parent.block_table[1] and child.block_table[1] == dst != src
    assert child.block_table[0] == parent.block_table[0], "full blocks stay shared"
    assert bm.ref_cnt[src] == 1
    parent.token_ids.append(43)
    assert bm.allocate(parent, 1) and not bm.pending_copies, "sole owner writes in place"
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8
