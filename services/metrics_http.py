"""Prometheus exposition over HTTP: GET /metrics for one registry.

The gateway adds the route to its REST app; the scheduler and workers start this small aiohttp
server on their own --metrics-port. It runs on the process's event loop, so a scrape reads state
between two of its tasks' steps and needs no locks.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def metrics_handler(registry: CollectorRegistry):
    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int, what: str) -> web.AppRunner:
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(registry))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        await runner.cleanup()
        raise SystemExit(f"{what}: cannot serve /metrics on {host}:{port}: {e.strerror or e}") from None
    return runner
