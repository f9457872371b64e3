"""The chaos suite: one fault at a time against `serve --workers 2` with 16 greedy streams running.

Starts a throwaway redis-server, then `metroserve serve --workers 2 --kvstore redis://...` (the
default model, --heartbeat-timeout 5) and a second gateway against the same scheduler (with the
cluster secret from a file both are given). It first runs the streams undisturbed, the reference,
then, for each fault in turn, the same 16 prompts (greedy, ignore_eos, --max-tokens each; half
through each gateway), applying the fault once the first stream has --fault-after tokens:

- worker-kill: SIGKILL worker-0 (serve restarts it);
- worker-stop: SIGSTOP worker-0 past the heartbeat timeout, then SIGCONT;
- scheduler-kill: SIGKILL the scheduler (serve restarts it; streams keep flowing meanwhile);
- gateway-kill: SIGKILL serve's gateway (its 8 clients lose their streams, expected; serve
  restarts it and the second gateway's 8 must be untouched);
- redis-kill: SIGKILL the redis-server, last (the kvstore's records are gone; serving goes on).

A stream counts as identical when it ended with [DONE], no error event, and the same text as the
reference. After each fault the suite waits until no request is queued or running and every
worker's KV blocks are free (the scheduler's GetStatus), and reports how long that took, the
longest gap between two chunks of any stream, and whether every killed process came back.

    metroserve bench chaos --json-out benchmarks/results/chaos-zen4.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from metroserve.benchmarks.batch_limit import child_pid
from metroserve.benchmarks.cluster import free_port
from metroserve.benchmarks.serve_overhead import ROOT, wait_healthy

# redis-kill last: a scheduler restarted after it would have no kvstore to read its records from.
FAULTS = ("worker-kill", "worker-stop", "scheduler-kill", "gateway-kill", "redis-kill")
IDLE_TIMEOUT_S = 120.0


@dataclass
class StreamResult:
    gateway: int  # 0: serve's gateway, 1: the second one
    text: str = ""
    finished: bool = False  # [DONE] seen, no error event
    error: str | None = None
    max_gap_s: float = 0.0


@dataclass
class FaultReport:
    fault: str
    identical: int = 0  # streams that ended whole with the reference's text
    expected_losses: int = 0  # streams of a killed gateway that ended early (not counted against it)
    failed: list[str] = field(default_factory=list)
    max_gap_s: float = 0.0
    idle_after_s: float | None = None  # fault applied -> every block free, nothing queued or running
    restarted: bool | None = None  # the killed process is back (None: nothing was killed)


async def _stream(session: Any, url: str, prompt: list[int], max_tokens: int, result: StreamResult,
                  progress: list[int], index: int) -> None:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    last = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                result.max_gap_s, last = max(result.max_gap_s, now - last), now
                if line.startswith(b"data: [DONE]"):
                    result.finished = result.error is None
                    return
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    result.error = f"error event: {chunk['error']}"
                    continue
                result.text += "".join(c.get("text", "") for c in chunk["choices"])
                progress[index] += 1
    except Exception as e:  # a dropped connection is a result here, not a crash of the suite
        result.error = f"{type(e).__name__}: {e}"


def cluster_idle(scheduler_port: int, secret_file: Path, num_workers: int) -> bool:
    """The scheduler's GetStatus: nothing queued or running, num_workers workers, all blocks free."""
    import grpc

    from metroserve.rpc import cluster_pb2, cluster_pb2_grpc
    from metroserve.rpc.auth import SECRET_METADATA_KEY

    try:
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_port}") as channel:
            s = cluster_pb2_grpc.ClusterStub(channel).GetStatus(
                cluster_pb2.ClusterStatusRequest(), timeout=5,
                metadata=((SECRET_METADATA_KEY, secret_file.read_text()),))
    except grpc.RpcError:
        return False
    return (s.queue_depth == 0 and s.num_active_requests == 0 and len(s.workers) == num_workers and
            all(w.load.num_free_blocks == w.load.num_total_blocks and w.num_placed == 0 for w in s.workers))


def wait_cluster_idle(scheduler_port: int, secret_file: Path, num_workers: int) -> float | None:
    """Seconds until cluster_idle, or None past IDLE_TIMEOUT_S."""
    start = time.monotonic()
    while time.monotonic() - start < IDLE_TIMEOUT_S:
        if cluster_idle(scheduler_port, secret_file, num_workers):
            return time.monotonic() - start
        time.sleep(0.2)
    return None


def write_secret_file(directory: Path) -> Path:
    """A fresh cluster secret in a file only this user can read (serve's --cluster-secret-file)."""
    path = directory / "cluster-secret"
    path.write_text(os.urandom(24).hex())
    path.chmod(0o600)
    return path


class Chaos:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.ports = {name: free_port() for name in ("rest", "grpc", "scheduler", "metrics", "rest2", "redis")}
        self.secret_file = write_secret_file(workdir)
        self.logs = workdir
        self.redis: subprocess.Popen | None = None
        self.serve: subprocess.Popen | None = None
        self.gateway2: subprocess.Popen | None = None

    def _popen(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def start(self) -> None:
        p = self.ports
        self.redis = self._popen("redis", ["redis-server", "--port", str(p["redis"]), "--save", "",
                                           "--appendonly", "no"])
        cli = [sys.executable, "-m", "metroserve.services.cli"]
        self.serve = self._popen("serve", [
            *cli, "serve", "--workers", "2", "--served-model-name", "bench", "--port", str(p["rest"]),
            "--grpc-port", str(p["grpc"]), "--scheduler-port", str(p["scheduler"]),
            "--metrics-port", str(p["metrics"]), "--kvstore", f"redis://127.0.0.1:{p['redis']}/0",
            "--heartbeat-timeout", str(self.args.heartbeat_timeout), "--max-num-seqs", str(self.args.streams),
            "--kv-cache-memory", "512MiB", "--cluster-secret-file", str(self.secret_file)])
        wait_healthy(f"http://127.0.0.1:{p['rest']}/health", self.serve)
        self.gateway2 = self._popen("gateway2", [
            *cli, "gateway", "--scheduler", f"127.0.0.1:{p['scheduler']}", "--port", str(p["rest2"]),
            "--grpc-port", "0", "--served-model-name", "bench", "--cluster-secret-file", str(self.secret_file)])
        wait_healthy(f"http://127.0.0.1:{p['rest2']}/health", self.gateway2)

    def stop(self) -> None:
        for proc in (self.gateway2, self.serve, self.redis):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()

    def wait_idle(self) -> float | None:
        return wait_cluster_idle(self.ports["scheduler"], self.secret_file, 2)

    def wait_gateways(self) -> None:
        assert self.serve is not None and self.gateway2 is not None
        wait_healthy(f"http://127.0.0.1:{self.ports['rest']}/health", self.serve)
        wait_healthy(f"http://127.0.0.1:{self.ports['rest2']}/health", self.gateway2)

    def _pid(self, component: str) -> int:
        assert self.serve is not None and self.redis is not None
        return self.redis.pid if component == "redis" else child_pid(self.serve.pid, component)

    async def apply(self, fault: str) -> tuple[str, int] | None:
        """Apply the fault; (the component, its pid) when it killed one that serve should restart."""
        if fault == "worker-stop":
            pid = self._pid("worker-0")
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(self.args.heartbeat_timeout + 2)  # the fault itself: stopped past the timeout
            os.kill(pid, signal.SIGCONT)
            return None
        if fault == "redis-kill":  # nobody's child here: not restarted, by design
            os.kill(self._pid("redis"), signal.SIGKILL)
            return None
        component = {"worker-kill": "worker-0", "scheduler-kill": "scheduler", "gateway-kill": "gateway"}[fault]
        pid = self._pid(component)
        os.kill(pid, signal.SIGKILL)
        return component, pid

    def came_back(self, component: str, old_pid: int) -> bool:
        """serve restarted the component: a new process of that name under it."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if self._pid(component) != old_pid:
                    return True
            except RuntimeError:
                pass
            time.sleep(0.2)
        return False

    async def run_streams(self, prompts: list[list[int]], fault: str | None) -> tuple[list[StreamResult], Any]:
        import aiohttp

        urls = [f"http://127.0.0.1:{self.ports[port]}/v1/completions" for port in ("rest", "rest2")]
        results = [StreamResult(gateway=i % 2) for i in range(len(prompts))]
        progress = [0] * len(prompts)
        killed = None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            streams = [asyncio.ensure_future(_stream(session, urls[r.gateway], p, self.args.max_tokens, r, progress,
                                                     i)) for i, (p, r) in enumerate(zip(prompts, results))]
            if fault is not None:
                while max(progress) < self.args.fault_after and not all(s.done() for s in streams):
                    await asyncio.sleep(0.01)
                killed = await self.apply(fault)
            await asyncio.gather(*streams)
        return results, killed


def _report(fault: str, results: list[StreamResult], reference: list[str]) -> FaultReport:
    report = FaultReport(fault=fault, max_gap_s=max(r.max_gap_s for r in results))
    for i, (r, text) in enumerate(zip(results, reference)):
        if r.finished and r.text == text:
            report.identical += 1
        elif fault == "gateway-kill" and r.gateway == 0:
            report.expected_losses += 1
        else:
            report.failed.append(f"stream {i}: {r.error or 'text differs'}")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--fault-after", type=int, default=10, help="apply the fault once a stream has this many "
                                                                    "tokens")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="the scheduler's (serve's flag)")
    parser.add_argument("--json-out", type=Path, default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from metroserve.benchmarks.workload import build_chat_workload
    from metroserve.common.tokenizer import load_tokenizer
    from metroserve.worker.model_files import resolve_model_dir

    if shutil.which("redis-server") is None:
        raise SystemExit("bench chaos needs redis-server on PATH (the redis-kill fault and the kvstore)")
    prompts = build_chat_workload(load_tokenizer(resolve_model_dir(None)), num_requests=args.streams,
                                  min_len=32, max_len=256)
    reports: list[FaultReport] = []
    with tempfile.TemporaryDirectory(prefix="metroserve-chaos-") as tmp:
        chaos = Chaos(args, Path(tmp))
        try:
            chaos.start()
            baseline, _ = asyncio.run(chaos.run_streams(prompts, None))
            assert all(r.finished for r in baseline), [r.error for r in baseline]
            reference = [r.text for r in baseline]
            for fault in args.faults:
                start = time.monotonic()
                results, killed = asyncio.run(chaos.run_streams(prompts, fault))
                report = _report(fault, results, reference)
                if killed is not None:
                    report.restarted = chaos.came_back(*killed)
                idle = chaos.wait_idle()
                report.idle_after_s = None if idle is None else time.monotonic() - start
                chaos.wait_gateways()
                reports.append(report)
                print(f"{fault}: {report.identical}/{len(prompts)} identical, {report.expected_losses} expected "
                      f"losses, failed {report.failed}, longest gap {report.max_gap_s:.1f} s, restarted "
                      f"{report.restarted}, idle after {report.idle_after_s}", flush=True)
        except BaseException:
            print(f"logs: {tmp}", file=sys.stderr)
            for log in sorted(Path(tmp).glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
        finally:
            chaos.stop()
    report_dict = {"streams": args.streams, "max_tokens": args.max_tokens,
                   "heartbeat_timeout_s": args.heartbeat_timeout, "faults": [asdict(r) for r in reports]}
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report_dict, indent=2) + "\n")
    return report_dict
