"""A real `metroserve serve` stack (separate processes on loopback) for service tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

# Picks ports outside the range the OS hands to `--port 0` listeners (the workers' token streams).
from metroserve.benchmarks.cluster import free_port as free_port

ROOT = Path(__file__).resolve().parents[1]


def cluster_metadata() -> tuple[tuple[str, str], ...]:
    """What a test's own call to an internal service sends to authenticate (the secret conftest set)."""
    from metroserve.rpc.auth import ENV_SECRET, SECRET_METADATA_KEY

    return ((SECRET_METADATA_KEY, os.environ[ENV_SECRET]),)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll until predicate() is truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def scrape_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Sample name + sorted labels -> value (model_name dropped: it is the same everywhere)."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def metric_value(samples: dict, name: str, **labels) -> float:
    return samples.get(("metroserve:" + name, tuple(sorted(labels.items()))), 0.0)


def stream_completions(base_url: str, model: str, prompts: list[str], max_tokens: int, on_progress=None,
                       started_at: int = 5, extra_body: dict | None = None) -> list[tuple[str, str | None, int]]:
    """Stream every prompt at once through the OpenAI client (greedy, ignore_eos); returns each
    one's (text, finish reason, completion tokens). Once the first stream has `started_at` chunks,
    `await on_progress(progress)` runs (progress: prompt index -> chunks so far), e.g. to kill a
    process mid-run, while the other streams go on as tasks of the same loop. The first stream, not
    every one: the client reads the streams unevenly, and waiting for the slowest let a fast worker
    finish all of its sequences before the hook ran. It runs inside that stream's task, at that
    chunk: a watcher task polling `progress` woke late, since a stream task reads every chunk already
    buffered without yielding (seen: 86 chunks read before the watcher ran, and in CI a kill that
    landed after the victim had finished). extra_body: more request fields."""
    import asyncio
    from collections import Counter

    import openai

    progress: Counter[int] = Counter()
    hook_ran = False

    async def one(client, i: int):
        nonlocal hook_ran
        stream = await client.completions.create(model=model, prompt=prompts[i], max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True, **(extra_body or {})},
                                                 stream_options={"include_usage": True})
        text, finish, tokens = [], None, 0
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                progress[i] += 1
                if on_progress is not None and not hook_ran and progress[i] >= started_at:
                    hook_ran = True
                    await on_progress(progress)
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return "".join(text), finish, tokens

    async def run():
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        results = await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
        assert on_progress is None or hook_ran, f"no stream reached {started_at} chunks"
        return results

    return asyncio.run(run())


class ServeStack:
    def __init__(self, model: Path | str, workers: int = 1, extra_args: Sequence[str] = (),
                 log_path: Path | None = None, env: dict | None = None):
        self.num_workers = workers
        self.port, self.grpc_port, self.scheduler_port = free_port(), free_port(), free_port()
        self.metrics_port = free_port(1 + workers)  # the scheduler's; worker i's is this + 1 + i
        self.args = [sys.executable, "-m", "metroserve.services.cli", "serve", "--model", str(model),
                     "--workers", str(workers), "--port", str(self.port), "--grpc-port", str(self.grpc_port),
                     "--scheduler-port", str(self.scheduler_port), "--metrics-port", str(self.metrics_port),
                     "--kv-cache-memory", "256MiB", *extra_args]
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def scheduler_address(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    def start(self, timeout_s: float = 300) -> ServeStack:
        with open(self.log_path or os.devnull, "wb") as log:  # the stack writes through its own descriptor
            proc = self.proc = subprocess.Popen(self.args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                env=self.env)
        wait_for(lambda: proc.poll() is not None or self.healthy(), timeout_s, "the stack to become ready", 0.3)
        assert proc.poll() is None, f"serve exited with {proc.returncode}; log: {self.log_tail()}"
        # /health is up once one worker serves; tests of placement need every worker registered.
        wait_for(lambda: len(self.cluster_status().workers) == self.num_workers, timeout_s,
                 f"all {self.num_workers} workers to register", 0.2)
        return self

    def child_pids(self, component: str) -> list[int]:
        """Pids of serve's live children running `metroserve <component>` ("scheduler", "gateway", "worker")."""
        assert self.proc is not None
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"metroserve.services.cli" in argv and component.encode() in argv:
                pids.append(int(entry.name))
        return pids

    def metrics_url(self, component: str) -> str:
        """/metrics of "gateway", "scheduler" or "worker-<i>"."""
        if component == "gateway":
            return f"http://127.0.0.1:{self.port}/metrics"
        if component == "scheduler":
            return f"http://127.0.0.1:{self.metrics_port}/metrics"
        return f"http://127.0.0.1:{self.metrics_port + 1 + int(component.rsplit('-', 1)[1])}/metrics"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def cluster_status(self):
        from metroserve.rpc import cluster_pb2, cluster_pb2_grpc

        with grpc.insecure_channel(self.scheduler_address) as channel:
            return cluster_pb2_grpc.ClusterStub(channel).GetStatus(cluster_pb2.ClusterStatusRequest(), timeout=5,
                                                                   metadata=cluster_metadata())

    def wait_idle(self, timeout_s: float = 30):
        """Until no request is queued or active and every worker reports all its KV blocks free."""
        def idle():
            s = self.cluster_status()
            ok = s.queue_depth == 0 and s.num_active_requests == 0 and s.workers and all(
                w.load.num_free_blocks == w.load.num_total_blocks and w.num_placed == 0 for w in s.workers)
            return s if ok else None
        return wait_for(idle, timeout_s, "every worker's blocks to be free and the queue empty", 0.2)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path and self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServeStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
