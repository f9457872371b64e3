"""The gateway process: REST (OpenAI-compatible) and public gRPC in front of the cluster.

It holds a tokenizer, a control stream to the scheduler and a token stream from each worker
(services/cluster_client.py), and nothing that outlives a request, so any number of gateways can
run against one scheduler. Each request's tokens come straight from its worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from dataclasses import dataclass, field

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from metroserve.common.tokenizer import load_tokenizer
from metroserve.rpc import GENERATION_SERVICE, SERVER_GRPC_OPTIONS
from metroserve.rpc.auth import ClusterCredentials
from metroserve.services.chat_serving import ChatServing
from metroserve.services.cluster_client import ClusterClient
from metroserve.services.cors import CorsPolicy
from metroserve.services.gateway_metrics import GatewayMetrics
from metroserve.services.grpc_api import ApiKeyInterceptor, GatewayGeneration, add_generation_servicer
from metroserve.services.http_limits import HttpLimits
from metroserve.services.prompt_log import PromptLog
from metroserve.services.rest import RestAPI
from metroserve.worker.model_files import resolve_model_dir, served_model_name

logger = logging.getLogger(__name__)

READINESS_POLL_S = 2.0
# What gRPC server reflection lists on the public port (grpcurl list / describe).
REFLECTED_SERVICES = (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)


@dataclass
class GatewayOptions:
    scheduler: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50052  # 0: no public gRPC
    model: str | None = None  # for the tokenizer and chat template; the same as the workers'
    served_model_name: str | None = None
    api_key: str | None = None
    limits: HttpLimits = field(default_factory=HttpLimits)
    prompt_log: PromptLog = field(default_factory=PromptLog)  # off: no prompt text in any log
    cors: CorsPolicy = field(default_factory=CorsPolicy)  # default: off, no CORS headers
    chat: ChatServing = field(default_factory=ChatServing)  # --chat-template, --tool-call-parser
    scheduler_wait_s: float = 30.0  # a request waits this long for a scheduler that does not answer
    credentials: ClusterCredentials = field(default_factory=ClusterCredentials.from_env)


def _max_model_len(model_dir) -> int:
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 0))


async def _mirror_readiness(client: ClusterClient, servicer) -> None:
    """Readiness (service metroserve.v1.Generation): connected to the scheduler, a worker behind it."""
    while True:
        serving = await client.ready()
        await servicer.set(GENERATION_SERVICE, health_pb2.HealthCheckResponse.SERVING if serving
                           else health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.sleep(READINESS_POLL_S)


def _raise_open_file_limit() -> None:
    """Every client connection holds a socket: take the hard limit, as servers do, so that a soft
    limit of 1024 does not refuse connections past about a thousand."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run_gateway(options: GatewayOptions, stop: asyncio.Event | None = None) -> None:
    _raise_open_file_limit()
    api_key = options.api_key or os.environ.get("METROSERVE_API_KEY") or None
    model_dir = resolve_model_dir(options.model)
    tokenizer = load_tokenizer(model_dir)
    options.chat.apply_template(tokenizer)
    model_name = options.served_model_name or served_model_name(options.model)
    client = ClusterClient(options.scheduler, options.credentials, scheduler_wait_s=options.scheduler_wait_s)
    client.start()

    metrics = GatewayMetrics()
    rest = RestAPI(client, tokenizer, model_name, _max_model_len(model_dir), api_key, options.limits, metrics,
                   options.cors, options.chat.tool_call_parser, options.prompt_log)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts upstream.
    # keepalive_timeout: aiohttp arms it at connect, so it also bounds the wait for headers.
    runner = web.AppRunner(rest.app(), handler_cancellation=True, access_log=None,
                           keepalive_timeout=options.limits.timeout_keep_alive_s)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    await site.start()

    server = None
    readiness = None
    if options.grpc_port:
        server = grpc.aio.server(options=SERVER_GRPC_OPTIONS,
                                 interceptors=[ApiKeyInterceptor(api_key)] if api_key else None)
        add_generation_servicer(GatewayGeneration(client, tokenizer, model_name, metrics, options.prompt_log), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(REFLECTED_SERVICES, server)
        if server.add_insecure_port(f"{options.host}:{options.grpc_port}") == 0:
            raise SystemExit(f"gateway: cannot listen on {options.host}:{options.grpc_port}")
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)  # liveness
        readiness = asyncio.ensure_future(_mirror_readiness(client, health_servicer))
    logger.info("gateway serving %s: REST on http://%s:%d, gRPC on %s; scheduler %s%s", model_name, options.host,
                options.port, options.grpc_port or "-", options.scheduler, "; API key required" if api_key else "")
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        if readiness is not None:
            readiness.cancel()
        if server is not None:
            await server.stop(1.0)
        await runner.cleanup()
        await client.close()
