"""The scheduler's gRPC face: thin servicers over SchedulerCore (scheduler/core.py), and run_scheduler.

Generation (gateways call it with token ids), WorkerHub (each worker's one bidirectional stream)
and Cluster (status) translate calls into core events and core errors into statuses: a
RequestError's code becomes the gRPC status of that name, its retry-after a trailing metadata entry.
Health reports readiness (a worker takes work) for the Generation service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from metroserve.kvstore import open_kvstore
from metroserve.rpc import (
    GENERATION_SERVICE,
    GRPC_OPTIONS,
    PARAM_METADATA_KEY,
    cluster_pb2,
    cluster_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)
from metroserve.scheduler.core import CoreOptions, RequestError, SchedulerCore
from metroserve.scheduler.metrics import SchedulerCollector
from metroserve.scheduler.worker_link import WorkerLink
from metroserve.services.metrics_http import start_metrics_server

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOptions(CoreOptions):
    host: str = "127.0.0.1"
    port: int = 50051
    kvstore: str = "memory"
    metrics_port: int = 0  # 0: no /metrics


async def _abort_call(context: grpc.aio.ServicerContext, error: RequestError) -> None:
    """End the call with the error's status (raises); retry-after and the faulty request field
    (`metroserve-param`) travel as trailing metadata."""
    metadata = []
    if error.retry_after_s is not None:
        metadata.append(("retry-after", str(error.retry_after_s)))
    if error.param is not None:
        metadata.append((PARAM_METADATA_KEY, error.param))
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    await context.abort(grpc.StatusCode[error.code.name], error.message)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core: SchedulerCore):
        self.core = core

    async def Generate(self, request, context):
        try:
            state = self.core.admit(request, context.invocation_metadata())
        except RequestError as e:
            await _abort_call(context, e)
        try:
            yield generation_pb2.GenerateResponse(request_id=state.request_id)
            while True:
                item = await state.events.get()
                if isinstance(item, RequestError):
                    await _abort_call(context, item)
                yield item
                if item.HasField("usage"):
                    return
        finally:  # the client went away, or the request failed: free it everywhere
            self.core.stream_closed(state)

    async def Abort(self, request, context):
        try:
            found = self.core.abort(request.request_id, request.ended)
        except RequestError as e:
            await _abort_call(context, e)
        return generation_pb2.AbortResponse(found=found)

    async def ListModels(self, request, context):
        return generation_pb2.ListModelsResponse(models=self.core.models())


class WorkerHubService(cluster_pb2_grpc.WorkerHubServicer):
    def __init__(self, core: SchedulerCore, health_servicer: health.aio.HealthServicer):
        self.core = core
        self.health = health_servicer

    async def update_readiness(self) -> None:
        serving = bool(self.core.workers)
        await self.health.set(GENERATION_SERVICE, health_pb2.HealthCheckResponse.SERVING if serving
                              else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Connect(self, request_iterator, context):
        first = await request_iterator.__anext__()
        if not first.HasField("register"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a Register")
        link = self.core.worker_registered(first.register, time.monotonic())
        await self.update_readiness()
        reader = asyncio.ensure_future(self._read_worker(link, request_iterator))
        try:
            yield cluster_pb2.SchedulerMessage(heartbeat_interval_s=self.core.options.heartbeat_timeout_s / 3)
            while not reader.done() and not link.closed.is_set():
                msg = link.take_message()
                if msg is not None:
                    yield msg
                    continue
                link.wakeup.clear()
                await link.wakeup.wait()
        finally:
            reader.cancel()
            self.core.worker_lost(link)
            await self.update_readiness()

    async def _read_worker(self, link: WorkerLink, request_iterator) -> None:
        try:
            async for msg in request_iterator:
                self.core.worker_message(link, msg, time.monotonic())
        except Exception as e:  # a broken stream ends the link like a clean close does
            logger.warning("worker %s stream failed: %r", link.worker_id, e)
        finally:
            link.closed.set()
            link.wakeup.set()

    async def watch_leases(self) -> None:
        """Drop workers whose stream went silent (a hung process keeps its TCP connection open)."""
        while True:
            await asyncio.sleep(self.core.options.heartbeat_timeout_s / 3)
            if self.core.check_leases(time.monotonic()):
                await self.update_readiness()


class ClusterService(cluster_pb2_grpc.ClusterServicer):
    def __init__(self, core: SchedulerCore):
        self.core = core

    async def GetStatus(self, request, context):
        return self.core.status()


async def run_scheduler(options: SchedulerOptions, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or forever)."""
    kvstore = open_kvstore(options.kvstore)
    await kvstore.start()
    stale = kvstore.list_requests()
    if stale:  # their streams ended with the scheduler that admitted them; the clients retry
        logger.warning("dropping %d request records left by a previous scheduler", len(stale))
        for record in stale:
            kvstore.delete_request(record.request_id)
    core = SchedulerCore(options, kvstore)
    health_servicer = health.aio.HealthServicer()
    hub = WorkerHubService(core, health_servicer)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(core), server)
    cluster_pb2_grpc.add_WorkerHubServicer_to_server(hub, server)
    cluster_pb2_grpc.add_ClusterServicer_to_server(ClusterService(core), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{options.host}:{options.port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"scheduler: cannot listen on {address}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await hub.update_readiness()
    leases = asyncio.ensure_future(hub.watch_leases())
    metrics = None
    if options.metrics_port:
        registry = CollectorRegistry()
        registry.register(SchedulerCollector(core))
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
