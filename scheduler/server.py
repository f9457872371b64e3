"""The central scheduler: admission, placement, request state and migration.

Gateways call Generation.Generate with token ids; the scheduler admits the request (or refuses it:
INVALID_ARGUMENT for a bad request, RESOURCE_EXHAUSTED with retry-after when the queue is full,
UNAVAILABLE with no live worker), queues it, places it on a worker by prefix overlap and load
(scheduler/placement.py), and relays the worker's tokens back. Workers hold a lease by sending on
their stream; a worker whose stream breaks or whose lease runs out is dropped, its index entries
purged, and its unfinished sequences re-placed with the tokens they already produced.

Everything runs on one asyncio loop, so the state needs no locks. The kvstore records the
prefix-block index and each request's state; with Redis its writes are batched in the background.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from metroserve.kvstore import RequestRecord, open_kvstore
from metroserve.common.block_hash import extra_keys_for, hash_prompt_blocks
from metroserve.rpc import GENERATION_SERVICE, GRPC_OPTIONS, cluster_pb2, cluster_pb2_grpc, generation_pb2, generation_pb2_grpc
from metroserve.rpc.convert import limits_from_proto, params_from_proto, params_to_dict
from metroserve.scheduler.metrics import SchedulerCollector
from metroserve.scheduler.placement import choose_worker
from metroserve.scheduler.request_state import Placement, RequestState
from metroserve.scheduler.telemetry import RequestTelemetry
from metroserve.scheduler.worker_link import WorkerLink
from metroserve.services.metrics_http import start_metrics_server
from metroserve.common.request_limits import RequestLimits, check_request

logger = logging.getLogger(__name__)



@dataclass
class SchedulerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    kvstore: str = "memory"
    max_queue_len: int = 1024  # requests waiting for a worker slot; beyond it: RESOURCE_EXHAUSTED
    # A worker silent this long is dropped. Its messages go out between engine steps, so this must
    # exceed the longest step; a crashed worker is noticed at once anyway (its stream breaks).
    heartbeat_timeout_s: float = 30.0
    retry_after_s: int = 1
    metrics_port: int = 0  # 0: no /metrics
    log_requests: bool = True  # one structured line per finished request


class Scheduler(generation_pb2_grpc.GenerationServicer, cluster_pb2_grpc.WorkerHubServicer,
                cluster_pb2_grpc.ClusterServicer):
    def __init__(self, options: SchedulerOptions, kvstore):
        self.options = options
        self.kvstore = kvstore
        self.workers: dict[str, WorkerLink] = {}
        self.requests: dict[str, RequestState] = {}
        self.queue: list[Placement] = []  # by (priority, arrival)
        self.health = health.aio.HealthServicer()
        self.num_migrations = 0
        self.rejections: Counter = Counter()  # status code name -> requests refused
        self.placements_by_worker: Counter = Counter()
        self.placement_hit_tokens_by_worker: Counter = Counter()
        self.telemetry = RequestTelemetry(options.log_requests)
        self._rotation = 0  # spreads ties between equally good workers

    # -- admission ---------------------------------------------------------------------------

    def _limits(self) -> RequestLimits | None:
        links = [w for w in self.workers.values() if not w.draining]
        return max((w.limits for w in links), key=lambda lim: lim.num_blocks, default=None)

    async def _admit(self, request: generation_pb2.GenerateRequest, context) -> RequestState:
        async def refuse(code: grpc.StatusCode, message: str) -> None:
            self.rejections[code.name] += 1
            await context.abort(code, message)

        models = {w.model for w in self.workers.values()}
        if request.model and models and request.model not in models:
            await refuse(grpc.StatusCode.INVALID_ARGUMENT,
                         f"model {request.model!r} does not exist; served: {', '.join(sorted(models))}")
        if request.WhichOneof("prompt") != "token_ids":
            await refuse(grpc.StatusCode.INVALID_ARGUMENT, "the scheduler takes token ids; send text to a gateway")
        try:
            params = params_from_proto(request.params)
        except ValueError as e:
            await refuse(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        limits = self._limits()
        if limits is None:
            await refuse(grpc.StatusCode.UNAVAILABLE, "no worker is available")
        prompt = list(request.token_ids.ids)
        try:
            check_request(prompt, params, limits)
        except ValueError as e:
            await refuse(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if len(self.queue) >= self.options.max_queue_len:
            context.set_trailing_metadata((("retry-after", str(self.options.retry_after_s)),))
            await refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the queue is full ({self.options.max_queue_len} requests waiting); retry later")
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.requests:
            await refuse(grpc.StatusCode.INVALID_ARGUMENT, f"request id {request_id!r} is already in use")

        state = RequestState(request_id, prompt, params, request.params, request.priority, request.cache_salt or None)
        self.requests[request_id] = state
        self.telemetry.admitted(state, context.invocation_metadata(), request.model or next(iter(models), ""))
        self.kvstore.put_request(RequestRecord(request_id, prompt, params_to_dict(params), state.priority,
                                               state.cache_salt))
        self._enqueue(self._new_placement(state, 0, params.n, []))
        self._dispatch()
        return state

    async def Generate(self, request, context):
        state = await self._admit(request, context)
        try:
            yield generation_pb2.GenerateResponse(request_id=state.request_id)
            while True:
                item = await state.events.get()
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                yield item
                if item.HasField("usage"):
                    return
        finally:
            if not state.done:  # the client went away (or the request failed): free it everywhere
                self._abort_request(state)

    async def Abort(self, request, context):
        state = self.requests.get(request.request_id)
        if state is not None:
            self._abort_request(state)
            state.events.put_nowait(self._final_message(state))
        return generation_pb2.AbortResponse(found=state is not None)

    async def ListModels(self, request, context):
        models = {}
        for w in self.workers.values():
            models.setdefault(w.model, generation_pb2.ModelInfo(id=w.model, max_model_len=w.limits.max_model_len,
                                                                 vocab_size=w.limits.vocab_size))
        return generation_pb2.ListModelsResponse(models=list(models.values()))

    def _final_message(self, state: RequestState) -> generation_pb2.GenerateResponse:
        return generation_pb2.GenerateResponse(request_id=state.request_id, usage=state.usage())

    def _abort_request(self, state: RequestState) -> None:
        state.done = True
        for i, reason in enumerate(state.finish_reasons):
            if reason is None:
                state.finish_reasons[i] = "abort"
        for placement in list(state.placements.values()):
            link = self.workers.get(placement.worker_id)
            if link is not None:
                link.release(placement, abort=True)
        state.placements.clear()
        self.queue = [p for p in self.queue if p.request is not state]
        if self.requests.pop(state.request_id, None) is not None:
            self.telemetry.ended(state)
        self.kvstore.delete_request(state.request_id)
        self._dispatch()

    # -- placement ---------------------------------------------------------------------------

    def _new_placement(self, state: RequestState, base_index: int, num_seqs: int, resume: list[int]) -> Placement:
        limits = self._limits()
        block_size = limits.block_size if limits else 16
        hashes = hash_prompt_blocks(state.prompt_token_ids + resume, block_size, extra_keys_for(state.cache_salt))
        placement = Placement(state, base_index, num_seqs, list(resume), hashes)
        state.placements[placement.placement_id] = placement
        return placement

    def _enqueue(self, placement: Placement) -> None:
        keys = [p.sort_key for p in self.queue]
        self.queue.insert(bisect.bisect_right(keys, placement.sort_key), placement)

    def _dispatch(self) -> None:
        """Place queued sequences, oldest (or most important) first, while some worker has room."""
        while self.queue:
            placement = self.queue[0]
            links = [w for w in self.workers.values() if not w.draining and w.capacity >= placement.num_seqs]
            if not links:
                return
            self.queue.pop(0)
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

    # -- workers -----------------------------------------------------------------------------

    async def Connect(self, request_iterator, context):
        first = await request_iterator.__anext__()
        if not first.HasField("register"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a Register")
        reg = first.register
        old = self.workers.get(reg.worker_id)
        if old is not None:
            self._worker_lost(old)
        # The worker's first message after Register lists every block it holds: start from that.
        self.kvstore.purge_worker(reg.worker_id)
        link = WorkerLink(reg, limits_from_proto(reg.limits))
        self.workers[link.worker_id] = link
        await self._update_readiness()
        logger.info("worker %s registered (pid %d on %s, epoch %d, %d KV blocks)", link.worker_id, link.pid,
                    link.host, link.epoch, link.limits.num_blocks)
        reader = asyncio.ensure_future(self._read_worker(link, request_iterator))
        try:
            yield cluster_pb2.SchedulerMessage(heartbeat_interval_s=self.options.heartbeat_timeout_s / 3)
            self._dispatch()
            while not reader.done() and not link.closed.is_set():
                msg = link.take_message()
                if msg is not None:
                    yield msg
                    continue
                link.wakeup.clear()
                await link.wakeup.wait()
        finally:
            reader.cancel()
            self._worker_lost(link)
            await self._update_readiness()

    async def _read_worker(self, link: WorkerLink, request_iterator) -> None:
        try:
            async for msg in request_iterator:
                self._on_worker_message(link, msg)
        except Exception as e:  # a broken stream ends the link like a clean close does
            logger.warning("worker %s stream failed: %r", link.worker_id, e)
        finally:
            link.closed.set()
            link.wakeup.set()

    def _on_worker_message(self, link: WorkerLink, msg: cluster_pb2.WorkerMessage) -> None:
        link.last_seen = time.monotonic()
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
                link.release(placement, abort=False)
                placement.request.events.put_nowait(ValueError(rejection.message))
        for placement_id in msg.handed_back:
            placement = link.placements.get(placement_id)
            if placement is not None:
                link.release(placement, abort=False)
                self._requeue_unfinished(placement)
        self._dispatch()

    def _on_output(self, link: WorkerLink, out: cluster_pb2.PlacementOutput) -> None:
        placement = link.placements.get(out.placement_id)
        if placement is None:
            return  # aborted or moved while this output was in flight
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
            self.requests.pop(state.request_id, None)
            self.kvstore.delete_request(state.request_id)
            self.telemetry.ended(state)
        if response.outputs or state.done:
            state.events.put_nowait(response)

    def _worker_lost(self, link: WorkerLink) -> None:
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
        self._dispatch()

    async def _update_readiness(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self.workers else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(GENERATION_SERVICE, status)

    async def watch_leases(self) -> None:
        """Drop workers whose stream went silent (a hung process keeps its TCP connection open)."""
        while True:
            await asyncio.sleep(self.options.heartbeat_timeout_s / 3)
            now = time.monotonic()
            for link in list(self.workers.values()):
                if now - link.last_seen > self.options.heartbeat_timeout_s:
                    logger.warning("worker %s missed its heartbeat", link.worker_id)
                    self._worker_lost(link)

    async def GetStatus(self, request, context):
        status = cluster_pb2.ClusterStatus(
            queue_depth=len(self.queue), num_active_requests=len(self.requests), num_migrations=self.num_migrations,
            num_rejected=sum(self.rejections.values()), placements_by_worker=dict(self.placements_by_worker),
            placement_prefix_hit_tokens=sum(self.placement_hit_tokens_by_worker.values()))
        for w in self.workers.values():
            status.workers.append(cluster_pb2.WorkerStatus(
                worker_id=w.worker_id, epoch=w.epoch, pid=w.pid, host=w.host, draining=w.draining,
                num_placed=w.num_placed_seqs, load=w.load, num_index_blocks=self.kvstore.num_blocks(w.worker_id)))
        return status


async def run_scheduler(options: SchedulerOptions, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or forever)."""
    kvstore = open_kvstore(options.kvstore)
    await kvstore.start()
    stale = kvstore.list_requests()
    if stale:  # their streams ended with the scheduler that admitted them; the clients retry
        logger.warning("dropping %d request records left by a previous scheduler", len(stale))
        for record in stale:
            kvstore.delete_request(record.request_id)
    scheduler = Scheduler(options, kvstore)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    generation_pb2_grpc.add_GenerationServicer_to_server(scheduler, server)
    cluster_pb2_grpc.add_WorkerHubServicer_to_server(scheduler, server)
    cluster_pb2_grpc.add_ClusterServicer_to_server(scheduler, server)
    health_pb2_grpc.add_HealthServicer_to_server(scheduler.health, server)
    address = f"{options.host}:{options.port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"scheduler: cannot listen on {address}")
    await server.start()
    await scheduler.health.set("", health_pb2.HealthCheckResponse.SERVING)
    await scheduler._update_readiness()
    leases = asyncio.ensure_future(scheduler.watch_leases())
    metrics = None
    if options.metrics_port:
        registry = CollectorRegistry()
        registry.register(SchedulerCollector(scheduler))
        metrics = await start_metrics_server(registry, options.host, options.metrics_port, "scheduler")
    logger.info("scheduler listening on %s (kvstore: %s%s)", address, options.kvstore,
                f"; /metrics on port {options.metrics_port}" if metrics else "")
    try:
        await (stop.wait() if stop is not None else server.wait_for_termination())
    finally:
        leases.cancel()
        if metrics is not None:
            await metrics.cleanup()
        await server.stop(1.0)
        await kvstore.close()
