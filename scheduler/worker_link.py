"""One connected worker as the scheduler sees it: its lease, load, placements and outbox.

Assignments and ends for a worker accumulate here and leave as one SchedulerMessage per wakeup
of the stream's writer, so a burst of requests costs one message, not one each.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence

from metroserve.common.request_limits import RequestLimits
from metroserve.rpc import cluster_pb2
from metroserve.scheduler.request_state import Placement


class WorkerLink:
    def __init__(self, register: cluster_pb2.Register, limits: RequestLimits):
        self.worker_id = register.worker_id
        self.epoch = register.epoch
        self.model = register.model
        self.pid = register.pid
        self.host = register.host
        self.address = register.address
        self.limits = limits
        self.load = cluster_pb2.LoadReport(num_free_blocks=limits.num_blocks, num_total_blocks=limits.num_blocks)
        # What placement reads of every candidate for every request (scheduler/placement.py's
        # WorkerLoad), kept as plain attributes: num_free_blocks as of the last load report;
        # queued_prefill_tokens, prefill tokens of placements the worker may not have computed yet
        # (reported fewer than twice since placed), kept as a sum. max_num_seqs: for dispatch's
        # filter of candidates with a free slot, which reads every worker for every request.
        self.block_size = limits.block_size
        self.max_num_seqs = limits.max_num_seqs
        self.num_free_blocks = limits.num_blocks
        self.queued_prefill_tokens = 0
        self.draining = False
        self.last_seen = time.monotonic()
        self.placements: dict[str, Placement] = {}
        # Placements their gateway completed whose finish the worker has not reported yet: their
        # blocks still count as placed here (inflight_blocks), their slots are free.
        self.completed: dict[str, Placement] = {}
        # Placements the worker reported at registration whose request no gateway has reported yet
        # (after a scheduler restart): they hold slots until adopted or ended.
        self.orphans: dict[str, cluster_pb2.RunningPlacement] = {}
        self.inflight_blocks: Counter = Counter()
        self.num_placed_seqs = 0
        self._assign: list[cluster_pb2.Assignment] = []
        self._end: list[cluster_pb2.PlacementEnd] = []
        self._report_interval_s = 0.0  # a new interval to send; 0: none
        self.wakeup = asyncio.Event()
        self.closed = asyncio.Event()  # set when the scheduler gives up on this link (lease expired)

    @property
    def capacity(self) -> int:
        return self.max_num_seqs - self.num_placed_seqs

    def load_reported(self, load: cluster_pb2.LoadReport) -> None:
        self.load = load
        self.num_free_blocks = load.num_free_blocks
        if not self.queued_prefill_tokens:
            return
        for placement in self.placements.values():
            placement.reports_since_placed += 1
            if placement.reports_since_placed == 2:
                self.queued_prefill_tokens -= placement.prefill_tokens

    def assign(self, placement: Placement, assignment: cluster_pb2.Assignment | None) -> None:
        """Place it here; `assignment` None: the worker runs it already (adopted after a restart)."""
        placement.worker_id = self.worker_id
        self.placements[placement.placement_id] = placement
        self.inflight_blocks.update(placement.block_hashes)
        self.num_placed_seqs += placement.num_seqs
        if placement.reports_since_placed < 2:
            self.queued_prefill_tokens += placement.prefill_tokens
        if assignment is not None:
            self._assign.append(assignment)
            self.wakeup.set()

    def add_orphan(self, running: cluster_pb2.RunningPlacement) -> None:
        self.orphans[running.placement_id] = running
        self.num_placed_seqs += running.num_seqs

    def take_orphan(self, placement_id: str) -> cluster_pb2.RunningPlacement | None:
        running = self.orphans.pop(placement_id, None)
        if running is not None:
            self.num_placed_seqs -= running.num_seqs
        return running

    def release(self, placement: Placement, abort: bool, finish_reasons: Sequence[str] = (),
                num_tokens: Sequence[int] = ()) -> None:
        """The placement is over here: finished, ended by the scheduler (tell the worker each
        sequence's finish reason, none given: all "abort", and the output tokens the client got)
        or handed back."""
        if self.placements.pop(placement.placement_id, None) is None:
            return
        self._free_slots(placement)
        self._drop_blocks(placement)
        if abort:
            unsent = [a for a in self._assign if a.placement_id != placement.placement_id]
            if len(unsent) < len(self._assign):  # never reached the worker: nothing to abort there
                self._assign = unsent
            else:
                self.end(placement.placement_id, finish_reasons, num_tokens)

    def complete(self, placement: Placement) -> None:
        """Its gateway delivered every sequence: the slots are free now, but its blocks count as
        placed here until the worker's own finish, which comes with the block events that put them
        in the prefix index."""
        if self.placements.pop(placement.placement_id, None) is None:
            return
        self._free_slots(placement)
        self.completed[placement.placement_id] = placement

    def drop_completed(self, placement_id: str) -> None:
        """The worker reported its finish of a placement completed before: its blocks are indexed."""
        self._drop_blocks(self.completed.pop(placement_id, None))

    def _free_slots(self, placement: Placement) -> None:
        self.num_placed_seqs -= placement.num_seqs
        if placement.reports_since_placed < 2:
            self.queued_prefill_tokens -= placement.prefill_tokens

    def _drop_blocks(self, placement: Placement | None) -> None:
        if placement is None:
            return
        for h in placement.block_hashes:
            self.inflight_blocks[h] -= 1
            if self.inflight_blocks[h] <= 0:
                del self.inflight_blocks[h]

    def end(self, placement_id: str, finish_reasons: Sequence[str] = (), num_tokens: Sequence[int] = ()) -> None:
        """Tell the worker to end a placement it runs."""
        self._end.append(cluster_pb2.PlacementEnd(placement_id=placement_id, finish_reasons=list(finish_reasons),
                                                  num_tokens=list(num_tokens)))
        self.wakeup.set()

    def report_every(self, interval_s: float) -> None:
        """Tell the worker how often to report (sent at once: it changes rarely)."""
        self._report_interval_s = interval_s
        self.wakeup.set()

    def take_message(self) -> cluster_pb2.SchedulerMessage | None:
        if not self._assign and not self._end and not self._report_interval_s:
            return None
        msg = cluster_pb2.SchedulerMessage(assign=self._assign, end=self._end,
                                           report_interval_s=self._report_interval_s)
        self._assign, self._end, self._report_interval_s = [], [], 0.0
        return msg
