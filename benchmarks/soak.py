"""A soak: --concurrency streaming clients against `serve` for --duration-s, a share of them leaving
mid-stream, with every process's resident memory sampled along the way.

Starts `metroserve serve` (the default model, --max-num-seqs = --concurrency, a cluster secret from
a file so the suite can read the scheduler's status). Each client loops: a greedy streaming
completion of a chat-workload prompt, up to --max-tokens tokens; with probability --disconnect it
closes the connection after a random number of chunks (the server must abort the request and free
its blocks). Every --sample-s the resident memory (VmRSS) of serve, the scheduler, the gateway and
each worker is read from /proc. At the end the suite waits until nothing is queued or running and
every KV block is free, and reports per process the memory after --warmup-s and at the end, and
the growth between them.

    metroserve bench soak --duration-s 1800 --concurrency 32 --disconnect 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metroserve.benchmarks.batch_limit import child_pid, rss_mib
from metroserve.benchmarks.chaos import wait_cluster_idle, write_secret_file
from metroserve.benchmarks.cluster import free_port
from metroserve.benchmarks.serve_overhead import ROOT, wait_healthy


@dataclass
class SoakCounts:
    completed: int = 0
    disconnected: int = 0  # the client left mid-stream on purpose
    errors: list[str] = field(default_factory=list)


async def _one_request(session: Any, url: str, prompt: list[int], max_tokens: int, leave_after: int | None,
                       counts: SoakCounts) -> None:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                counts.errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return
            chunks = 0
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    counts.completed += 1
                    return
                if line.startswith(b"data:"):
                    if b'"error"' in line:
                        counts.errors.append(line[:200].decode(errors="replace"))
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        resp.close()  # drop the connection mid-stream
                        counts.disconnected += 1
                        return
            counts.errors.append("stream ended without [DONE]")
    except Exception as e:  # noted, not fatal: the soak goes on
        counts.errors.append(f"{type(e).__name__}: {e}")


async def _clients(args: argparse.Namespace, url: str, prompts: list[list[int]], counts: SoakCounts,
                   sample: Any) -> None:
    import aiohttp

    deadline = time.monotonic() + args.duration_s
    rng = random.Random(0)

    async def client() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            while time.monotonic() < deadline:
                leave = rng.randint(1, args.max_tokens - 1) if rng.random() < args.disconnect else None
                await _one_request(session, url, rng.choice(prompts), args.max_tokens, leave, counts)

    async def sampler() -> None:
        while time.monotonic() < deadline:
            sample()
            await asyncio.sleep(args.sample_s)  # the sampling period itself, not a wait for state

    await asyncio.gather(sampler(), *(client() for _ in range(args.concurrency)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--disconnect", type=float, default=0.2, help="share of requests the client leaves "
                                                                     "mid-stream")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sample-s", type=float, default=30.0, help="resident memory sampling period")
    parser.add_argument("--warmup-s", type=float, default=300.0, help="growth is measured from here to the end")
    parser.add_argument("--json-out", type=Path, default=None)


def _growth(samples: list[dict[str, float]], times: list[float], warmup_s: float) -> dict[str, dict[str, float]]:
    first = next(i for i, t in enumerate(times) if t >= warmup_s or i == len(times) - 1)
    return {name: {"after_warmup_mib": samples[first][name], "end_mib": samples[-1][name],
                   "growth_pct": 100 * (samples[-1][name] / samples[first][name] - 1)} for name in samples[-1]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from metroserve.benchmarks.workload import build_chat_workload
    from metroserve.common.tokenizer import load_tokenizer
    from metroserve.worker.model_files import resolve_model_dir

    prompts = build_chat_workload(load_tokenizer(resolve_model_dir(None)), num_requests=64, min_len=32, max_len=512)
    ports = [free_port() for _ in range(3)]
    samples: list[dict[str, float]] = []
    times: list[float] = []
    with tempfile.TemporaryDirectory(prefix="metroserve-soak-") as tmp:
        secret = write_secret_file(Path(tmp))
        serve = subprocess.Popen(
            [sys.executable, "-m", "metroserve.services.cli", "serve", "--served-model-name", "bench",
             "--port", str(ports[0]), "--grpc-port", str(ports[1]), "--scheduler-port", str(ports[2]),
             "--metrics-port", "0", "--max-num-seqs", str(args.concurrency), "--kv-cache-memory", "1GiB",
             "--disable-log-requests", "--cluster-secret-file", str(secret)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        counts = SoakCounts()
        try:
            wait_healthy(f"http://127.0.0.1:{ports[0]}/health", serve)
            start = time.monotonic()

            def sample() -> None:
                pids = {"serve": serve.pid, **{c: child_pid(serve.pid, c) for c in ("scheduler", "gateway",
                                                                                   "worker-0")}}
                samples.append({name: rss_mib(pid) for name, pid in pids.items()})
                times.append(time.monotonic() - start)
                print(f"t={times[-1]:6.0f}s RSS MiB {samples[-1]}; completed {counts.completed}, disconnected "
                      f"{counts.disconnected}, errors {len(counts.errors)}", flush=True)

            asyncio.run(_clients(args, f"http://127.0.0.1:{ports[0]}/v1/completions", prompts, counts, sample))
            sample()
            idle_s = wait_cluster_idle(ports[2], secret, 1)
        finally:
            serve.terminate()
            serve.wait(timeout=60)
    report = {"duration_s": args.duration_s, "concurrency": args.concurrency, "disconnect": args.disconnect,
              "max_tokens": args.max_tokens, "completed": counts.completed, "disconnected": counts.disconnected,
              "errors": counts.errors[:50], "num_errors": len(counts.errors), "idle_after_end_s": idle_s,
              "rss_growth_after_warmup": _growth(samples, times, args.warmup_s),
              "samples": [{"t_s": t, **s} for t, s in zip(times, samples)]}
    print(json.dumps({k: report[k] for k in ("completed", "disconnected", "num_errors", "idle_after_end_s",
                                             "rss_growth_after_warmup")}, indent=2))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return report
