"""The scheduler's state machine: admission, the queue, placement, migration, leases, drain and
recovery after a restart. It decides; it never carries tokens.

No gRPC here. scheduler/server.py turns streams into these methods, and tests drive them directly
with GatewayLink and WorkerLink objects, reading what each would be sent from take_message().

Events and what they cost (none is per token):
- a gateway submits a request: admit (validate against the workers' limits, queue) and dispatch;
  the gateway hears the refusal (a grpc status name with retry-after / field), or "admitted" at
  once if the request waits in the queue; one placed at once is acknowledged with the next message
  to its gateway or at the next lease check (its worker's first output usually says so first);
- placement: an Assignment to the worker, naming the owning gateway, whose TokenStream gets the
  output directly;
- completion: the gateway's Completion (it delivered every sequence's last token), which it sends
  with its next submission unless requests wait (GatewayControl.requests_waiting); the worker's
  PlacementFinish, which comes with its periodic load report, whichever is first; or the gateway's
  Abort (client gone, or stop strings found at the gateway, with what the client received);
- migration: a worker lost (stream broken, lease expired) or handing work back. The owning gateway
  is asked for what it delivered (ResumeQuery -> ResumeState) and each unfinished sequence is
  placed again from there. The gateway's count is the truth: it is what the client has.
- restart: a new scheduler starts with no requests. Gateways reconnect and report every request
  they own (GatewayRegister.in_flight); workers reconnect and report what they run
  (Register.running) and the blocks they hold. Reported placements are adopted; after
  RECOVERY_WINDOW_S whatever no worker reported is migrated, and whatever no gateway reported is
  ended. Streams running meanwhile do not notice: their tokens never came through here.
- a gateway's stream breaks: its requests wait GATEWAY_GRACE_S for it to reconnect and report
  them, then end (their clients are gone with it).

Messages are the cost here (a gRPC message costs this process 0.15-0.5 ms of CPU on a 2-core VM,
more at low rates, against ~0.2 ms for all of a request's logic), so a request placed at once
costs two: its submission (carrying earlier completions) and its Assignment.

Everything runs on one event loop, so the state needs no locks. Each event can free a worker slot
or queue work, so each ends by dispatching.
"""

from __future__ import annotations

import bisect
import enum
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from metroserve.common.block_hash import extra_keys_for, hash_prompt_blocks
from metroserve.common.request_limits import RequestLimits, check_request, fits
from metroserve.common.sampling_params import ParamError, SamplingParams
from metroserve.kvstore import MemoryKVStore
from metroserve.rpc import cluster_pb2, generation_pb2
from metroserve.rpc.convert import limits_from_proto, params_from_proto
from metroserve.scheduler.gateway_link import GatewayLink
from metroserve.scheduler.placement import choose_worker
from metroserve.scheduler.request_state import Placement, RequestState
from metroserve.scheduler.telemetry import RequestTelemetry
from metroserve.scheduler.worker_link import WorkerLink

logger = logging.getLogger(__name__)

# Workers' periodic reports (finishes, load, block events) the scheduler wants per second in all:
# each worker reports every max(1, W / REPORTS_PER_S) s, rounded up to a power of two so the
# interval changes (one message to each worker) only as W doubles, and at most a third of the
# heartbeat timeout (a busy worker's reports are its heartbeats). Each report wakes the scheduler
# (~0.3-0.5 ms of its CPU on a 2-core VM): at 16 a second they were a quarter of its CPU under
# load. What it costs: with 32 workers, load and decode-filled blocks reach the scheduler up to
# 8 s late, with 64 up to 10 s (a finished prompt's blocks count as placed on its worker
# meanwhile, so a follow-up sharing that prompt still finds them).
REPORTS_PER_S = 4

# Distinct sampling-parameter settings whose conversion is kept (see SchedulerCore._sampling_params).
PARAMS_CACHE_SIZE = 1024

# A request that was running on this many workers when each was lost fails instead of moving again.
MAX_WORKERS_LOST = 3

# What a sequence the caller ended itself may finish as (SequenceEnd.finish_reason; empty: "stop").
CALLER_FINISH_REASONS = ("stop", "length", "abort")


def heartbeat_interval_s(heartbeat_timeout_s: float) -> float:
    """How often a worker must be heard from: three chances per timeout, so one late message is no loss.
    A stalled worker is therefore declared lost between timeout - interval and timeout after it stopped."""
    return heartbeat_timeout_s / 3


def report_interval_s(num_workers: int, heartbeat_timeout_s: float) -> float:
    """How often each of `num_workers` workers reports (see REPORTS_PER_S)."""
    interval = float(2 ** max(0, math.ceil(math.log2(max(1, num_workers) / REPORTS_PER_S))))
    return min(interval, heartbeat_interval_s(heartbeat_timeout_s))


class ErrorCode(enum.StrEnum):
    """Why a request is refused; the gateway maps each to the gRPC status of the same name."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"  # the cluster failed it (e.g. every worker it ran on died)


class RequestError(Exception):
    """A request the scheduler cannot run, or an Abort it cannot apply."""

    def __init__(self, code: ErrorCode, message: str, retry_after_s: int | None = None, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param  # the request field at fault, when one is

    def to_status(self, request_id: str) -> cluster_pb2.RequestStatus:
        return cluster_pb2.RequestStatus(request_id=request_id, code=self.code.name, message=self.message,
                                         retry_after_s=self.retry_after_s or 0, param=self.param or "")


class AdmissionError(RequestError):
    """Refused at admission (counted in SchedulerCore.rejections by code)."""


@dataclass
class CoreOptions:
    max_queue_len: int = 1024  # requests waiting for a worker slot; beyond it: RESOURCE_EXHAUSTED
    # A worker silent this long is dropped. Its messages go out between engine steps, so this must
    # exceed the longest step; a crashed worker is noticed at once anyway (its stream breaks).
    heartbeat_timeout_s: float = 30.0
    retry_after_s: int = 1
    log_requests: bool = True  # one structured line per finished request
    # After a start, how long reported placements wait for their gateway (and requests for their
    # workers) before what is unmatched is ended (or migrated). Workers and gateways redial every
    # 0.5 s, so a few seconds covers a restart on one machine and a busy network.
    recovery_window_s: float = 3.0
    # A gateway whose stream broke keeps its requests this long, to reconnect and report them.
    gateway_grace_s: float = 5.0


class SchedulerCore:
    def __init__(self, options: CoreOptions, kvstore: MemoryKVStore, now: float | None = None):
        self.options = options
        self.kvstore = kvstore
        self.workers: dict[str, WorkerLink] = {}
        self.gateways: dict[str, GatewayLink] = {}
        self.detached: dict[str, float] = {}  # gateway id -> when its stream broke
        self.requests: dict[str, RequestState] = {}
        self.queue: list[Placement] = []  # by (priority, arrival)
        self.resuming: dict[str, Placement] = {}  # placements off their worker, awaiting their gateway's ResumeState
        self.recovery_deadline: float | None = (time.monotonic() if now is None else now) + options.recovery_window_s
        self.num_migrations = 0
        self.num_admitted = 0
        self.num_finished = 0
        self.rejections: Counter = Counter()  # ErrorCode name -> requests refused
        self.placements_by_worker: Counter = Counter()
        self.placement_hit_tokens_by_worker: Counter = Counter()
        self.telemetry = RequestTelemetry(options.log_requests)
        self._rotation = 0  # spreads ties between equally good workers
        self._announced_waiting = False  # what the gateways were last told of the queue
        self._live_groups: list[tuple[RequestLimits, list[WorkerLink]]] | None = None
        self._live_epochs: dict[str, int] = {}  # worker id -> epoch of the live workers, with _live_groups
        self._params_by_bytes: dict[bytes, SamplingParams] = {}
        self.report_interval_s = report_interval_s(0, options.heartbeat_timeout_s)  # what workers are told

    def live_workers(self) -> list[WorkerLink]:
        """Workers that take new work (not draining)."""
        return [w for w in self.workers.values() if not w.draining]

    def _live_by_limits(self) -> list[tuple[RequestLimits, list[WorkerLink]]]:
        """Live workers grouped by their limits, the largest KV pool first. Cached until a worker
        comes, goes or drains: admission and every placement read it, and a cluster has few
        distinct limits however many workers it has."""
        if self._live_groups is None:
            groups: dict[RequestLimits, list[WorkerLink]] = {}
            for w in self.live_workers():
                groups.setdefault(w.limits, []).append(w)
            self._live_groups = sorted(groups.items(), key=lambda g: -g[0].num_blocks)
            self._live_epochs = {w.worker_id: w.epoch for _, group in self._live_groups for w in group}
        return self._live_groups

    # -- gateways ----------------------------------------------------------------------------

    def gateway_registered(self, register: cluster_pb2.GatewayRegister, now: float) -> GatewayLink:
        """A gateway connected; it reports every request it owns. A link of the same id still open
        is from a broken stream: replaced. Its requests it no longer reports are over."""
        old = self.gateways.get(register.gateway_id)
        if old is not None:
            old.closed.set()
            old.wakeup.set()
        link = GatewayLink(register.gateway_id)
        self.gateways[link.gateway_id] = link
        self.detached.pop(link.gateway_id, None)
        link.workers_changed(self._worker_list())
        if self._announced_waiting:
            link.requests_waiting(True)
        reported = {s.request.request_id for s in register.in_flight}
        for state in [s for s in self.requests.values() if s.gateway_id == link.gateway_id]:
            if state.request_id not in reported:
                self._end_request(state)
        for submission in register.in_flight:
            self._adopt_request(link, submission, now)
        for placement in self.resuming.values():  # queries its previous stream may have lost
            if placement.request.gateway_id == link.gateway_id:
                link.query_resume(placement)
        logger.info("gateway %s connected (%d requests in flight)", link.gateway_id, len(register.in_flight))
        self.dispatch()
        return link

    def gateway_message(self, link: GatewayLink, msg: cluster_pb2.GatewayMessage, now: float) -> None:
        for completion in msg.completed:  # first: the slots they free may take the submissions
            try:
                self._completed(link, completion, now)
            except RequestError as e:
                link.status(e.to_status(completion.request_id))
        submitted = [state for submission in msg.submit if (state := self._submit(link, submission)) is not None]
        for abort in msg.abort:
            try:
                self.abort(link.gateway_id, abort.request_id, abort.ended)
            except RequestError as e:
                link.status(e.to_status(abort.request_id))
        for resume in msg.resume:
            self._resume_answered(link, resume)
        self.dispatch()
        for state in submitted:  # placed at once: its worker's first output usually answers first
            if state.done:
                continue
            if any(p.worker_id for p in state.placements.values()):
                link.placed(state.request_id)
            else:
                link.status(cluster_pb2.RequestStatus(request_id=state.request_id))

    def gateway_lost(self, link: GatewayLink, now: float) -> None:
        """Its stream ended: its requests wait gateway_grace_s for it to come back."""
        if self.gateways.get(link.gateway_id) is not link:
            return
        del self.gateways[link.gateway_id]
        link.closed.set()
        link.wakeup.set()
        self.detached[link.gateway_id] = now
        logger.warning("gateway %s disconnected", link.gateway_id)

    def _submit(self, link: GatewayLink, submission: cluster_pb2.Submission) -> RequestState | None:
        """Admit and queue; None: refused (the gateway is told)."""
        request = submission.request
        try:
            state = self._new_request(request, link.gateway_id)
        except AdmissionError as e:
            self.rejections[e.code.name] += 1
            link.status(e.to_status(request.request_id))
            return None
        self._record(state, submission)
        self._enqueue(self._new_placement(state, 0, state.params.n, []))
        return state

    def _completed(self, link: GatewayLink, completion: cluster_pb2.Completion, now: float) -> None:
        """The gateway delivered every sequence to its end (`completion.held_s` before `now`): the
        request is over, its slots free. Its workers finished it already (they sent the last
        tokens), so nothing is sent to them."""
        state = self.requests.get(completion.request_id)
        if state is None or state.gateway_id != link.gateway_id:
            return  # over already: its workers' finishes came first, or it was aborted
        n = state.params.n
        if len(completion.finish_reasons) != n or len(completion.num_tokens) != n:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"a completion must list each of the request's "
                               f"{n} sequences; got {len(completion.finish_reasons)} finish reasons and "
                               f"{len(completion.num_tokens)} token counts")
        for index, (reason, count) in enumerate(zip(completion.finish_reasons, completion.num_tokens)):
            if state.finish_reasons[index] is None:
                state.finish_reasons[index] = reason or "stop"
                state.num_tokens[index] = count
        state.num_cached_tokens = completion.num_cached_tokens
        state.end_time = now - max(0.0, completion.held_s)
        for placement in state.placements.values():
            worker = self.workers.get(placement.worker_id) if placement.worker_id is not None else None
            if worker is not None:
                worker.complete(placement)
        self._drop(state)

    def _record(self, state: RequestState, submission: cluster_pb2.Submission) -> None:
        self.requests[state.request_id] = state
        self.num_admitted += 1
        model = submission.request.model or next((w.model for w in self.workers.values()), "")
        self.telemetry.admitted(state, dict(submission.trace_context), model)

    def _adopt_request(self, link: GatewayLink, submission: cluster_pb2.Submission, now: float) -> None:
        """A request the gateway reports as its own after (re)connecting: known, it stays as it is;
        unknown (this scheduler restarted, or never answered it), it is rebuilt, takes the
        placements workers report for it, and what runs nowhere is migrated from the gateway's tokens."""
        request_id = submission.request.request_id
        if request_id in self.requests:
            link.status(cluster_pb2.RequestStatus(request_id=request_id))
            return
        try:
            state = self._new_request(submission.request, link.gateway_id, admitted_before=True)
        except AdmissionError as e:
            link.status(e.to_status(request_id))
            return
        self._record(state, submission)
        link.status(cluster_pb2.RequestStatus(request_id=request_id))
        state.recovering = True
        for worker in self.workers.values():
            for running in [r for r in worker.orphans.values() if r.request_id == request_id]:
                worker.take_orphan(running.placement_id)
                if self._adoptable(state, running):
                    self._adopt_placement(worker, state, running)
                else:
                    worker.end(running.placement_id)
        if not self.in_recovery(now):
            self._recover(state)

    def _adopt_placement(self, worker: WorkerLink, state: RequestState, running: cluster_pb2.RunningPlacement) -> None:
        placement = Placement(state, running.base_index, running.num_seqs, [], [], placement_id=running.placement_id,
                              reports_since_placed=2)
        state.placements[placement.placement_id] = placement
        state.workers.append(worker.worker_id)
        worker.assign(placement, None)

    def _covered(self, state: RequestState) -> set[int]:
        """Sequences that run somewhere, are being moved, or have finished."""
        moving = (p for p in self.resuming.values() if p.request is state)
        covered = {i for p in [*state.placements.values(), *moving] for i in p.indices}
        return covered | {i for i, reason in enumerate(state.finish_reasons) if reason is not None}

    def _adoptable(self, state: RequestState, running: cluster_pb2.RunningPlacement) -> bool:
        """A placement a worker reports may be adopted only by a request being rebuilt, and only if
        none of its sequences is covered already (another copy adopted, or it is being moved)."""
        indices = range(running.base_index, running.base_index + running.num_seqs)
        return state.recovering and running.placement_id not in self.resuming and not (
            set(indices) & self._covered(state))

    def _recover(self, state: RequestState) -> None:
        """The recovery window is over for a rebuilt request: migrate its sequences no worker runs."""
        state.recovering = False
        covered = self._covered(state)
        lost = [i for i in range(state.params.n) if i not in covered]
        if not lost:
            return
        if len(lost) == state.params.n:
            self._migrate(self._new_placement(state, 0, state.params.n, []))
        else:
            for i in lost:
                self._migrate(self._new_placement(state, i, 1, []))

    def in_recovery(self, now: float) -> bool:
        return self.recovery_deadline is not None and now < self.recovery_deadline

    # -- requests ----------------------------------------------------------------------------

    def _new_request(self, request: generation_pb2.GenerateRequest, gateway_id: str,
                     admitted_before: bool = False) -> RequestState:
        """Validate a submission. `admitted_before`: a request its gateway reports after a restart,
        checked when it was first admitted: workers may not have reconnected yet, and it is not new
        work for the queue's bound."""
        models = {w.model for w in self.workers.values()}
        if request.model and models and request.model not in models and not admitted_before:
            raise AdmissionError(ErrorCode.INVALID_ARGUMENT,
                                 f"model {request.model!r} does not exist; served: {', '.join(sorted(models))}")
        if request.WhichOneof("prompt") != "token_ids":
            raise AdmissionError(ErrorCode.INVALID_ARGUMENT, "the scheduler takes token ids")
        if not request.request_id:
            raise AdmissionError(ErrorCode.INVALID_ARGUMENT, "a submission needs a request id")
        try:
            params = self._sampling_params(request.params)
        except ParamError as e:
            raise AdmissionError(ErrorCode.INVALID_ARGUMENT, str(e), param=e.param) from None
        prompt = list(request.token_ids.ids)
        live = self._live_by_limits()
        if not admitted_before and (live or not self.in_recovery(time.monotonic())):
            # Just restarted, with no worker back yet: admitted now, checked when placed.
            if not live:
                raise AdmissionError(ErrorCode.UNAVAILABLE, "no worker is available", self.options.retry_after_s)
            self._check_limits(prompt, params, live)
        if not admitted_before and len(self.queue) >= self.options.max_queue_len:
            raise AdmissionError(ErrorCode.RESOURCE_EXHAUSTED,
                                 f"the queue is full ({self.options.max_queue_len} requests waiting); retry later",
                                 self.options.retry_after_s)
        if request.request_id in self.requests:
            raise AdmissionError(ErrorCode.INVALID_ARGUMENT, f"request id {request.request_id!r} is already in use")
        return RequestState(request.request_id, prompt, params, request.params, gateway_id, request.priority,
                            request.cache_salt or None)

    def _sampling_params(self, proto: generation_pb2.SamplingParams) -> SamplingParams:
        """The request's parameters, converted and checked once per distinct setting: clients send
        the same few settings again and again, and converting one cost ~30 us of a ~180 us admission.
        Keyed by their deterministic wire bytes; the SamplingParams are shared, so read-only here."""
        key = proto.SerializeToString(deterministic=True)
        params = self._params_by_bytes.get(key)
        if params is None:
            params = params_from_proto(proto)  # a ParamError leaves nothing cached
            if len(self._params_by_bytes) >= PARAMS_CACHE_SIZE:
                self._params_by_bytes.clear()
            self._params_by_bytes[key] = params
        return params

    @staticmethod
    def _check_limits(prompt: list[int], params: SamplingParams,
                      live: list[tuple[RequestLimits, list[WorkerLink]]]) -> None:
        """Admit if some live worker's limits admit the request (the one full check it gets);
        otherwise refuse with what the largest worker objects to."""
        error: ParamError | None = None
        for limits, _ in live:
            try:
                check_request(prompt, params, limits)
                return
            except ParamError as e:
                error = error or e
        assert error is not None
        raise AdmissionError(ErrorCode.INVALID_ARGUMENT, str(error), param=error.param)

    def abort(self, gateway_id: str, request_id: str, ended: Sequence[generation_pb2.SequenceEnd] = ()) -> bool:
        """End a request now (its gateway's Abort); False if it is not running, or not this gateway's.
        Sequences in `ended` finish as the gateway says with the tokens the client received, so
        usage, logs and the worker's counters agree with the client; every other unfinished
        sequence is "abort"."""
        state = self.requests.get(request_id)
        if state is None or state.gateway_id != gateway_id:
            return False
        for end in ended:  # all checked before anything changes
            if not 0 <= end.index < state.params.n:
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"ended sequence index {end.index} is out of range (n={state.params.n})")
            if (end.finish_reason or "stop") not in CALLER_FINISH_REASONS:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"ended sequence finish_reason must be one of "
                                   f"{CALLER_FINISH_REASONS}, got {end.finish_reason!r}")
            if end.num_tokens < 0:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"ended sequence num_tokens is {end.num_tokens}")
        told = set()
        for end in ended:
            if state.finish_reasons[end.index] is None:
                state.finish_reasons[end.index] = end.finish_reason or "stop"
                state.num_tokens[end.index] = end.num_tokens
                told.add(end.index)
        self._end_request(state, told)
        return True

    def _end_request(self, state: RequestState, told: set[int] | None = None) -> None:
        """End a request before its workers finished it: each placement ends on its worker with its
        sequences' finish reasons and, where the gateway told them (`told`), the tokens the client
        got; the slots go to the queue."""
        state.done = True
        reasons = [reason or "abort" for reason in state.finish_reasons]
        state.finish_reasons[:] = reasons
        for placement in state.placements.values():
            link = self.workers.get(placement.worker_id) if placement.worker_id is not None else None
            if link is not None:
                indices = placement.indices
                counts = [state.num_tokens[i] for i in indices] if told and all(i in told for i in indices) else []
                link.release(placement, abort=True, finish_reasons=reasons[indices.start:indices.stop],
                             num_tokens=counts)
        self._drop(state)
        self.dispatch()

    def _drop(self, state: RequestState) -> None:
        """The request is over (its placements released by the caller): out of the queue, the
        migrations under way and the live requests."""
        state.placements.clear()
        if self.queue:
            self.queue = [p for p in self.queue if p.request is not state]
        if self.resuming:
            self.resuming = {k: p for k, p in self.resuming.items() if p.request is not state}
        self._forget(state)

    def _forget(self, state: RequestState) -> None:
        state.done = True
        if self.requests.pop(state.request_id, None) is not None:
            self.num_finished += 1
            self.telemetry.ended(state)

    def _fail(self, state: RequestState, error: RequestError) -> None:
        """An admitted request cannot run: it ends, and its gateway passes the error to the client."""
        self._end_request(state)
        gateway = self.gateways.get(state.gateway_id)
        if gateway is not None:
            gateway.status(error.to_status(state.request_id))

    # -- workers -----------------------------------------------------------------------------

    def worker_registered(self, register: cluster_pb2.Register, now: float) -> WorkerLink:
        """A worker connected. A link of the same id still open is from its previous life: lost.
        What it reports running is adopted when its request is being rebuilt, held as an orphan
        during the recovery window, and otherwise ended (it was moved, or its request is over)."""
        old = self.workers.get(register.worker_id)
        if old is not None:
            self.worker_lost(old)
        # The worker's first message after Register lists every block it holds: start from that.
        self.kvstore.purge_worker(register.worker_id)
        link = WorkerLink(register, limits_from_proto(register.limits))
        link.last_seen = now
        self.workers[link.worker_id] = link
        self._live_groups = None
        for running in register.running:
            state = self.requests.get(running.request_id)
            if state is not None and self._adoptable(state, running):
                self._adopt_placement(link, state, running)
            elif state is None and self.in_recovery(now):
                link.add_orphan(running)
            else:
                link.end(running.placement_id)
        logger.info("worker %s registered (pid %d on %s, epoch %d, %d KV blocks, %d placements running)",
                    link.worker_id, link.pid, link.host, link.epoch, link.limits.num_blocks, len(register.running))
        self._retune_reports()
        self._workers_changed()
        self.dispatch()
        return link

    def worker_message(self, link: WorkerLink, msg: cluster_pb2.WorkerMessage, now: float) -> None:
        link.last_seen = now
        if msg.HasField("load"):
            link.load_reported(msg.load)
        if msg.draining and not link.draining:
            logger.info("worker %s is draining", link.worker_id)
            link.draining = True
            self._live_groups = None
        if msg.blocks_stored:
            self.kvstore.add_blocks(link.worker_id, link.epoch, msg.blocks_stored)
        if msg.blocks_removed:
            self.kvstore.remove_blocks(link.worker_id, link.epoch, msg.blocks_removed)
        for finish in msg.finished:
            self._on_finished(link, finish)
        for rejection in msg.rejected:
            placement = link.placements.get(rejection.placement_id)
            if placement is not None:
                link.release(placement, abort=False)
                placement.request.placements.pop(placement.placement_id, None)
                self._fail(placement.request, RequestError(ErrorCode.INVALID_ARGUMENT, rejection.message,
                                                           param=rejection.param or None))
        for placement_id in msg.handed_back:
            placement = link.placements.get(placement_id)
            if placement is not None:
                link.release(placement, abort=False)
                self._migrate(placement)
        self.dispatch()

    def _on_finished(self, link: WorkerLink, finish: cluster_pb2.PlacementFinish) -> None:
        placement = link.placements.get(finish.placement_id)
        if placement is None:
            link.take_orphan(finish.placement_id)
            link.drop_completed(finish.placement_id)
            return  # completed by its gateway, or ended or moved while the report was in flight
        link.release(placement, abort=False)
        state = placement.request
        state.placements.pop(placement.placement_id, None)
        for i, index in enumerate(placement.indices):
            if state.finish_reasons[index] is None:
                state.finish_reasons[index] = finish.finish_reasons[i] if i < len(finish.finish_reasons) else "abort"
                state.num_tokens[index] = finish.num_tokens[i] if i < len(finish.num_tokens) else 0
        if placement.base_index == 0 and not placement.resume_token_ids:
            state.num_cached_tokens = finish.num_cached_tokens
        if state.finished:
            self._forget(state)

    def worker_lost(self, link: WorkerLink) -> None:
        """Its stream ended or its lease ran out: purge its blocks, move its unfinished sequences."""
        if self.workers.get(link.worker_id) is not link:
            return
        del self.workers[link.worker_id]
        self._live_groups = None
        link.closed.set()
        link.wakeup.set()
        purged = self.kvstore.purge_worker(link.worker_id)
        self._retune_reports()
        moved = list(link.placements.values())
        logger.warning("worker %s lost: %d placements to move, %d index blocks purged", link.worker_id,
                       len(moved), purged)
        for state in {p.request.request_id: p.request for p in moved}.values():
            state.num_workers_lost += 1
        for placement in moved:
            link.release(placement, abort=False)
            state = placement.request
            if state.num_workers_lost >= MAX_WORKERS_LOST and not state.done:
                # Likely what kills them (an engine bug it triggers): failed, so that it cannot
                # take down every worker in turn.
                logger.warning("request %s failed: %d workers were lost while running it", state.request_id,
                               state.num_workers_lost)
                self._fail(state, RequestError(ErrorCode.INTERNAL, f"{state.num_workers_lost} workers failed "
                                                                   "while running this request"))
            self._migrate(placement)
        self._workers_changed()
        self.dispatch()

    def _retune_reports(self) -> None:
        """The number of workers changed: if their report interval should too, tell every worker
        (a new one hears it in its first message)."""
        interval = report_interval_s(len(self.workers), self.options.heartbeat_timeout_s)
        if interval != self.report_interval_s:
            self.report_interval_s = interval
            for worker in self.workers.values():
                worker.report_every(interval)

    def check_leases(self, now: float) -> list[WorkerLink]:
        """Periodic: drop workers silent for longer than the heartbeat timeout (a hung process keeps
        its connection open), end the requests of gateways gone past their grace, close the
        recovery window, and send gateways the acknowledgments of requests placed since the last
        check. Returns the workers dropped."""
        expired = [w for w in self.workers.values() if now - w.last_seen > self.options.heartbeat_timeout_s]
        for link in expired:
            logger.warning("worker %s missed its heartbeat", link.worker_id)
            self.worker_lost(link)
        for gateway_id, since in list(self.detached.items()):
            if now - since > self.options.gateway_grace_s:
                del self.detached[gateway_id]
                gone = [s for s in self.requests.values() if s.gateway_id == gateway_id]
                if gone:
                    logger.warning("gateway %s did not come back: ending its %d requests", gateway_id, len(gone))
                for state in gone:
                    self._end_request(state)
        if self.recovery_deadline is not None and not self.in_recovery(now):
            self.recovery_deadline = None
            self._close_recovery()
        for gateway in self.gateways.values():
            gateway.flush_placed()
        return expired

    def _close_recovery(self) -> None:
        live = self._live_by_limits()
        # What was admitted during the window unchecked (no worker was back) gets its check now.
        for state in {p.request.request_id: p.request for p in self.queue}.values():
            try:
                if not live:
                    raise RequestError(ErrorCode.UNAVAILABLE, "no worker is available", self.options.retry_after_s)
                self._check_limits(state.prompt_token_ids, state.params, live)
            except RequestError as e:
                self._fail(state, e)
        for worker in self.workers.values():
            for placement_id in list(worker.orphans):
                worker.take_orphan(placement_id)
                worker.end(placement_id)
        for state in [s for s in self.requests.values() if s.recovering]:
            self._recover(state)
        self.dispatch()

    # -- migration ---------------------------------------------------------------------------

    def _migrate(self, placement: Placement) -> None:
        """The placement runs nowhere now: ask its gateway what the client has, then place the rest."""
        state = placement.request
        state.placements.pop(placement.placement_id, None)
        if state.done:
            return
        self.resuming[placement.placement_id] = placement
        gateway = self.gateways.get(state.gateway_id)
        if gateway is not None:  # else: asked when it reconnects (or the request ends with its grace)
            gateway.query_resume(placement)

    def _resume_answered(self, link: GatewayLink, resume: cluster_pb2.ResumeState) -> None:
        placement = self.resuming.get(resume.placement_id)
        if placement is None or placement.request.gateway_id != link.gateway_id:
            return
        del self.resuming[resume.placement_id]
        state = placement.request
        tokens = [list(t.ids) for t in resume.tokens]
        unfinished = []
        for i, index in enumerate(placement.indices):
            reason = resume.finish_reasons[i] if i < len(resume.finish_reasons) else ""
            output = tokens[i] if i < len(tokens) else []
            if state.finish_reasons[index] is not None:
                continue  # its worker reported it finished meanwhile
            if reason:
                state.finish_reasons[index] = reason
                state.num_tokens[index] = len(output)
            else:
                unfinished.append((index, output))
        if unfinished:
            self.num_migrations += 1
            state.num_migrations += 1
        if len(unfinished) == placement.num_seqs and not any(output for _, output in unfinished):
            self._enqueue(self._new_placement(state, placement.base_index, placement.num_seqs, []))
        else:  # each sequence continues on its own from its own tokens
            for index, output in unfinished:
                self._enqueue(self._new_placement(state, index, 1, output))
        if state.finished and not state.placements:
            self._forget(state)

    # -- placement ---------------------------------------------------------------------------

    def _new_placement(self, state: RequestState, base_index: int, num_seqs: int, resume: list[int]) -> Placement:
        block_size = next((w.limits.block_size for w in self.workers.values()), 16)
        hashes = hash_prompt_blocks(state.prompt_token_ids + resume, block_size, extra_keys_for(state.cache_salt))
        placement = Placement(state, base_index, num_seqs, list(resume), hashes)
        state.placements[placement.placement_id] = placement
        return placement

    def _enqueue(self, placement: Placement) -> None:
        keys = [p.sort_key for p in self.queue]
        self.queue.insert(bisect.bisect_right(keys, placement.sort_key), placement)

    def dispatch(self) -> None:
        """Place what the queue allows, then tell the gateways if requests started or stopped
        waiting (so they report completions at once while requests wait)."""
        self._place_queued()
        waiting = bool(self.queue)
        if waiting != self._announced_waiting:
            self._announced_waiting = waiting
            for gateway in self.gateways.values():
                gateway.requests_waiting(waiting)

    def _place_queued(self) -> None:
        """Place queued sequences in queue order while a worker they fit has room. One that fits no
        live worker (a larger one was lost) waits for one, out of the way; one that fits but finds
        no room stops dispatch, so nothing behind it overtakes it."""
        i = 0
        while i < len(self.queue):
            placement = self.queue[i]
            state = placement.request
            num_prompt = len(state.prompt_token_ids)
            fitting = [w for limits, group in self._live_by_limits()
                       if fits(limits, num_prompt, state.largest_token_id, state.params) for w in group]
            if not fitting:
                i += 1
                continue
            num_seqs = placement.num_seqs
            links = [w for w in fitting if w.num_placed_seqs + num_seqs <= w.max_num_seqs]
            if not links:
                return
            del self.queue[i]
            self._place(placement, links)

    def _place(self, placement: Placement, links: list[WorkerLink]) -> None:
        self._rotation += 1
        shift = self._rotation % len(links)
        links = links[shift:] + links[:shift]
        # Overlaps of every live worker (the candidates are among them): one dict kept with the groups.
        index_overlap = self.kvstore.match_prefix(placement.block_hashes, self._live_epochs)
        link, overlap = choose_worker(placement.num_tokens, placement.block_hashes, links, index_overlap)
        state = placement.request
        hit_tokens = min(overlap * link.limits.block_size, placement.num_tokens - 1)
        placement.prefill_tokens = placement.num_tokens - hit_tokens
        params = generation_pb2.SamplingParams()
        params.CopyFrom(state.params_proto)
        params.n = placement.num_seqs
        trace_context = self.telemetry.placed(placement, link.worker_id)
        link.assign(placement, cluster_pb2.Assignment(
            placement_id=placement.placement_id, prompt_token_ids=state.prompt_token_ids,
            resume_token_ids=placement.resume_token_ids, params=params, priority=state.priority,
            cache_salt=state.cache_salt or "", trace_context=trace_context, request_id=state.request_id,
            gateway_id=state.gateway_id, base_index=placement.base_index))
        self.placements_by_worker[link.worker_id] += 1
        self.placement_hit_tokens_by_worker[link.worker_id] += hit_tokens

    # -- views -------------------------------------------------------------------------------

    def _worker_list(self) -> cluster_pb2.GatewayControl:
        return cluster_pb2.GatewayControl(
            workers_changed=True, models=self.models(),
            workers=[cluster_pb2.WorkerEndpoint(worker_id=w.worker_id, epoch=w.epoch, address=w.address)
                     for w in self.workers.values()])

    def _workers_changed(self) -> None:
        control = self._worker_list()
        for gateway in self.gateways.values():
            gateway.workers_changed(control)

    def status(self) -> cluster_pb2.ClusterStatus:
        status = cluster_pb2.ClusterStatus(
            queue_depth=len(self.queue), num_active_requests=len(self.requests), num_migrations=self.num_migrations,
            num_rejected=sum(self.rejections.values()), placements_by_worker=dict(self.placements_by_worker),
            placement_prefix_hit_tokens=sum(self.placement_hit_tokens_by_worker.values()),
            num_gateways=len(self.gateways), num_admitted=self.num_admitted, num_finished=self.num_finished)
        for w in self.workers.values():
            status.workers.append(cluster_pb2.WorkerStatus(
                worker_id=w.worker_id, epoch=w.epoch, pid=w.pid, host=w.host, draining=w.draining,
                num_placed=w.num_placed_seqs, load=w.load, num_index_blocks=self.kvstore.num_blocks(w.worker_id),
                address=w.address))
        return status

    def models(self) -> list[generation_pb2.ModelInfo]:
        models: dict[str, generation_pb2.ModelInfo] = {}
        for w in self.workers.values():
            models.setdefault(w.model, generation_pb2.ModelInfo(id=w.model, max_model_len=w.limits.max_model_len,
                                                                 vocab_size=w.limits.vocab_size))
        return list(models.values())
