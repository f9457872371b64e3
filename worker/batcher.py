"""Batcher: builds each engine step's batch (iteration-level scheduling).

Every step: running sequences first (a decode needs one token, or 1 + k with k speculative
drafts to verify; a chunked prefill continues),
then waiting requests are admitted as chunked prefills while the token budget
(max_num_batched_tokens), the sequence cap (max_num_seqs) and free blocks allow. When blocks run
out, the newest running sequence (lowest priority first under the priority policy) is preempted
by recompute: its blocks are freed and it rejoins the front of the queue with prompt + output as
its new prompt, which the prefix cache usually makes cheap to rebuild.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from metroserve.worker.block_manager import BlockManager
from metroserve.worker.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Batcher:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: str = "fcfs"):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.waiting: list[Sequence] = []  # kept in admission order
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if self.policy == "priority":
            key = seq.request.sort_key
            index = next((i for i, s in enumerate(self.waiting) if s.request.sort_key > key), len(self.waiting))
            self.waiting.insert(index, seq)
        else:
            self.waiting.append(seq)

    def fork(self, parent: Sequence, num_new: int) -> list[Sequence]:
        """n > 1: after the prompt's last chunk (`num_new` tokens this step), the request's other
        samples start as forks sharing the parent's blocks, each placed right after the parent so
        they keep its seniority. Returns them."""
        request = parent.request
        children = []
        for index in range(len(request.seqs), request.params.n):
            child = parent.fork(index)
            child.num_computed_tokens = parent.num_computed_tokens + num_new
            self.block_manager.fork(parent, child)
            request.seqs.append(child)
            self.running.insert(self.running.index(parent) + 1, child)
            children.append(child)
        return children

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def schedule_step(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # A speculating decode also computes its lookahead (draft) positions.
            num_new = min(seq.num_tokens - seq.num_computed_tokens + seq.num_lookahead_tokens, budget)
            if seq.num_lookahead_tokens:
                seq.truncate_spec(num_new - 1)
            scheduled = True
            while not bm.allocate(seq, num_new):
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1
                budget += self._preempt(victim, batch)
                if victim is seq:
                    scheduled = False
                    break
            if scheduled:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1

        # Admitting new work while evicting running work would just thrash.
        if batch.num_preempted == 0:
            # Running slots, counting the forks that unforked n > 1 requests will add.
            num_slots = sum(self._seqs_after_fork(s) for s in self.running)
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                if num_slots + self._seqs_after_fork(seq) > self.max_num_seqs:
                    break
                cached = [] if seq.request.needs_prompt_logprobs else bm.find_cached_prefix(seq)
                num_cached = len(cached) * bm.block_size
                num_new = min(seq.num_tokens - num_cached, budget)
                if not bm.allocate(seq, num_new, cached):
                    break
                self.waiting.pop(0)
                seq.num_computed_tokens = num_cached
                request = seq.request
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = time.time()
                    request.num_cached_tokens = num_cached
                    bm.stats.queries += seq.num_tokens
                    bm.stats.hits += num_cached
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                num_slots += self._seqs_after_fork(seq)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new

        batch.blocks_to_copy = bm.pending_copies
        bm.pending_copies = []
        return batch

    def _pick_victim(self) -> Sequence:
        if self.policy == "priority":
            return max(reversed(self.running), key=lambda s: s.request.sort_key)
        return self.running[-1]

    @staticmethod
    def _seqs_after_fork(seq: Sequence) -> int:
        """Running slots seq will take: a request not yet forked will become n sequences."""
        request = seq.request
        return request.params.n - len(request.seqs) + 1

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> int:
        """Evict seq; returns the step budget it had already taken, if it was in the batch."""
        refund = 0
        if seq in batch.seqs:
            index = batch.seqs.index(seq)
            del batch.seqs[index]
            refund = batch.num_new_tokens.pop(index)
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.clear_spec()
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.request.metrics.num_preemptions += 1
        if self.policy == "priority":
            self.add(seq)  # back in priority order, not ahead of more important requests
        else:
            self.waiting.insert(0, seq)
        batch.num_preempted += 1
        self.num_preemptions += 1
        return refund
