"""The scheduler's state machine: admission, the queue, placement, migration, leases and drain.

No gRPC here. scheduler/server.py turns calls and streams into these methods (and RequestError
into a status), and tests drive them directly with WorkerLink objects, reading what each worker
would be sent from WorkerLink.take_message(). A request's client stream reads RequestState.events:
GenerateResponse messages, the last one with usage, or a RequestError to end with.

Everything runs on one event loop, so the state needs no locks. Each event can free a worker slot
or queue work, so each ends by dispatching.
"""

from __future__ import annotations

import bisect
import enum
import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from metroserve.common.block_hash import extra_keys_for, hash_prompt_blocks
from metroserve.common.request_limits import check_request, fits
from metroserve.common.sampling_params import ParamError, SamplingParams
from metroserve.kvstore import MemoryKVStore, RequestRecord
from metroserve.rpc import cluster_pb2, generation_pb2
from metroserve.rpc.convert import limits_from_proto, params_from_proto, params_to_dict
from metroserve.scheduler.placement import choose_worker
from metroserve.scheduler.request_state import Placement, RequestState
from metroserve.scheduler.telemetry import RequestTelemetry
from metroserve.scheduler.worker_link import WorkerLink

logger = logging.getLogger(__name__)

# What a sequence the caller ended itself may finish as (SequenceEnd.finish_reason; empty: "stop").
CALLER_FINISH_REASONS = ("stop", "length", "abort")


class ErrorCode(enum.StrEnum):
    """Why a request is refused; the server maps each to the gRPC status of the same name."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"


class RequestError(Exception):
    """A request the scheduler cannot run, or an Abort it cannot apply."""

    def __init__(self, code: ErrorCode, message: str, retry_after_s: int | None = None, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param  # the request field at fault, when one is


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


class SchedulerCore:
    def __init__(self, options: CoreOptions, kvstore: MemoryKVStore):
        self.options = options
        self.kvstore = kvstore
        self.workers: dict[str, WorkerLink] = {}
        self.requests: dict[str, RequestState] = {}
        self.queue: list[Placement] = []  # by (priority, arrival)
        self.num_migrations = 0
        self.rejections: Counter = Counter()  # ErrorCode name -> requests refused
        self.placements_by_worker: Counter = Counter()
        self.placement_hit_tokens_by_worker: Counter = Counter()
        self.telemetry = RequestTelemetry(options.log_requests)
        self._rotation = 0  # spreads ties between equally good workers

    def live_workers(self) -> list[WorkerLink]:
        """Workers that take new work (not draining)."""
        return [w for w in self.workers.values() if not w.draining]

    # -- requests ----------------------------------------------------------------------------

    def admit(self, request: generation_pb2.GenerateRequest, metadata: Iterable[tuple[str, str]] = ()) -> RequestState:
        """Record and queue a request, or raise AdmissionError. `metadata`: the caller's, for its trace context."""
        try:
            state = self._new_request(request)
        except AdmissionError as e:
            self.rejections[e.code.name] += 1
            raise
        self.requests[state.request_id] = state
        self.telemetry.admitted(state, metadata, request.model or next(iter(self.workers.values())).model)
        self.kvstore.put_request(RequestRecord(state.request_id, state.prompt_token_ids, params_to_dict(state.params),
                                               state.priority, state.cache_salt))
        self._enqueue(self._new_placement(state, 0, state.params.n, []))
        self.dispatch()
        return state

    def _new_request(self, request: generation_pb2.GenerateRequest) -> RequestState:
        models = {w.model for w in self.workers.values()}
        if request.model and models and request.model not in models:
            raise AdmissionError(ErrorCode.INVALID_ARGUMENT,
                                 f"model {request.model!r} does not exist; served: {', '.join(sorted(models))}")
        if request.WhichOneof("prompt") != "token_ids":
            raise AdmissionError(ErrorCode.INVALID_ARGUMENT, "the scheduler takes token ids; send text to a gateway")
        try:
            params = params_from_proto(request.params)
        except ParamError as e:
            raise AdmissionError(ErrorCode.INVALID_ARGUMENT, str(e), param=e.param) from None
        live = self.live_workers()
        if not live:
            raise AdmissionError(ErrorCode.UNAVAILABLE, "no worker is available")
        prompt = list(request.token_ids.ids)
        self._check_limits(prompt, params, live)
        if len(self.queue) >= self.options.max_queue_len:
            raise AdmissionError(ErrorCode.RESOURCE_EXHAUSTED,
                                 f"the queue is full ({self.options.max_queue_len} requests waiting); retry later",
                                 self.options.retry_after_s)
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise AdmissionError(ErrorCode.INVALID_ARGUMENT, f"request id {request_id!r} is already in use")
        return RequestState(request_id, prompt, params, request.params, request.priority, request.cache_salt or None)

    @staticmethod
    def _check_limits(prompt: list[int], params: SamplingParams, live: list[WorkerLink]) -> None:
        """Admit if some live worker's limits admit the request (the one full check it gets);
        otherwise refuse with what the largest worker objects to."""
        error: ParamError | None = None
        for limits in sorted({w.limits for w in live}, key=lambda lim: -lim.num_blocks):
            try:
                check_request(prompt, params, limits)
                return
            except ParamError as e:
                error = error or e
        assert error is not None
        raise AdmissionError(ErrorCode.INVALID_ARGUMENT, str(error), param=error.param)

    def abort(self, request_id: str, ended: Sequence[generation_pb2.SequenceEnd] = ()) -> bool:
        """End a request now (the Abort call); False if it is not running. Sequences in `ended` finish
        as the caller says, their output cut to the tokens the client received, so usage, logs and
        the worker's counters agree with the client; every other unfinished sequence is "abort". The
        final message (usage) goes to the request's stream, which then ends."""
        state = self.requests.get(request_id)
        if state is None:
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
        for end in ended:
            state.finish_reasons[end.index] = end.finish_reason or "stop"
            del state.outputs[end.index][end.num_tokens:]
        self._end_request(state)
        state.events.put_nowait(self._final_message(state))
        return True

    def stream_closed(self, state: RequestState) -> None:
        """The request's client stream is over; if the request is not, it ends as "abort"."""
        if not state.done:
            self._end_request(state)

    def _end_request(self, state: RequestState) -> None:
        """End a request before its workers finished it: each placement ends on its worker with its
        sequences' finish reasons and the tokens the client got, the record goes, the slots go to
        the queue."""
        state.done = True
        reasons = [reason or "abort" for reason in state.finish_reasons]
        state.finish_reasons[:] = reasons
        for placement in state.placements.values():
            if placement.worker_id is None:  # still queued: no worker holds it
                continue
            link = self.workers.get(placement.worker_id)
            if link is not None:
                indices = slice(placement.base_index, placement.base_index + placement.num_seqs)
                link.release(placement, abort=True, finish_reasons=reasons[indices],
                             num_tokens=[len(output) for output in state.outputs[indices]])
        state.placements.clear()
        self.queue = [p for p in self.queue if p.request is not state]
        self._forget(state)
        self.dispatch()

    def _forget(self, state: RequestState) -> None:
        if self.requests.pop(state.request_id, None) is not None:
            self.telemetry.ended(state)
        self.kvstore.delete_request(state.request_id)

    @staticmethod
    def _final_message(state: RequestState) -> generation_pb2.GenerateResponse:
        return generation_pb2.GenerateResponse(request_id=state.request_id, usage=state.usage())

    # -- workers -----------------------------------------------------------------------------

    def worker_registered(self, register: cluster_pb2.Register, now: float) -> WorkerLink:
        """A worker connected. A link of the same id still open is from its previous life: lost."""
        old = self.workers.get(register.worker_id)
        if old is not None:
            self.worker_lost(old)
        # The worker's first message after Register lists every block it holds: start from that.
        self.kvstore.purge_worker(register.worker_id)
        link = WorkerLink(register, limits_from_proto(register.limits))
        link.last_seen = now
        self.workers[link.worker_id] = link
        logger.info("worker %s registered (pid %d on %s, epoch %d, %d KV blocks)", link.worker_id, link.pid,
                    link.host, link.epoch, link.limits.num_blocks)
        self.dispatch()
        return link

    def worker_message(self, link: WorkerLink, msg: cluster_pb2.WorkerMessage, now: float) -> None:
        link.last_seen = now
        if msg.HasField("load"):
            link.load = msg.load
        if msg.draining and not link.draining:
            logger.info("worker %s is draining", link.worker_id)
            link.draining = True
        if msg.blocks_stored:
            self.kvstore.add_blocks(link.worker_id, link.epoch, msg.blocks_stored)
        if msg.blocks_removed:
            self.kvstore.remove_blocks(link.worker_id, link.epoch, msg.blocks_removed)
        for out in msg.outputs:
            self._on_output(link, out)
        for rejection in msg.rejected:
            placement = link.placements.get(rejection.placement_id)
            if placement is not None:
                self._on_rejected(link, placement, rejection.message)
        for placement_id in msg.handed_back:
            placement = link.placements.get(placement_id)
            if placement is not None:
                link.release(placement, abort=False)
                self._requeue_unfinished(placement)
        self.dispatch()

    def _on_output(self, link: WorkerLink, out: cluster_pb2.PlacementOutput) -> None:
        placement = link.placements.get(out.placement_id)
        if placement is None:
            return  # ended or moved while this output was in flight
        state = placement.request
        response = generation_pb2.GenerateResponse(request_id=state.request_id)
        if not placement.started:
            placement.started = True
            if state.first_token_time is None:
                state.first_token_time = time.monotonic()
            if placement.base_index == 0 and not placement.resume_token_ids:
                state.num_cached_tokens = out.num_cached_tokens
                response.num_cached_tokens = out.num_cached_tokens
        for delta in out.seqs:
            index = placement.base_index + delta.index
            if state.finish_reasons[index] is not None:
                continue
            if delta.token_ids:
                state.outputs[index].extend(delta.token_ids)
                self.kvstore.append_tokens(state.request_id, index, list(delta.token_ids))
            if delta.finish_reason:
                state.finish_reasons[index] = delta.finish_reason
            delta.index = index
            response.outputs.append(delta)
        indices = range(placement.base_index, placement.base_index + placement.num_seqs)
        if all(state.finish_reasons[i] is not None for i in indices):
            link.release(placement, abort=False)
            state.placements.pop(placement.placement_id, None)
        if state.finished:
            response.usage.CopyFrom(state.usage())
            state.done = True
            self._forget(state)
        if response.outputs or state.done:
            state.events.put_nowait(response)

    def _on_rejected(self, link: WorkerLink, placement: Placement, message: str) -> None:
        """The worker refused the placement (it checked the request and found it bad): the request fails."""
        link.release(placement, abort=False)
        state = placement.request
        state.placements.pop(placement.placement_id, None)
        self._end_request(state)
        state.events.put_nowait(RequestError(ErrorCode.INVALID_ARGUMENT, message))

    def worker_lost(self, link: WorkerLink) -> None:
        """Its stream ended or its lease ran out: purge its blocks, re-place its unfinished sequences."""
        if self.workers.get(link.worker_id) is not link:
            return
        del self.workers[link.worker_id]
        link.closed.set()
        link.wakeup.set()
        purged = self.kvstore.purge_worker(link.worker_id)
        moved = list(link.placements.values())
        logger.warning("worker %s lost: %d placements to move, %d index blocks purged", link.worker_id,
                       len(moved), purged)
        for placement in moved:
            link.release(placement, abort=False)
            self._requeue_unfinished(placement)
        self.dispatch()

    def check_leases(self, now: float) -> list[WorkerLink]:
        """Drop workers silent for longer than the heartbeat timeout (a hung process keeps its
        connection open); returns them."""
        expired = [w for w in self.workers.values() if now - w.last_seen > self.options.heartbeat_timeout_s]
        for link in expired:
            logger.warning("worker %s missed its heartbeat", link.worker_id)
            self.worker_lost(link)
        return expired

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
        """Place queued sequences in queue order while a worker they fit has room. One that fits no
        live worker (a larger one was lost) waits for one, out of the way; one that fits but finds
        no room stops dispatch, so nothing behind it overtakes it."""
        i = 0
        while i < len(self.queue):
            placement = self.queue[i]
            state = placement.request
            fitting = [w for w in self.live_workers()
                       if fits(w.limits, len(state.prompt_token_ids), state.largest_token_id, state.params)]
            if not fitting:
                i += 1
                continue
            links = [w for w in fitting if w.capacity >= placement.num_seqs]
            if not links:
                return
            del self.queue[i]
            self._place(placement, links)

    def _place(self, placement: Placement, links: list[WorkerLink]) -> None:
        self._rotation += 1
        shift = self._rotation % len(links)
        links = links[shift:] + links[:shift]
        index_overlap = self.kvstore.match_prefix(placement.block_hashes, {w.worker_id: w.epoch for w in links})
        load, overlap = choose_worker(placement.num_tokens, placement.block_hashes,
                                      [w.load_view() for w in links], index_overlap)
        link = self.workers[load.worker_id]
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
            cache_salt=state.cache_salt or "", trace_context=trace_context))
        self.placements_by_worker[link.worker_id] += 1
        self.placement_hit_tokens_by_worker[link.worker_id] += hit_tokens
        self.kvstore.update_request(state.request_id, worker_id=link.worker_id, status="running")

    def _requeue_unfinished(self, placement: Placement) -> None:
        """Re-place what a lost (or draining) worker did not finish, from the tokens already sent."""
        state = placement.request
        state.placements.pop(placement.placement_id, None)
        if state.done:
            return
        indices = range(placement.base_index, placement.base_index + placement.num_seqs)
        unfinished = [i for i in indices if state.finish_reasons[i] is None]
        if not unfinished:
            return
        self.num_migrations += 1
        state.num_migrations += 1
        if not any(state.outputs[i] for i in indices):  # nothing produced yet: place it again as it was
            self._enqueue(self._new_placement(state, placement.base_index, placement.num_seqs, []))
        else:  # each sequence continues on its own from its own tokens
            for i in unfinished:
                self._enqueue(self._new_placement(state, i, 1, state.outputs[i]))

    # -- views -------------------------------------------------------------------------------

    def status(self) -> cluster_pb2.ClusterStatus:
        status = cluster_pb2.ClusterStatus(
            queue_depth=len(self.queue), num_active_requests=len(self.requests), num_migrations=self.num_migrations,
            num_rejected=sum(self.rejections.values()), placements_by_worker=dict(self.placements_by_worker),
            placement_prefix_hit_tokens=sum(self.placement_hit_tokens_by_worker.values()))
        for w in self.workers.values():
            status.workers.append(cluster_pb2.WorkerStatus(
                worker_id=w.worker_id, epoch=w.epoch, pid=w.pid, host=w.host, draining=w.draining,
                num_placed=w.num_placed_seqs, load=w.load, num_index_blocks=self.kvstore.num_blocks(w.worker_id)))
        return status

    def models(self) -> list[generation_pb2.ModelInfo]:
        models: dict[str, generation_pb2.ModelInfo] = {}
        for w in self.workers.values():
            models.setdefault(w.model, generation_pb2.ModelInfo(id=w.model, max_model_len=w.limits.max_model_len,
                                                                 vocab_size=w.limits.vocab_size))
        return list(models.values())
