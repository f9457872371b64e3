"""Slow clients against a running stack: are they dropped, and do the normal streams notice?

Starts `metroserve serve` (the default model, --max-num-seqs = --concurrency) and, each round, runs
the chat workload as --concurrency streaming completions alone, then again, repeated for at least
--slow-phase-s, while --connections slow clients hold connections open: half send a request line
and then trickle a header a byte per --interval-s (slowloris), half send whole headers and trickle
the body. A slow client whose connection the server closes opens a new one at once, as an
attacker would. Reports, per run, the normal streams' inter-chunk gaps (ITL p50/p99) and their
ratio, and for the slow clients: connections opened, closed by the server, how long each lived,
how many got a 408; and the gateway's resident memory.

    metroserve bench slowloris --connections 500 --concurrency 32 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metroserve.benchmarks.batch_limit import child_pid, rss_mib
from metroserve.benchmarks.serve_overhead import ROOT, wait_healthy

SLOW_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nX-Slow: "
SLOW_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
             b"Content-Length: 1000000\r\n\r\n")


@dataclass
class SlowClientStats:
    """What the slow clients saw; each client task appends to the one shared instance."""

    opened: int = 0
    closed_by_server: int = 0
    got_408: int = 0
    lifetimes_s: list[float] = field(default_factory=list)  # from before the connect to the server's close
    errors: list[str] = field(default_factory=list)  # a connect that failed (the server refused)

    def summary(self) -> dict[str, Any]:
        life = sorted(self.lifetimes_s)
        return {"opened": self.opened, "closed_by_server": self.closed_by_server, "got_408": self.got_408,
                "lifetime_s": {"min": life[0], "p50": statistics.median(life), "max": life[-1]} if life else None,
                "connect_errors": len(self.errors)}


async def _one_slow_connection(host: str, port: int, mode: str, interval_s: float, stop: asyncio.Event,
                               stats: SlowClientStats) -> bool:
    """Hold one connection, a byte per interval, until the server closes it (True) or stop is set."""
    # Timed from before the connect: the server's timer cannot start earlier, while a busy client
    # loop may resume from the connect well after the server accepted it (a lifetime too short).
    start = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    stats.opened += 1
    try:
        writer.write(SLOW_BODY if mode == "body" else SLOW_HEADERS)
        reply = b""
        while not stop.is_set():
            try:
                data = await asyncio.wait_for(reader.read(4096), interval_s)
            except TimeoutError:
                writer.write(b"a" if mode == "headers" else b" ")
                continue
            if not data:
                break
            reply += data
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        writer.close()
    if stop.is_set():
        return False
    stats.closed_by_server += 1
    stats.lifetimes_s.append(time.monotonic() - start)
    stats.got_408 += reply.startswith(b"HTTP/1.1 408")
    return True


async def slow_client(host: str, port: int, mode: str, interval_s: float, stop: asyncio.Event,
                      stats: SlowClientStats) -> None:
    """One slow client ('headers' or 'body'): a new connection each time the server drops one."""
    while not stop.is_set():
        try:
            await _one_slow_connection(host, port, mode, interval_s, stop, stats)
        except OSError as e:  # e.g. refused under a connection limit: try again a little later
            stats.errors.append(repr(e))
            await asyncio.sleep(interval_s)


async def _stream_gaps(session: Any, url: str, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """One greedy streaming completion; the gaps between its token chunks, in seconds."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    arrivals = []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                arrivals.append(time.perf_counter())
    if len(arrivals) != max_tokens:
        raise RuntimeError(f"a stream ended after {len(arrivals)} of {max_tokens} chunks")
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


async def run_workload(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                       min_seconds: float = 0.0) -> tuple[list[float], int]:
    """The prompts, `concurrency` at a time, repeated until min_seconds passed; (all gaps, runs)."""
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    gaps: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def one(prompt: list[int]) -> None:
            async with gate:
                gaps.extend(await _stream_gaps(session, url, model, prompt, max_tokens))

        start, runs = time.monotonic(), 0
        while runs == 0 or time.monotonic() - start < min_seconds:
            await asyncio.gather(*(one(p) for p in prompts))
            runs += 1
    return gaps, runs


def _itl(gaps: list[float]) -> dict[str, float]:
    ordered = sorted(gaps)
    return {"p50_ms": 1000 * statistics.median(ordered), "p99_ms": 1000 * ordered[int(0.99 * (len(ordered) - 1))]}


async def _slow_phase(args: argparse.Namespace, url: str, prompts: list[list[int]]) -> dict[str, Any]:
    stop, stats = asyncio.Event(), SlowClientStats()
    clients = [asyncio.ensure_future(slow_client("127.0.0.1", args.port, "headers" if i % 2 == 0 else "body",
                                                 args.interval_s, stop, stats))
               for i in range(args.connections)]
    deadline = time.monotonic() + 30
    while stats.opened < args.connections and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    gaps, runs = await run_workload(url, "bench", prompts, args.max_tokens, args.concurrency, args.slow_phase_s)
    stop.set()
    await asyncio.gather(*clients)
    return {"itl": _itl(gaps), "workload_runs": runs, "slow_clients": stats.summary()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connections", type=int, default=500, help="slow clients (half headers, half body)")
    parser.add_argument("--interval-s", type=float, default=1.0, help="a slow client sends one byte this often")
    parser.add_argument("--concurrency", type=int, default=32, help="normal streams; also --max-num-seqs")
    parser.add_argument("--num-requests", type=int, default=32, help="normal requests per workload run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slow-phase-s", type=float, default=40.0,
                        help="repeat the workload beside the slow clients at least this long (past the server's "
                             "--body-read-timeout, so every kind of slow connection is closed by its timeout)")
    parser.add_argument("--rounds", type=int, default=2, help="(alone, beside slow clients) pairs")
    parser.add_argument("--port", type=int, default=18700,
                        help="first of four loopback ports: REST, gRPC, scheduler, scheduler metrics")
    parser.add_argument("--json-out", type=Path, default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from metroserve.benchmarks.workload import build_chat_workload
    from metroserve.common.tokenizer import load_tokenizer
    from metroserve.worker.model_files import resolve_model_dir

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.connections + 1024)), hard))
    model_dir = resolve_model_dir(None)
    prompts = build_chat_workload(load_tokenizer(model_dir), num_requests=args.num_requests)
    port = args.port
    serve = subprocess.Popen(
        [sys.executable, "-m", "metroserve.services.cli", "serve", "--served-model-name", "bench",
         "--port", str(port), "--grpc-port", str(port + 1), "--scheduler-port", str(port + 2),
         "--metrics-port", str(port + 3), "--max-num-seqs", str(args.concurrency), "--kv-cache-memory", "1GiB",
         "--no-enable-prefix-caching", "--disable-log-requests"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1/completions"
    rounds = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", serve)
        gateway = child_pid(serve.pid, "gateway")
        asyncio.run(run_workload(url, "bench", prompts[: args.concurrency // 2], 16, args.concurrency))  # warm-up
        for index in range(args.rounds):
            alone_gaps, _ = asyncio.run(run_workload(url, "bench", prompts, args.max_tokens, args.concurrency))
            rss_before = rss_mib(gateway)
            beside = asyncio.run(_slow_phase(args, url, prompts))
            record = {"alone": {"itl": _itl(alone_gaps)}, "beside_slow_clients": beside,
                      "gateway_rss_mib": {"before": rss_before, "after": rss_mib(gateway)}}
            record["itl_p50_ratio"] = beside["itl"]["p50_ms"] / record["alone"]["itl"]["p50_ms"]
            rounds.append(record)
            print(f"round {index}: ITL p50 alone {record['alone']['itl']['p50_ms']:.1f} ms, beside "
                  f"{args.connections} slow clients {beside['itl']['p50_ms']:.1f} ms "
                  f"(x{record['itl_p50_ratio']:.2f}); slow clients {beside['slow_clients']}", flush=True)
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    report = {"connections": args.connections, "interval_s": args.interval_s, "concurrency": args.concurrency,
              "num_requests": args.num_requests, "max_tokens": args.max_tokens, "slow_phase_s": args.slow_phase_s,
              "rounds": rounds}
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return report
