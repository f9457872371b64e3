"""The scheduler process: gRPC adapters around SchedulerCore (scheduler/core.py).

WorkerHub (each worker's stream), GatewayHub (each gateway's stream) and Cluster (status)
translate streams into core events. Every service needs the cluster's credentials
(metroserve.rpc.auth): a peer without them is refused before any message is read. Health reports
readiness (a worker takes work) for the Generation service the gateways serve.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from metroserve.kvstore import open_kvstore
from metroserve.rpc import GENERATION_SERVICE, SCHEDULER_GRPC_OPTIONS, cluster_pb2, cluster_pb2_grpc
from metroserve.rpc.auth import ClusterCredentials, add_server_port, server_interceptors
from metroserve.scheduler.core import CoreOptions, SchedulerCore, heartbeat_interval_s
from metroserve.scheduler.metrics import SchedulerCollector
from metroserve.services.metrics_http import start_metrics_server

logger = logging.getLogger(__name__)

# How often leases, gateway grace and the recovery window are checked (each ends at most this late).
# Every wakeup costs an idle scheduler CPU: checking 4 times a second cost it ~0.7 ms/s more.
LEASE_CHECK_S = 1.0


@dataclass
class SchedulerOptions(CoreOptions):
    host: str = "127.0.0.1"
    port: int = 50051
    kvstore: str = "memory"
    metrics_port: int = 0  # 0: no /metrics
    credentials: ClusterCredentials = field(default_factory=ClusterCredentials.from_env)


async def _serve_link(first_message: Any, request_iterator: AsyncIterator, link: Any, peer: str,
                      on_message: Callable[[Any], None]) -> AsyncIterator[Any]:
    """One hub stream: read the peer's messages into the core while writing the link's outbox,
    one message per wakeup, after `first_message` if one is given."""
    async def read() -> None:
        try:
            async for msg in request_iterator:
                on_message(msg)
        except Exception as e:  # a broken stream ends the link like a clean close does
            logger.warning("stream of %s failed: %r", peer, e)
        finally:
            link.closed.set()
            link.wakeup.set()

    reader = asyncio.ensure_future(read())
    try:
        if first_message is not None:
            yield first_message
        while not reader.done() and not link.closed.is_set():
            msg = link.take_message()
            if msg is not None:
                yield msg
                continue
            link.wakeup.clear()
            await link.wakeup.wait()
    finally:
        reader.cancel()


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
        heartbeat_s = heartbeat_interval_s(self.core.options.heartbeat_timeout_s)
        hello = cluster_pb2.SchedulerMessage(heartbeat_interval_s=heartbeat_s,
                                             report_interval_s=self.core.report_interval_s)
        try:
            async for msg in _serve_link(hello, request_iterator, link, f"worker {link.worker_id}",
                                         lambda m: self.core.worker_message(link, m, time.monotonic())):
                yield msg
        finally:
            self.core.worker_lost(link)
            await self.update_readiness()


class GatewayHubService(cluster_pb2_grpc.GatewayHubServicer):
    def __init__(self, core: SchedulerCore):
        self.core = core

    async def Connect(self, request_iterator, context):
        first = await request_iterator.__anext__()
        if not first.HasField("register"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a GatewayRegister")
        link = self.core.gateway_registered(first.register, time.monotonic())
        try:  # its first message is the worker list, queued at registration
            async for msg in _serve_link(None, request_iterator, link, f"gateway {link.gateway_id}",
                                         lambda m: self.core.gateway_message(link, m, time.monotonic())):
                yield msg
        finally:
            self.core.gateway_lost(link, time.monotonic())


class ClusterService(cluster_pb2_grpc.ClusterServicer):
    def __init__(self, core: SchedulerCore):
        self.core = core

    async def GetStatus(self, request, context):
        return self.core.status()


async def _watch_leases(core: SchedulerCore, hub: WorkerHubService) -> None:
    """Drop silent workers (a hung process keeps its TCP connection open), end requests of gateways
    gone past their grace, close the recovery window."""
    while True:
        await asyncio.sleep(LEASE_CHECK_S)
        if core.check_leases(time.monotonic()):
            await hub.update_readiness()


async def run_scheduler(options: SchedulerOptions, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or forever)."""
    kvstore = open_kvstore(options.kvstore)
    await kvstore.start()
    core = SchedulerCore(options, kvstore)
    health_servicer = health.aio.HealthServicer()
    hub = WorkerHubService(core, health_servicer)
    server = grpc.aio.server(options=SCHEDULER_GRPC_OPTIONS, interceptors=server_interceptors(options.credentials))
    cluster_pb2_grpc.add_WorkerHubServicer_to_server(hub, server)
    cluster_pb2_grpc.add_GatewayHubServicer_to_server(GatewayHubService(core), server)
    cluster_pb2_grpc.add_ClusterServicer_to_server(ClusterService(core), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{options.host}:{options.port}"
    if add_server_port(server, address, options.credentials) == 0:
        raise SystemExit(f"scheduler: cannot listen on {address}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await hub.update_readiness()
    leases = asyncio.ensure_future(_watch_leases(core, hub))
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
