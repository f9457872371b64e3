"""What observability costs: throughput with metrics, request logs and tracing on vs all off.

Two `metroserve serve` stacks run side by side on loopback, one with everything on (engine
metrics, a scraper reading the gateway's, scheduler's and worker's /metrics every
--scrape-interval seconds while that stack is measured, one JSON log line per request written to
a file, OTLP tracing to a sink in this process that accepts and counts the spans) and one with
everything off (--disable-log-stats, --disable-log-requests, no OTLP endpoint, no scraping). The
same streamed requests go to each in turn; rounds alternate which stack goes first, because this
machine is noisy, and the report gives every run, the medians and their ratio.

    metroserve bench observability --num-requests 64 --max-tokens 64 --concurrency 32 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from metroserve.benchmarks.serve_overhead import add_workload_arguments, run_served, wait_healthy
from metroserve.benchmarks.workload import build_chat_workload

ROOT = Path(__file__).resolve().parents[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, 5, "on/off pairs, interleaved")
    parser.add_argument("--scrape-interval", type=float, default=1.0,
                        help="seconds between scrapes of every /metrics (Prometheus' default is 15)")
    parser.add_argument("--port", type=int, default=18500, help="first of ten loopback ports for the two stacks")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--json-out", type=Path, default=None)


def _attribute(value):
    """An OTLP AnyValue as Python: scalars as themselves, arrays as lists."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_attribute(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class SpanSink:
    """An OTLP/HTTP trace endpoint on loopback (a stand-in collector): accepts exports and keeps, for
    each span, (service.name, span name, trace id) in `spans` and its name and attributes in
    `span_records`. Port 0 picks a free one."""

    def __init__(self, port: int = 0):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.exports = 0
        self.bytes = 0
        self.spans: list[tuple[str, str, str]] = []
        self.span_records: list[dict] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                spans = []
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    service = next((a.value.string_value for a in resource_spans.resource.attributes
                                    if a.key == "service.name"), "")
                    spans += [(service, s.name, s.trace_id.hex()) for scope in resource_spans.scope_spans
                              for s in scope.spans]
                sink.spans += spans
                sink.span_records += [{"name": s.name, "attributes": {a.key: _attribute(a.value) for a in s.attributes}}
                                      for resource_spans in request.resource_spans
                                      for scope in resource_spans.scope_spans for s in scope.spans]
                sink.exports += 1
                sink.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Scraper:
    """Reads each /metrics every interval while running, as a Prometheus server would."""

    def __init__(self, urls: list[str], interval_s: float):
        self.urls, self.interval_s = urls, interval_s
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            for url in self.urls:
                with urllib.request.urlopen(url, timeout=10) as reply:
                    reply.read()
                self.scrapes += 1
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> Scraper:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        assert self._thread is not None, "__exit__ without __enter__"
        self._thread.join()


def _start_stack(model_dir: Path, port: int, args: argparse.Namespace, on: bool, sink_url: str,
                 log_path: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "metroserve.services.cli", "serve", "--model", str(model_dir),
            "--served-model-name", "bench", "--port", str(port), "--grpc-port", str(port + 1),
            "--scheduler-port", str(port + 2),
            "--max-num-seqs", str(args.concurrency), "--kv-cache-memory", args.kv_cache_memory,
            "--no-enable-prefix-caching"]
    if on:
        argv += ["--metrics-port", str(port + 3), "--otlp-endpoint", sink_url]
    else:
        argv += ["--metrics-port", "0", "--disable-log-stats", "--disable-log-requests"]
    # Spans leave in batches every 0.5 s, so the sink sees them during the run, not at exit.
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "500"}
    with open(log_path, "wb") as log:  # the child writes through its own copy of the descriptor
        return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from metroserve.common.tokenizer import load_tokenizer
    from metroserve.worker.model_files import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    prompts = build_chat_workload(load_tokenizer(model_dir), num_requests=args.num_requests)
    sink = SpanSink(args.port + 9)
    logs = Path(tempfile.mkdtemp(prefix="metroserve-obs-"))
    ports = {"on": args.port, "off": args.port + 5}
    stacks = {mode: _start_stack(model_dir, ports[mode], args, mode == "on", sink.url, logs / f"{mode}.log")
              for mode in ("on", "off")}
    on_port = ports["on"]
    scraper = Scraper([f"http://127.0.0.1:{on_port}/metrics", f"http://127.0.0.1:{on_port + 3}/metrics",
                       f"http://127.0.0.1:{on_port + 4}/metrics"], args.scrape_interval)
    runs: list[dict[str, Any]] = []
    try:
        for mode, proc in stacks.items():
            wait_healthy(f"http://127.0.0.1:{ports[mode]}/health", proc)
            # Warm-up: a CPU engine's first steps at new batch shapes are much slower.
            asyncio.run(run_served(f"http://127.0.0.1:{ports[mode]}/v1", "bench", prompts[: args.concurrency], 16,
                                   args.concurrency, args.client))
        for round_index in range(args.rounds):
            for mode in ("on", "off") if round_index % 2 == 0 else ("off", "on"):
                url = f"http://127.0.0.1:{ports[mode]}/v1"
                if mode == "on":
                    with scraper:
                        seconds, tokens = asyncio.run(run_served(url, "bench", prompts, args.max_tokens,
                                                                 args.concurrency, args.client))
                else:
                    seconds, tokens = asyncio.run(run_served(url, "bench", prompts, args.max_tokens, args.concurrency,
                                                         args.client))
                runs.append({"round": round_index, "mode": mode, "seconds": seconds, "output_tokens": tokens,
                             "tokens_per_s": tokens / seconds})
                print(f"round {round_index} {mode:3s} {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} tok/s",
                      flush=True)
        time.sleep(1.0)  # the last spans' batch
    finally:
        for proc in stacks.values():
            proc.terminate()
        for proc in stacks.values():
            proc.wait(timeout=120)

    med = {mode: statistics.median(r["tokens_per_s"] for r in runs if r["mode"] == mode) for mode in ("on", "off")}
    log_lines = sum(1 for line in (logs / "on.log").read_text(errors="replace").splitlines()
                    if "metroserve.requests:" in line)
    # Each round's own on/off ratio too: the machine's speed drifts over minutes, and a round's two
    # runs are adjacent in time.
    per_round = [on["tokens_per_s"] / off["tokens_per_s"] for on, off in
                 zip((r for r in runs if r["mode"] == "on"), (r for r in runs if r["mode"] == "off"))]
    report = {"model_dir": str(model_dir), "num_requests": len(prompts), "max_tokens": args.max_tokens,
              "concurrency": args.concurrency, "rounds": args.rounds, "scrape_interval_s": args.scrape_interval,
              "runs": runs, "median_tokens_per_s": med, "on_over_off": med["on"] / med["off"],
              "median_round_ratio": statistics.median(per_round),
              "evidence_on": {"scrapes": scraper.scrapes, "span_exports": sink.exports, "span_bytes": sink.bytes,
                              "request_log_lines": log_lines}}
    print(f"\nmedian tok/s: on {med['on']:.1f}, off {med['off']:.1f}; on/off = {report['on_over_off']:.3f}, "
          f"median of the rounds' on/off = {report['median_round_ratio']:.3f} "
          f"({scraper.scrapes} scrapes, {sink.exports} span exports = {sink.bytes} bytes, {log_lines} log lines)")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return report
