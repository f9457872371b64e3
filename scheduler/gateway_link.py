"""One connected gateway as the scheduler sees it: its requests and its outbox.

A gateway owns its requests: their clients, their tokens (straight from the workers) and their
Abort. The scheduler answers its submissions: a refusal or "queued" at once; "placed" only with
another message or at the next lease check (its worker's first output usually says it sooner, and
the gateway's wait for an answer is bounded, so a placement whose first step is slow still gets
one within about a second). It tells the gateway of failures, asks it for the tokens it delivered
when a placement must move, tells it whether requests wait in the queue, and keeps it up to date
on the workers to subscribe to. Everything for one gateway accumulates here and leaves as one
GatewayControl per wakeup; a refusal goes before an acknowledgment in the same message, so a
request refused by its worker at once still fails before its stream starts.
"""

from __future__ import annotations

import asyncio

from metroserve.rpc import cluster_pb2
from metroserve.scheduler.request_state import Placement


class GatewayLink:
    def __init__(self, gateway_id: str):
        self.gateway_id = gateway_id
        self._status: list[cluster_pb2.RequestStatus] = []
        self._resume: list[cluster_pb2.ResumeQuery] = []
        self._workers: cluster_pb2.GatewayControl | None = None
        self._requests_waiting: bool | None = None  # unsent news about the queue
        self._placed: list[str] = []  # requests placed at once, not yet acknowledged
        self._flush_placed = False
        self.wakeup = asyncio.Event()
        self.closed = asyncio.Event()

    def status(self, status: cluster_pb2.RequestStatus) -> None:
        self._status.append(status)
        self.wakeup.set()

    def query_resume(self, placement: Placement) -> None:
        self._resume.append(cluster_pb2.ResumeQuery(
            placement_id=placement.placement_id, request_id=placement.request.request_id,
            base_index=placement.base_index, num_seqs=placement.num_seqs))
        self.wakeup.set()

    def workers_changed(self, control: cluster_pb2.GatewayControl) -> None:
        """`control`: the full worker list and models (workers_changed set); replaces an unsent one."""
        self._workers = control
        self.wakeup.set()

    def placed(self, request_id: str) -> None:
        """Acknowledge, with the next message, a request placed at once (no wakeup of its own)."""
        self._placed.append(request_id)

    def flush_placed(self) -> None:
        """Send pending acknowledgments now (the lease check's tick: at most one message a tick)."""
        if self._placed:
            self._flush_placed = True
            self.wakeup.set()

    def requests_waiting(self, waiting: bool) -> None:
        """The queue filled (sent at once) or emptied (sent with the next message: until then the
        gateway reports completions at once, which costs messages, not correctness)."""
        self._requests_waiting = waiting
        if waiting:
            self.wakeup.set()

    def take_message(self) -> cluster_pb2.GatewayControl | None:
        if not self._status and not self._resume and self._workers is None and not self._requests_waiting and \
                not (self._placed and self._flush_placed):
            return None
        self._status.extend(cluster_pb2.RequestStatus(request_id=r) for r in self._placed)
        msg = cluster_pb2.GatewayControl(status=self._status, resume=self._resume)
        if self._workers is not None:
            msg.MergeFrom(self._workers)
        if self._requests_waiting is not None:
            msg.requests_waiting = self._requests_waiting
        self._status, self._resume, self._workers, self._requests_waiting, self._placed = [], [], None, None, []
        self._flush_placed = False
        return msg
