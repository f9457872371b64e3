"""A completions request with a huge prompt list against a running stack: how fast it is refused,
whether the scheduler heard of it, and whether the gateway's memory comes back.

Starts `metroserve serve` (the default model, one worker, prefix caching off), sends --num-prompts
short prompts in one body --rounds times, and reports each refusal's status and latency, the
scheduler's placement and rejection counters before and after, and the gateway's resident memory
before, after each round and --settle-s seconds after the last.

    metroserve bench batch-limit --num-prompts 100000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from metroserve.benchmarks.serve_overhead import ROOT, wait_healthy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--port", type=int, default=18600, 
                        help="first of four loopback ports: REST, gRPC, scheduler, scheduler metrics")
    parser.add_argument("--settle-s", type=float, default=5.0, help="wait before the last memory reading")
    parser.add_argument("--json-out", type=Path, default=None)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def child_pid(parent: int, component: str) -> int:
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            cmdline = (status.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields.get("PPid", "0")) == parent and component.encode() in cmdline:
            return int(status.parent.name)
    raise RuntimeError(f"no {component} process under pid {parent}")


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _counters(metrics_url: str) -> dict[str, float]:
    """The scheduler's placements and admission refusals, summed over workers and codes: together,
    every admission attempt that got an answer."""
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    totals = {"placements": 0.0, "rejections": 0.0}
    for family in text_string_to_metric_families(text):
        for name in totals:
            if family.name.endswith(f"scheduler_{name}"):
                totals[name] += sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return totals


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = args.port
    serve = subprocess.Popen(
        [sys.executable, "-m", "metroserve.services.cli", "serve", "--served-model-name", "bench",
         "--port", str(port), "--grpc-port", str(port + 1), "--scheduler-port", str(port + 2),
         "--metrics-port", str(port + 3), "--kv-cache-memory", "256MiB", "--no-enable-prefix-caching"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = json.dumps({"model": "bench", "prompt": ["Hello there"] * args.num_prompts, "max_tokens": 4}).encode()
    rounds: list[dict[str, Any]] = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", serve)
        gateway = child_pid(serve.pid, "gateway")
        status, _ = _post(f"http://127.0.0.1:{port}/v1/completions",
                          json.dumps({"model": "bench", "prompt": "warm up", "max_tokens": 4}).encode())
        assert status == 200, status
        metrics_url = f"http://127.0.0.1:{port + 3}/metrics"
        counters_before, rss_before = _counters(metrics_url), rss_mib(gateway)
        for index in range(args.rounds):
            start = time.perf_counter()
            status, reply = _post(f"http://127.0.0.1:{port}/v1/completions", body)
            seconds = time.perf_counter() - start
            rounds.append({"status": status, "seconds": seconds, "error": reply.get("error"),
                           "gateway_rss_mib": rss_mib(gateway)})
            param = reply.get("error", {}).get("param")
            print(f"round {index}: HTTP {status} in {seconds * 1000:.0f} ms (param {param!r}), "
                  f"gateway RSS {rounds[-1]['gateway_rss_mib']:.0f} MiB", flush=True)
        time.sleep(args.settle_s)
        report = {"num_prompts": args.num_prompts, "body_bytes": len(body), "rounds": rounds,
                  "gateway_rss_mib": {"before": rss_before, "settled": rss_mib(gateway)},
                  "scheduler_counters": {"before": counters_before, "after": _counters(metrics_url)}}
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    print(json.dumps({k: report[k] for k in ("gateway_rss_mib", "scheduler_counters")}, indent=2))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return report
