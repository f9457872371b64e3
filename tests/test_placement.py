"""Placement cost: prefix overlap against load, without processes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from metroserve.common.block_hash import hash_prompt_blocks
from metroserve.scheduler.placement import RUNNING_SEQ_COST, choose_worker, leading_matches

BS = 16


@dataclass
class Load:  # a scheduler.placement.WorkerLoad
    worker_id: str
    num_placed_seqs: int
    queued_prefill_tokens: int
    num_free_blocks: int
    block_size: int
    inflight_blocks: Counter


def load(worker_id: str, placed: int = 0, queued: int = 0, free: int = 1000, inflight: Counter | None = None):
    return Load(worker_id, placed, queued, free, BS, inflight or Counter())


def test_holder_of_a_long_prefix_wins_until_much_busier():
    prompt = list(range(400))
    hashes = hash_prompt_blocks(prompt, BS)
    overlap = {"a": len(hashes)}
    chosen, blocks = choose_worker(len(prompt), hashes, [load("b"), load("a", placed=10)], overlap)
    assert chosen.worker_id == "a" and blocks == len(hashes)
    # Once "a" is busier by more than the prefix is worth, the idle worker wins.
    too_busy = int(len(prompt) / RUNNING_SEQ_COST) + 2
    chosen, _ = choose_worker(len(prompt), hashes, [load("b"), load("a", placed=too_busy)], overlap)
    assert chosen.worker_id == "b"


def test_without_overlap_the_least_loaded_wins():
    hashes = hash_prompt_blocks(list(range(64)), BS)
    chosen, blocks = choose_worker(64, hashes, [load("a", placed=3), load("b", placed=1), load("c", queued=500)], {})
    assert chosen.worker_id == "b" and blocks == 0


def test_blocks_being_computed_count_as_held():
    hashes = hash_prompt_blocks(list(range(320)), BS)
    inflight = Counter(hashes[:10])
    assert leading_matches(hashes, inflight) == 10
    chosen, blocks = choose_worker(320, hashes, [load("a"), load("b", placed=2, inflight=inflight)], {})
    assert chosen.worker_id == "b" and blocks == 10


def test_a_worker_without_room_is_avoided():
    hashes = hash_prompt_blocks(list(range(320)), BS)
    chosen, _ = choose_worker(320, hashes, [load("a", free=3), load("b", placed=20)], {"a": 5})
    assert chosen.worker_id == "b"
