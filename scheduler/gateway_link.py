"""One connected gateway as the scheduler sees it: its requests and its outbox.

A gateway owns its requests: their clients, their tokens (straight from the workers) and their
Abort. The scheduler answers its submissions, tells it of failures, asks it for the tokens it
delivered when a placement must move, and keeps it up to date on the workers to subscribe to.
Everything for one gateway accumulates here and leaves as one GatewayControl per wakeup.
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

    def take_message(self) -> cluster_pb2.GatewayControl | None:
        if not self._status and not self._resume and self._workers is None:
            return None
        msg = cluster_pb2.GatewayControl(status=self._status, resume=self._resume)
        if self._workers is not None:
            msg.MergeFrom(self._workers)
        self._status, self._resume, self._workers = [], [], None
        return msg
