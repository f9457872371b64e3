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

from collections import Counter
from typing import Protocol, TypeVar

# One more running sequence costs about this many prefill tokens: each step is slower for everyone.
RUNNING_SEQ_COST = 16.0
# Placing a prompt that does not fit in the free blocks means preemption or waiting there.
NO_ROOM_PENALTY = 1e6


class WorkerLoad(Protocol):
    """What placement reads of a candidate worker (scheduler/worker_link.py's WorkerLink is one:
    read in place, since every placement reads every candidate)."""

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


def placement_cost(num_prompt_tokens: int, overlap_blocks: int, load: WorkerLoad) -> float:
    to_compute = max(num_prompt_tokens - overlap_blocks * load.block_size, 1)
    cost = to_compute + load.queued_prefill_tokens + RUNNING_SEQ_COST * load.num_placed_seqs
    if -(-to_compute // load.block_size) > load.num_free_blocks:
        cost += NO_ROOM_PENALTY
    return cost


L = TypeVar("L", bound=WorkerLoad)


def choose_worker(num_prompt_tokens: int, hashes: list[bytes], loads: list[L],
                  index_overlap: dict[str, int]) -> tuple[L, int]:
    """The cheapest worker and how many leading prompt blocks it holds. Ties go to the first listed."""
    best: tuple[float, L, int] | None = None
    for load in loads:
        overlap = max(index_overlap.get(load.worker_id, 0), leading_matches(hashes, load.inflight_blocks))
        cost = placement_cost(num_prompt_tokens, overlap, load)
        if best is None or cost < best[0]:
            best = (cost, load, overlap)
    assert best is not None, "choose_worker needs at least one worker"
    return best[1], best[2]
