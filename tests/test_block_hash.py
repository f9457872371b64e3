"""Golden vectors pin the shared block hash: workers and the scheduler must agree on it forever."""

import hashlib

import numpy as np

from metroserve.common.block_hash import ROOT_HASH, hash_block, hash_prompt_blocks


def test_golden_vectors():
    assert hash_block(ROOT_HASH, list(range(16))).hex() == "bf87b667e2d13854818b89fedb0f46b0"
    assert hash_block(ROOT_HASH, list(range(16)), ("salt",)).hex() == "4949c6decb7fd24e0fa6a886c2fccf14"
    assert [h.hex() for h in hash_prompt_blocks(list(range(40)), 16)] == [
        "bf87b667e2d13854818b89fedb0f46b0", "1be2017f821ca40f3da2dd81ae67d75b"]


def test_encoding_is_the_documented_one():
    tokens = [5, 49151, 0, 7]
    h = hashlib.sha256(ROOT_HASH + np.asarray(tokens, dtype="<i8").tobytes() + (3).to_bytes(4, "little") + b"abc")
    assert hash_block(ROOT_HASH, tokens, ("abc",)) == h.digest()[:16]


def test_chaining_and_extra_keys_separate_contents():
    a = hash_prompt_blocks(list(range(32)), 16)
    b = hash_prompt_blocks([99] + list(range(1, 32)), 16)
    assert a[1] != b[1], "a block's hash must depend on its whole prefix"
    assert hash_block(ROOT_HASH, [1] * 4, ("ab", "c")) != hash_block(ROOT_HASH, [1] * 4, ("a", "bc"))
    assert hash_prompt_blocks(list(range(15)), 16) == []
