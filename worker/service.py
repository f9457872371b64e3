"""The worker process: one engine (one device's KV pool, or the simulated one) between the
scheduler, which tells it what to run, and the gateways, which get the tokens.

Two gRPC paths, both authenticated with the cluster's credentials (metroserve.rpc.auth):
- Control: the worker dials the scheduler and keeps one bidirectional stream open for its life.
  Assignments and ends come down; up go rejections and hand-backs as soon as they happen, and
  finished placements, the load and the prefix-cache block events at the interval the scheduler
  sets (REPORT_INTERVAL_S until it says; a heartbeat when idle). Finishes can wait: the gateway
  that delivered a request's last token tells the scheduler sooner. Nothing per token or per
  request: the scheduler's messages from a worker grow with time, not with its work.
- Tokens: the worker serves TokenStream. Each gateway subscribes once; after every engine step,
  the outputs of the placements a gateway owns (named in each Assignment) leave as one TokenBatch
  on that gateway's stream, with an empty output for each placement taken since the last step (the
  gateway's word that its request runs). Output for a gateway that has not subscribed yet waits in
  its outbox.

Decode steps run on the event loop's thread; a step that computes prompt tokens runs in the
engine's step thread, so heartbeats and tokens still leave during a prefill that takes seconds.
Between two steps the StepSink hands over the outputs, and the next step waits (at most
SEND_WAIT_S) until every subscribed gateway's stream took them, so tokens leave as they are made
rather than in bursts, and a stalled gateway cannot stop the engine.

If the scheduler's stream breaks (the scheduler restarts), running placements go on streaming to
their gateways; the worker redials and its Register lists them, and the new scheduler adopts them.
SIGTERM drains: readiness goes off, the scheduler stops placing here, running sequences finish
(or, after --drain-timeout, are handed back for the scheduler to move), then the process exits.

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry

from metroserve.rpc import (
    SERVER_GRPC_OPTIONS,
    WORKER_TO_SCHEDULER_GRPC_OPTIONS,
    cluster_pb2,
    cluster_pb2_grpc,
    generation_pb2,
)
from metroserve.rpc.auth import ClusterCredentials, add_server_port, open_channel, server_interceptors
from metroserve.rpc.convert import limits_to_proto, logprobs_to_proto, params_from_proto
from metroserve.services.metrics_http import start_metrics_server
from metroserve.services.tracing import extract_context, ns, tracer
from metroserve.worker.outputs import RequestOutput
from metroserve.worker.step_sink import EngineDeadError, ServingEngine, StepResult, StepSink

logger = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.5
SEND_WAIT_S = 1.0
# Finishes, load and block events go up at most this often, until the scheduler sets another
# interval (SchedulerMessage.report_interval_s; it raises it as workers join). A finished prompt's
# blocks reach the prefix index with the placement's finish (until then the scheduler counts them as
# placed here); blocks a decode fills can lag this much. The scheduler's cost then grows with
# workers, not with the step or request rate: reporting every 0.1 s cost 64 workers' scheduler 640
# messages a second.
REPORT_INTERVAL_S = 1.0


@dataclass
class ActivePlacement:
    request_id: str
    gateway_id: str
    base_index: int
    num_seqs: int
    num_tokens: list[int]  # per sequence: output tokens so far (resumed ones included)
    trace_parent: Context | None = None  # the scheduler's span for the request, while tracing is on


@dataclass
class GatewayOutbox:
    """Output waiting for one gateway's TokenStream subscription."""

    outputs: list[cluster_pb2.PlacementOutput] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # outputs waiting
    sent: asyncio.Event = field(default_factory=asyncio.Event)  # a batch went out
    subscribed: bool = False
    owner: object | None = None  # the subscription serving it: a newer one replaces it
    queued_version: int = 0
    sent_version: int = 0


@dataclass
class WorkerOptions:
    scheduler: str  # host:port
    worker_id: str
    host: str = "127.0.0.1"  # where its TokenStream (and health) listen
    port: int = 0  # TokenStream port; 0: any free one
    advertise_address: str | None = None  # what gateways dial; default host:port (this host's name for 0.0.0.0)
    health_port: int = 0  # 0: no separate health server
    drain_timeout_s: float = 30.0
    metrics_port: int = 0  # 0: no /metrics
    credentials: ClusterCredentials = field(default_factory=ClusterCredentials.from_env)


class WorkerService:
    def __init__(self, make_engine: Callable[[StepSink], ServingEngine], model_name: str, options: WorkerOptions):
        self.options = options
        self.model_name = model_name
        self.epoch = random.getrandbits(63)  # a restarted process never matches its old blocks
        # The real engine steps inline on the event loop: measured 0.78x -> 1.0x of offline
        # throughput through the whole service path (benchmarks/README.md).
        self.engine = make_engine(self)
        self.placements: dict[str, ActivePlacement] = {}  # submitted and not finished
        self.outboxes: dict[str, GatewayOutbox] = {}  # gateway id -> its output
        self.address = ""  # host:port gateways dial, once the server is up
        self._stats = self.engine.stats()  # as of the last step: the load report
        self._finished: list[cluster_pb2.PlacementFinish] = []
        self._rejected: list[cluster_pb2.Rejection] = []
        self._stored: list[bytes] = []
        self._removed: list[bytes] = []
        self._handed_back: list[str] = []
        self._taken: set[str] = set()  # gateways with placements taken since the last step
        self._urgent = asyncio.Event()  # something the scheduler must hear now
        self._control_sent = asyncio.Event()  # a message went to the scheduler
        self._heartbeat_s = 1.0
        self._report_interval_s = REPORT_INTERVAL_S
        self._session_number = 0  # of the current scheduler stream
        self._draining = False
        self._stop = asyncio.Event()
        self._dead: EngineDeadError | None = None
        self.health = health.aio.HealthServicer()
        self._idle = asyncio.Event()  # set while no placement is active: what a drain waits for
        self.tracer = tracer("metroserve.worker")

    # -- StepSink: called on the event loop after every engine step ------------------------

    def step_done(self, result: StepResult) -> Awaitable[None] | None:
        self._stats = result.stats
        touched, self._taken = self._taken, set()
        for out in result.outputs:
            placement = self.placements.get(out.request_id)
            if placement is None:
                continue  # handed back: the scheduler has moved it
            seqs, counts = [], []
            for c in out.outputs:
                if not c.token_ids and not out.finished:
                    continue
                placement.num_tokens[c.index] += len(c.token_ids)
                counts.append(placement.num_tokens[c.index])
                delta = generation_pb2.SequenceDelta(index=c.index, token_ids=c.token_ids,
                                                     finish_reason=c.finish_reason or "")
                if c.logprobs is not None:
                    delta.logprobs.extend(logprobs_to_proto(t, lp) for t, lp in zip(c.token_ids, c.logprobs))
                if isinstance(c.stop_reason, int):
                    delta.stop_token_id = c.stop_reason
                seqs.append(delta)
            if seqs:
                self._outbox(placement.gateway_id).outputs.append(cluster_pb2.PlacementOutput(
                    placement_id=out.request_id, num_cached_tokens=out.num_cached_tokens, seqs=seqs,
                    request_id=placement.request_id, base_index=placement.base_index, num_tokens=counts,
                    prompt_logprobs=_prompt_logprobs_proto(out)))
                touched.add(placement.gateway_id)
            if out.finished:
                self._finish(out, placement)
        self._stored.extend(result.blocks_stored)
        self._removed.extend(result.blocks_removed)
        waits = []
        for gateway_id in touched:
            outbox = self.outboxes[gateway_id]
            outbox.queued_version += 1
            outbox.ready.set()
            if outbox.subscribed:
                waits.append((outbox, outbox.queued_version))
        return self._until_sent(waits) if waits else None

    def _outbox(self, gateway_id: str) -> GatewayOutbox:
        outbox = self.outboxes.get(gateway_id)
        if outbox is None:
            outbox = self.outboxes[gateway_id] = GatewayOutbox()
        return outbox

    @staticmethod
    async def _until_sent(waits: list[tuple[GatewayOutbox, int]]) -> None:
        """Steps run on this loop: without this wait a step's tokens would leave only during later
        steps, in bursts. Bounded, so a stalled stream cannot stop the engine."""
        deadline = time.monotonic() + SEND_WAIT_S
        for outbox, version in waits:
            while outbox.subscribed and outbox.sent_version < version and (left := deadline - time.monotonic()) > 0:
                outbox.sent.clear()
                try:
                    await asyncio.wait_for(outbox.sent.wait(), left)
                except TimeoutError:
                    return

    def _finish(self, out: RequestOutput, placement: ActivePlacement) -> None:
        self._finished.append(cluster_pb2.PlacementFinish(
            placement_id=out.request_id, finish_reasons=[c.finish_reason or "abort" for c in out.outputs],
            num_tokens=placement.num_tokens, num_cached_tokens=out.num_cached_tokens))
        if placement.trace_parent is not None:
            self._trace(out, placement.trace_parent)
        self._discard(out.request_id)

    def _trace(self, out: RequestOutput, parent: Context) -> None:
        """Record a finished placement's spans (times and counts from the engine)."""
        if self.tracer is None:
            return
        m, end = out.metrics, time.time()
        attributes: dict[str, AttributeValue] = {
            "metroserve.worker": self.options.worker_id, "gen_ai.request.model": self.model_name,
            "metroserve.placement_id": out.request_id,
            "gen_ai.usage.input_tokens": len(out.prompt_token_ids),
            "gen_ai.usage.output_tokens": m.num_generation_tokens,
            "metroserve.cached_tokens": out.num_cached_tokens,
            "gen_ai.response.finish_reasons": [c.finish_reason or "" for c in out.outputs]}
        span = self.tracer.start_span("worker.request", context=parent, start_time=ns(m.arrival_time),
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
        placement = self.placements.pop(placement_id, None)
        if placement is not None:
            outbox = self.outboxes.get(placement.gateway_id)
            if outbox is not None and not outbox.subscribed and not outbox.outputs and not any(
                    p.gateway_id == placement.gateway_id for p in self.placements.values()):
                del self.outboxes[placement.gateway_id]
        if not self.placements:
            self._idle.set()

    def rejected(self, request_id: str, error: Exception) -> None:
        self._discard(request_id)
        self._rejected.append(cluster_pb2.Rejection(placement_id=request_id, message=str(error),
                                                    param=getattr(error, "param", None) or ""))
        self._urgent.set()

    def failed(self, error: EngineDeadError) -> None:
        self._dead = error
        self._stop.set()

    # -- the token streams (TokenStream service) --------------------------------------------

    async def subscribe(self, gateway_id: str):
        """One gateway's token stream: its outbox, one TokenBatch per step that had output for it.
        A second subscription of the same gateway replaces the first."""
        outbox = self._outbox(gateway_id)
        if outbox.subscribed:  # the old stream is dead or about to be: wake it so it ends
            outbox.ready.set()
        outbox.subscribed = True
        token = outbox.owner = object()
        try:
            while outbox.owner is token and not self._stop.is_set():
                if not outbox.outputs:
                    outbox.ready.clear()
                    await outbox.ready.wait()
                    continue
                version, outputs = outbox.queued_version, outbox.outputs
                outbox.outputs = []
                yield cluster_pb2.TokenBatch(outputs=outputs)
                outbox.sent_version = version
                outbox.sent.set()
        finally:
            if outbox.owner is token:
                outbox.subscribed = False
                outbox.sent.set()  # a step waiting on it goes on

    # -- the scheduler stream ----------------------------------------------------------------

    def _load(self) -> cluster_pb2.LoadReport:
        s = self._stats
        return cluster_pb2.LoadReport(
            num_running=s.num_running, num_waiting=s.num_waiting, num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions)

    def _register_message(self) -> cluster_pb2.WorkerMessage:
        running = [cluster_pb2.RunningPlacement(placement_id=pid, request_id=p.request_id, gateway_id=p.gateway_id,
                                                base_index=p.base_index, num_seqs=p.num_seqs)
                   for pid, p in self.placements.items()]
        return cluster_pb2.WorkerMessage(register=cluster_pb2.Register(
            worker_id=self.options.worker_id, epoch=self.epoch, model=self.model_name,
            limits=limits_to_proto(self.engine.limits), pid=os.getpid(), host=socket.gethostname(),
            address=self.address, running=running))

    async def _outgoing(self, session: int):
        yield self._register_message()
        # Everything the pool holds now: after a reconnect the scheduler's index starts from this.
        # Finishes queued for the previous stream concern placements the new scheduler never hears of.
        self._stored = self.engine.cached_block_hashes()
        self._finished, self._rejected, self._removed, self._handed_back = [], [], [], []
        self._urgent.set()
        last_report = 0.0
        while True:
            now = time.monotonic()
            wait = self._heartbeat_s if not (self._stored or self._removed or self._finished) else \
                max(0.0, last_report + self._report_interval_s - now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), wait)
            if session != self._session_number:
                return  # a dead call's iterator, which grpc may still run: it must not take messages
            self._urgent.clear()
            last_report = time.monotonic()
            msg = cluster_pb2.WorkerMessage(finished=self._finished, rejected=self._rejected, load=self._load(),
                                            blocks_stored=self._stored, blocks_removed=self._removed,
                                            draining=self._draining, handed_back=self._handed_back)
            self._finished, self._rejected, self._stored, self._removed, self._handed_back = [], [], [], [], []
            yield msg
            self._control_sent.set()

    def _handle(self, msg: cluster_pb2.SchedulerMessage) -> None:
        if msg.heartbeat_interval_s > 0:
            self._heartbeat_s = msg.heartbeat_interval_s
        if msg.report_interval_s > 0:
            self._report_interval_s = msg.report_interval_s
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
            parent = extract_context(dict(a.trace_context)) if self.tracer is not None and a.trace_context else None
            self.placements[a.placement_id] = ActivePlacement(
                a.request_id, a.gateway_id, a.base_index, params.n, [len(a.resume_token_ids)] * params.n, parent)
            self._outbox(a.gateway_id).outputs.append(cluster_pb2.PlacementOutput(
                placement_id=a.placement_id, request_id=a.request_id, base_index=a.base_index))
            self._taken.add(a.gateway_id)
            self._idle.clear()

    async def _session(self) -> None:
        """One connection to the scheduler, until the stream ends or the worker stops."""
        async with open_channel(self.options.scheduler, self.options.credentials,
                                WORKER_TO_SCHEDULER_GRPC_OPTIONS) as channel:
            self._session_number += 1
            call = cluster_pb2_grpc.WorkerHubStub(channel).Connect(self._outgoing(self._session_number))
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
            # Running placements go on: their tokens go to the gateways, and the next Register lists
            # them (a restarted scheduler adopts them; one that already moved them ends them).
            if not self._stop.is_set():
                await asyncio.sleep(RECONNECT_DELAY_S)  # back off before dialing again

    async def _drain(self) -> None:
        """SIGTERM: readiness off, stop taking work, finish or hand back what runs, then stop."""
        logger.info("draining %d placements", len(self.placements))
        self._draining = True
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self._urgent.set()
        try:
            if self.placements:
                self._idle.clear()
                try:
                    await asyncio.wait_for(self._idle.wait(), self.options.drain_timeout_s)
                except TimeoutError:
                    self._handed_back = sorted(self.placements)
                    for pid in self._handed_back:
                        self.engine.abort(pid)
                        self._discard(pid)
            # The hand-back, and finishes waiting for the next report, must reach the scheduler.
            self._control_sent.clear()
            self._urgent.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._control_sent.wait(), SEND_WAIT_S)
            # What the last steps made must reach the gateways before the process goes.
            await self._until_sent([(o, o.queued_version) for o in self.outboxes.values() if o.subscribed])
        finally:
            self._stop.set()

    async def _start_servers(self) -> list[grpc.aio.Server]:
        o = self.options
        server = grpc.aio.server(options=SERVER_GRPC_OPTIONS, interceptors=server_interceptors(o.credentials))
        cluster_pb2_grpc.add_TokenStreamServicer_to_server(TokenStreamService(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        port = add_server_port(server, f"{o.host}:{o.port}", o.credentials)
        if port == 0:
            raise SystemExit(f"worker {o.worker_id}: cannot listen on {o.host}:{o.port}")
        await server.start()
        host = o.host if o.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        self.address = o.advertise_address or f"{host}:{port}"
        servers = [server]
        if o.health_port:  # for probes that hold no credentials: health only
            probe = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, probe)
            probe.add_insecure_port(f"{o.host}:{o.health_port}")
            await probe.start()
            servers.append(probe)
        return servers

    async def run(self) -> None:
        metrics = None
        collector = self.engine.metrics_collector({"model_name": self.model_name})
        if self.options.metrics_port and collector is not None:
            registry = CollectorRegistry()
            registry.register(collector)
            metrics = await start_metrics_server(registry, self.options.host, self.options.metrics_port,
                                                 f"worker {self.options.worker_id}")
        servers = await self._start_servers()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(self._drain()))
        logger.info("worker %s (epoch %d) serving %s; tokens at %s; dialing the scheduler at %s",
                    self.options.worker_id, self.epoch, self.model_name, self.address, self.options.scheduler)
        try:
            await self._connect_loop()
        finally:
            await self.engine.shutdown()
            for server in servers:
                await server.stop(0.5)
            if metrics is not None:
                await metrics.cleanup()
        if self._dead is not None:
            raise SystemExit(f"worker {self.options.worker_id}: {self._dead}")


class TokenStreamService(cluster_pb2_grpc.TokenStreamServicer):
    def __init__(self, worker: WorkerService):
        self.worker = worker

    async def Subscribe(self, request, context):
        if not request.gateway_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a subscription needs a gateway id")
        async for batch in self.worker.subscribe(request.gateway_id):
            yield batch


def _prompt_logprobs_proto(out: RequestOutput) -> list[generation_pb2.TokenLogprobs]:
    """Prompt tokens 1.. with their logprobs (token 0 has none); empty when not asked or sent before."""
    if out.prompt_logprobs is None:
        return []
    return [logprobs_to_proto(t, lp) for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])
            if lp is not None]
