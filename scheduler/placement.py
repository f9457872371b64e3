"""Where a sequence goes: the worker with the lowest estimated cost, in prefill-token units.

cost = prompt tokens it would have to compute (those past the prefix it already holds)
     + prefill tokens already queued there
     + RUNNING_SEQ_COST per sequence placed there
     + a penalty when its free KV blocks cannot hold the prompt.

So a worker holding a long shared prefix keeps winning until it is busier, by about the prefix's
length, than the others; unrelated prompts (no overlap anywhere) go to the least loaded worker.
The held prefix is the longer of what the prefix-block index says (blocks the worker reported)
and what was just placed there (blocks it is computing now, not yet reported).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Protocol, TypeVar

# One more running sequence costs about this many prefill tokens: each step is slower for everyone.
RUNNING_SEQ_COST = 16.0
# Placing a prompt that does not fit in the free blocks means preemption or waiting there.
NO_ROOM_PENALTY = 1e6


class WorkerLoad(Protocol):
    """What placement reads of a candidate worker (scheduler/worker_link.py's WorkerLink is one:
    read in place, since every placement reads every candidate; plain attributes there, since a
    property read is a Python call)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def num_placed_seqs(self) -> int: ...
    @property
    def queued_prefill_tokens(self) -> int: ...  # prefill tokens placed there, maybe not computed yet
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def inflight_blocks(self) -> Counter: ...  # block hash -> placements computing it there now


def leading_matches(hashes: list[bytes], held: Counter) -> int:
    n = 0
    for h in hashes:
        if not held.get(h):  # not held[h]: a Counter's miss is a Python-level call
            break
        n += 1
    return n


L = TypeVar("L", bound=WorkerLoad)


def choose_worker(num_prompt_tokens: int, hashes: list[bytes], loads: list[L],
                  index_overlap: dict[str, int]) -> tuple[L, int]:
    """The cheapest worker and how many leading prompt blocks it holds. Ties go to the first listed.

    Runs per request over every candidate (64 workers: 64 passes), so the cost is computed inline:
    a worker computing none of the prompt's first block is not searched further."""
    first = hashes[0] if hashes else None
    best_cost, best, best_overlap = math.inf, None, 0
    for load in loads:
        overlap = index_overlap.get(load.worker_id, 0) if index_overlap else 0
        inflight = load.inflight_blocks
        if first is not None and inflight and inflight.get(first):
            overlap = max(overlap, leading_matches(hashes, inflight))
        block_size = load.block_size
        to_compute = num_prompt_tokens - overlap * block_size
        if to_compute < 1:
            to_compute = 1
        cost = to_compute + load.queued_prefill_tokens + RUNNING_SEQ_COST * load.num_placed_seqs
        if -(-to_compute // block_size) > load.num_free_blocks:
            cost += NO_ROOM_PENALTY
        if cost < best_cost:
            best_cost, best, best_overlap = cost, load, overlap
    assert best is not None, "choose_worker needs at least one worker"
    return best, best_overlap
