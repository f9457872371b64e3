"""Run gateway, scheduler and worker in this process with an in-memory span exporter, send one
request, print the spans as JSON. A separate process, because a tracer provider is process-global.

    python -m tests.trace_probe MODEL_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.stack import free_port

EXPECTED_SPANS = 7  # gateway 1, scheduler 2, worker 4


async def probe(model_dir: str, exporter: InMemorySpanExporter) -> None:
    from metroserve.scheduler.server import SchedulerOptions, run_scheduler
    from metroserve.services.gateway import GatewayOptions, run_gateway
    from metroserve.worker.async_engine import AsyncEngine
    from metroserve.worker.config import EngineConfig
    from metroserve.worker.model_files import served_model_name
    from metroserve.worker.service import WorkerOptions, WorkerService

    scheduler_port, rest_port = free_port(), free_port()
    stop = asyncio.Event()
    scheduler = asyncio.ensure_future(run_scheduler(SchedulerOptions(port=scheduler_port), stop))
    config = EngineConfig(model=model_dir, kv_cache_memory="64MiB")
    worker = WorkerService(lambda sink: AsyncEngine(config, detokenize=False, sink=sink, record_block_events=True,
                                                    step_inline=True),
                           served_model_name(model_dir),
                           WorkerOptions(scheduler=f"127.0.0.1:{scheduler_port}", worker_id="probe-worker"))
    worker_task = asyncio.ensure_future(worker.run())
    gateway = asyncio.ensure_future(run_gateway(GatewayOptions(scheduler=f"127.0.0.1:{scheduler_port}",
                                                               port=rest_port, grpc_port=0, model=model_dir), stop))
    base = f"http://127.0.0.1:{rest_port}"
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 60
        while True:  # until the worker has registered behind the gateway
            try:
                async with session.get(f"{base}/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the in-process stack did not become ready")
            await asyncio.sleep(0.1)
        async with session.post(f"{base}/v1/completions", json={"prompt": list(range(3, 23)), "max_tokens": 5,
                                                                 "ignore_eos": True}) as r:
            assert r.status == 200, await r.text()
    deadline = time.monotonic() + 10
    while len(exporter.get_finished_spans()) < EXPECTED_SPANS and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    worker._stop.set()
    stop.set()
    await asyncio.gather(scheduler, worker_task, gateway)


def main() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    asyncio.run(probe(sys.argv[1], exporter))
    print(json.dumps([_as_json(s) for s in exporter.get_finished_spans()]))


def _as_json(s: ReadableSpan) -> dict:
    assert s.instrumentation_scope is not None and s.context is not None, "every SDK span has both"
    return {"name": s.name, "scope": s.instrumentation_scope.name, "trace_id": format(s.context.trace_id, "032x"),
            "span_id": format(s.context.span_id, "016x"),
            "parent": format(s.parent.span_id, "016x") if s.parent is not None else None,
            "start": s.start_time, "end": s.end_time,
            "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (s.attributes or {}).items()}}


if __name__ == "__main__":
    main()
