"""The worker process: one engine (one device's KV pool) on a stream to the scheduler.

The worker dials the scheduler and keeps one bidirectional gRPC stream open for its life:
assignments and aborts come down; after every engine step, one message goes up with every
sequence's new tokens, the load, and the prefix-cache blocks stored and evicted in that step.
Nothing here runs inside the step itself: steps run on the event loop's thread, and between two
steps the engine's StepSink hands over the outputs, the message is built and sent, and incoming
assignments and aborts are taken in.

SIGTERM drains: readiness goes off, the scheduler stops placing here, running sequences finish
(or, after --drain-timeout, are handed back for the scheduler to move), then the process exits.
If the stream breaks, every placement is dropped (the scheduler moves them) and the worker dials
again, reporting the blocks it still holds so the prefix index recovers.

--metrics-port serves the engine's Prometheus metrics (worker/metrics.py). With tracing on, a
placement's spans (worker.request and its queue / prefill / decode phases) are recorded when it
finishes, from the engine's timestamps, under the scheduler span named in its Assignment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry

from metroserve.rpc import GRPC_OPTIONS, cluster_pb2, cluster_pb2_grpc, generation_pb2
from metroserve.rpc.convert import limits_to_proto, logprobs_to_proto, params_from_proto
from metroserve.services.metrics_http import start_metrics_server
from metroserve.services.tracing import extract_context, ns, tracer
from metroserve.worker.async_engine import AsyncEngine, EngineDeadError, StepResult
from metroserve.worker.config import EngineConfig
from metroserve.worker.metrics import EngineCollector
from metroserve.worker.model_files import served_model_name
from metroserve.worker.outputs import RequestOutput

logger = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.5
SEND_WAIT_S = 1.0


@dataclass
class TracedPlacement:
    parent: Context  # the scheduler's span for the request


@dataclass
class WorkerOptions:
    scheduler: str  # host:port
    worker_id: str
    health_port: int = 0  # 0: no health server
    drain_timeout_s: float = 30.0
    served_model_name: str | None = None
    metrics_port: int = 0  # 0: no /metrics


class WorkerService:
    def __init__(self, config: EngineConfig, options: WorkerOptions):
        self.options = options
        self.model_name = options.served_model_name or served_model_name(config.model)
        self.epoch = random.getrandbits(63)  # a restarted process never matches its old blocks
        # Steps run inline on the event loop: measured 0.78x -> 1.0x of offline throughput through
        # the whole service path (benchmarks/README.md), and a hung step also stops the heartbeat.
        self.engine = AsyncEngine(config, detokenize=False, sink=self, record_block_events=True, step_inline=True)
        self.active: set[str] = set()  # placement ids submitted and not finished
        self._stats = self.engine.stats()  # as of the last step: the load report
        self._outputs: list[cluster_pb2.PlacementOutput] = []
        self._rejected: list[cluster_pb2.Rejection] = []
        self._stored: list[bytes] = []
        self._removed: list[bytes] = []
        self._handed_back: list[str] = []
        self._outbox = asyncio.Event()
        self._heartbeat_s = 1.0
        self._draining = False
        self._stop = asyncio.Event()
        self._dead: EngineDeadError | None = None
        self.health = health.aio.HealthServicer()
        self._idle = asyncio.Event()  # set while no placement is active: what a drain waits for
        self._sent = asyncio.Event()  # set after each message goes out
        self._queued_version = 0  # step outputs queued so far ...
        self._sent_version = 0  # ... and how many of them have been handed to gRPC
        self._connected = False  # a stream to the scheduler is open
        self.tracer = tracer("metroserve.worker")
        self._traced: dict[str, TracedPlacement] = {}  # placement id -> its trace, while tracing is on

    # -- StepSink: called on the event loop after every engine step ------------------------

    def step_done(self, result: StepResult) -> Awaitable[None] | None:
        self._stats = result.stats
        for out in result.outputs:
            if out.request_id not in self.active:
                continue  # handed back or cut off with its stream: the scheduler has moved it
            seqs = []
            for c in out.outputs:
                if not c.token_ids and not out.finished:
                    continue
                delta = generation_pb2.SequenceDelta(index=c.index, token_ids=c.token_ids,
                                                     finish_reason=c.finish_reason or "")
                if c.logprobs is not None:
                    delta.logprobs.extend(logprobs_to_proto(t, lp) for t, lp in zip(c.token_ids, c.logprobs))
                if isinstance(c.stop_reason, int):
                    delta.stop_token_id = c.stop_reason
                seqs.append(delta)
            if seqs:
                self._outputs.append(cluster_pb2.PlacementOutput(
                    placement_id=out.request_id, num_cached_tokens=out.num_cached_tokens, seqs=seqs))
            if self._traced:
                self._trace_output(out)
            if out.finished:
                self._discard(out.request_id)
        self._stored.extend(result.blocks_stored)
        self._removed.extend(result.blocks_removed)
        self._queued_version += 1
        self._outbox.set()
        return self._until_sent(self._queued_version) if self._connected else None

    async def _until_sent(self, version: int) -> None:
        """Steps run on this loop: without this wait a step's tokens would leave only during later
        steps, in bursts. Bounded, so a stalled stream cannot stop the engine."""
        deadline = time.monotonic() + SEND_WAIT_S
        while self._sent_version < version and (left := deadline - time.monotonic()) > 0:
            self._sent.clear()
            try:
                await asyncio.wait_for(self._sent.wait(), left)
            except TimeoutError:
                return

    def _trace_output(self, out: RequestOutput) -> None:
        """When a traced placement ends, record its spans (times and counts from the engine)."""
        traced = self._traced.get(out.request_id)
        if traced is None or self.tracer is None or not out.finished:  # traced only while tracing is on
            return
        del self._traced[out.request_id]
        m, end = out.metrics, time.time()
        attributes: dict[str, AttributeValue] = {
            "metroserve.worker": self.options.worker_id, "gen_ai.request.model": self.model_name,
            "metroserve.placement_id": out.request_id,
            "gen_ai.usage.input_tokens": len(out.prompt_token_ids),
            "gen_ai.usage.output_tokens": m.num_generation_tokens,
            "metroserve.cached_tokens": out.num_cached_tokens,
            "gen_ai.response.finish_reasons": [c.finish_reason or "" for c in out.outputs]}
        span = self.tracer.start_span("worker.request", context=traced.parent, start_time=ns(m.arrival_time),
                                      attributes=attributes)
        child = trace.set_span_in_context(span)
        phases = (("worker.queue", m.arrival_time, m.first_scheduled_time),
                  ("worker.prefill", m.first_scheduled_time, m.first_token_time),
                  ("worker.decode", m.first_token_time, end))
        for name, start, stop in phases:
            if start is not None and stop is not None:
                self.tracer.start_span(name, context=child, start_time=ns(start)).end(end_time=ns(stop))
        span.end(end_time=ns(end))

    def _discard(self, placement_id: str) -> None:
        self.active.discard(placement_id)
        self._traced.pop(placement_id, None)
        if not self.active:
            self._idle.set()

    def rejected(self, request_id: str, error: Exception) -> None:
        self._discard(request_id)
        self._rejected.append(cluster_pb2.Rejection(placement_id=request_id, message=str(error)))
        self._outbox.set()

    def failed(self, error: EngineDeadError) -> None:
        self._dead = error
        self._stop.set()

    # -- the stream --------------------------------------------------------------------------

    def _load(self) -> cluster_pb2.LoadReport:
        s = self._stats
        return cluster_pb2.LoadReport(
            num_running=s.num_running, num_waiting=s.num_waiting, num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions)

    def _register_message(self) -> cluster_pb2.WorkerMessage:
        return cluster_pb2.WorkerMessage(register=cluster_pb2.Register(
            worker_id=self.options.worker_id, epoch=self.epoch, model=self.model_name,
            limits=limits_to_proto(self.engine.limits), pid=os.getpid(), host=socket.gethostname()))

    async def _outgoing(self):
        self._connected = True
        yield self._register_message()
        # Everything the pool holds now: after a reconnect the scheduler's index starts from this.
        # Whatever was queued for the previous stream concerns placements that died with it.
        self._stored = self.engine.cached_block_hashes()
        self._outputs, self._rejected, self._removed, self._handed_back = [], [], [], []
        self._outbox.set()
        while True:
            with contextlib.suppress(TimeoutError):  # idle: the load report doubles as the heartbeat
                await asyncio.wait_for(self._outbox.wait(), self._heartbeat_s)
            self._outbox.clear()
            version = self._queued_version
            msg = cluster_pb2.WorkerMessage(outputs=self._outputs, rejected=self._rejected, load=self._load(),
                                            blocks_stored=self._stored, blocks_removed=self._removed,
                                            draining=self._draining, handed_back=self._handed_back)
            self._outputs, self._rejected, self._stored, self._removed, self._handed_back = [], [], [], [], []
            yield msg
            self._sent_version = version
            self._sent.set()

    def _handle(self, msg: cluster_pb2.SchedulerMessage) -> None:
        if msg.heartbeat_interval_s > 0:
            self._heartbeat_s = msg.heartbeat_interval_s
        for end in msg.end:  # its finished output (counted, traced) comes from the next step_done
            self.engine.abort(end.placement_id, list(end.finish_reasons), list(end.num_tokens))
        for a in msg.assign:
            try:
                params = params_from_proto(a.params)
                self.engine.submit(list(a.prompt_token_ids), params, a.placement_id, priority=a.priority,
                                   cache_salt=a.cache_salt or None, resume_token_ids=list(a.resume_token_ids))
            except EngineDeadError:
                return  # the worker is stopping; the scheduler moves this placement when the stream ends
            except ValueError as e:
                self.rejected(a.placement_id, e)
                continue
            self.active.add(a.placement_id)
            self._idle.clear()
            if self.tracer is not None and a.trace_context:
                self._traced[a.placement_id] = TracedPlacement(extract_context(dict(a.trace_context)))

    async def _session(self) -> None:
        """One connection to the scheduler, until the stream ends or the worker stops."""
        async with grpc.aio.insecure_channel(self.options.scheduler, options=GRPC_OPTIONS) as channel:
            call = cluster_pb2_grpc.WorkerHubStub(channel).Connect(self._outgoing())
            reader = asyncio.ensure_future(self._read(call))
            stopper = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait([reader, stopper], return_when=asyncio.FIRST_COMPLETED)
                if reader.done():
                    reader.result()
            finally:
                stopper.cancel()
                reader.cancel()
                call.cancel()

    async def _read(self, call) -> None:
        async for msg in call:
            self._handle(msg)
        logger.warning("scheduler closed the stream")

    async def _connect_loop(self) -> None:
        while not self._stop.is_set():
            try:
                await self._session()
            except grpc.aio.AioRpcError as e:
                logger.warning("scheduler stream at %s: %s", self.options.scheduler, e.details() or e.code())
            self._connected = False
            # The scheduler treats a broken stream as this worker's death and moves its placements.
            for pid in list(self.active):
                self.engine.abort(pid)
                self._discard(pid)
            if not self._stop.is_set():
                await asyncio.sleep(RECONNECT_DELAY_S)  # back off before dialing again

    async def _drain(self) -> None:
        """SIGTERM: readiness off, stop taking work, finish or hand back what runs, then stop."""
        logger.info("draining %d placements", len(self.active))
        self._draining = True
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self._outbox.set()
        try:
            if self.active:
                self._idle.clear()
                try:
                    await asyncio.wait_for(self._idle.wait(), self.options.drain_timeout_s)
                except TimeoutError:
                    self._handed_back = sorted(self.active)
                    for pid in self._handed_back:
                        self.engine.abort(pid)
                        self._discard(pid)
                    self._queued_version += 1
                    self._outbox.set()
                    await self._until_sent(self._queued_version)  # the hand-back must reach the scheduler
        finally:
            self._stop.set()

    async def run(self) -> None:
        server = metrics = None
        if self.options.metrics_port and self.engine.engine.metrics is not None:
            registry = CollectorRegistry()
            registry.register(EngineCollector(self.engine.engine, {"model_name": self.model_name}))
            metrics = await start_metrics_server(registry, "0.0.0.0", self.options.metrics_port,
                                                 f"worker {self.options.worker_id}")
        if self.options.health_port:
            server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            server.add_insecure_port(f"0.0.0.0:{self.options.health_port}")
            await server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(self._drain()))
        logger.info("worker %s (epoch %d) serving %s, dialing the scheduler at %s", self.options.worker_id,
                    self.epoch, self.model_name, self.options.scheduler)
        try:
            await self._connect_loop()
        finally:
            await self.engine.shutdown()
            if server is not None:
                await server.stop(0.5)
            if metrics is not None:
                await metrics.cleanup()
        if self._dead is not None:
            raise SystemExit(f"worker {self.options.worker_id}: {self._dead}")
