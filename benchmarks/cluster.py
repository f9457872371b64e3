"""What the cluster's control and token paths cost: `metroserve bench cluster` (scheduler off the token path).

Cluster mode starts a scheduler, G gateways and W mock workers (`metroserve worker --engine mock`:
the model is a sleep, so the CPU measured is the service's, not a model's) as separate processes on
loopback, waits until every worker is registered and every gateway is healthy and subscribed to
every worker's token stream, then drives C concurrent streaming clients through the gateways'
REST API (/v1/completions, stream=true, ignore_eos, max_tokens fixed, requests round-robin over the
gateways). The client is its own process, so its CPU is measured too. The cluster grows across
the sweep: one scheduler; workers are added as W grows; all gateways start up front and a run
sends to (and counts) only its first G. Every prompt of the sweep is unique (its first two token
ids number the request), so no run finds prefix-cache hits an earlier one left: those would pack
requests onto the workers holding them.

Each run is closed-loop: the C client streams start spread over one request's duration, warm up,
then a measured window of --duration seconds, then the streams finish their last requests. Over
the window it reports tokens/s and requests/s delivered to the client (a token counts when its SSE
event arrives); CPU seconds per 1,000 tokens and per request of each process kind (scheduler,
gateways summed, workers summed, client), the on-CPU time of all their threads (/proc, to the
nanosecond: 10 ms ticks are too coarse for the scheduler's share of a window); "other cores"
(what else kept this machine's cores busy, from /proc/stat: the comparison is fair only near 0);
how long each kind's threads were runnable but waited for a core (CPU starvation, same source);
the scheduler's placement latency (the request log's queue_s: admission to first assignment,
wall time inside the scheduler, so it includes waiting for a free slot when every worker is full
and any preemption of the scheduler by the other processes); TTFT and ITL at the client; and how
many sequences the scheduler had on each worker at the window's end.

CPU per token depends on the load: a process woken for every step pays a wakeup each time (on
this project's 2-core VM, an event loop waking every 50 ms spent ~100 us of CPU per wakeup, against
~2 us back to back), so light loads over many workers cost more per token than busy ones.

"Added over the mock's own step time": each mock step sleeps step = --mock-step-fixed-ms
(+ per prompt token and per decoding sequence, both 0 by default, so a step is exactly the fixed
part). Between two tokens of a sequence the worker runs exactly one step, so ITL minus one step is
what the worker's loop, the token stream, the gateway and the client's socket add. The first token
needs one step (with the prompt) after the request reaches its worker, and the request also waits
for the step under way there to end: TTFT minus one step is the service path (REST, admission,
placement, assignment, the token stream) plus that wait, between 0 and one step. In this closed
loop a request is sent just after its predecessor's last token and goes to the worker that just
freed the slot, which has begun its next step if other sequences run there: the wait is then
nearly a whole step (with one sequence per worker, about none).

Placement mode drives the scheduler's core in this process, without gRPC: SchedulerCore with
--placement-workers fake workers and a prefix index of --index-blocks blocks (random ones spread
over the workers, plus real shared prefixes that part of the requests start with). Each request is
a GatewayMessage with one submission; the time of gateway_message (admission, block hashing,
dispatch, placement) is its placement latency; finishes (with the worker's block events: the
prompt's blocks stored, as many old ones evicted, so the index keeps its size) are timed apart.
Admissions/s on one core = requests / time in admission and placement; the lifecycle rate adds
the finishes.

    metroserve bench cluster                                   # the default sweep, then placement
    metroserve bench cluster --workers 8,32,64 --gateways 1,2 --output benchmarks/results/cluster/cluster.json
    metroserve bench cluster --mode placement --placement-workers 64 --index-blocks 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from metroserve.benchmarks.cpu_quota import CpuQuota, CpuQuotaError

# The scheduler's CPU per 1,000 tokens when it relayed every token (issue 16), and the factor the
# change must beat.
BEFORE_SCHEDULER_CPU_S_PER_1K = 0.117
TARGET_FACTOR = 50
PLACEMENT_P99_TARGET_MS = 1.0
ADMISSIONS_TARGET_PER_S = 2000
SERVED_MODEL = "mock"
MAX_ERRORS_KEPT = 5
_DONE = b"data: [DONE]\n\n"
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "tired", "cats",
          "watch", "from", "under", "an", "old", "wooden", "table", "near", "open", "kitchen", "window")


def log(message: str) -> None:
    print(f"[bench cluster] {message}", file=sys.stderr, flush=True)


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return sorted(set(values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=("both", "cluster", "placement"), default="both",
                        help="cluster: the process sweep; placement: the in-process scheduler core; both (default)")
    cluster = parser.add_argument_group("cluster mode")
    cluster.add_argument("--workers", type=_int_list, default=[8, 32, 64],
                         help="mock workers, a comma list to sweep (default: 8,32,64)")
    cluster.add_argument("--gateways", type=_int_list, default=[1, 2],
                         help="gateways, a comma list to sweep (default: 1,2)")
    cluster.add_argument("--concurrency", type=int, default=64, help="client streams (default: 64)")
    cluster.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    cluster.add_argument("--prompt-len", type=int, default=128,
                         help="prompt length: token ids, or about as many words of text (default: 128)")
    cluster.add_argument("--prompt-kind", choices=("tokens", "text"), default="tokens",
                         help="token-id prompts, or text the gateways tokenize (default: tokens)")
    cluster.add_argument("--duration", type=float, default=8.0, help="measured seconds per run (default: 8)")
    cluster.add_argument("--warmup", type=float, default=None,
                         help="seconds before the window (default: one request's duration + 1 s, so every "
                              "stream is running)")
    cluster.add_argument("--model", default=None,
                         help="the gateways' tokenizer: model dir or .gguf (default: metroserve's default model); "
                              "the mock's vocabulary is set to match it")
    cluster.add_argument("--mock-step-fixed-ms", type=float, default=50.0,
                         help="each mock step sleeps this long (default: 50 ms): long enough that 64 mock workers "
                              "on 2 cores are not CPU-bound by their own bookkeeping, so the CPU measured is the "
                              "service path's; throughput is then concurrency / step at most")
    cluster.add_argument("--mock-prefill-token-us", type=float, default=0.0,
                         help="mock step time per prompt token (default: 0)")
    cluster.add_argument("--mock-decode-seq-us", type=float, default=0.0,
                         help="mock step time per decoding sequence (default: 0)")
    cluster.add_argument("--mock-num-blocks", type=int, default=8192, help="KV blocks per mock worker (default: 8192)")
    cluster.add_argument("--startup-timeout", type=float, default=300.0,
                         help="seconds for the cluster to be ready (default: 300)")
    cluster.add_argument("--gateway-cpus", type=float, default=None,
                         help="cap each gateway at this many cores (a cgroup CPU quota; needs root): makes the "
                              "gateways the bottleneck, so G=2 / G=1 measures what a second gateway adds on a "
                              "machine with too few cores to give each its own (default: no cap)")
    cluster.add_argument("--log-dir", type=Path, default=None,
                         help="keep the services' logs here (default: a temporary folder, removed)")
    placement = parser.add_argument_group("placement mode")
    placement.add_argument("--placement-workers", type=int, default=64, help="fake workers (default: 64)")
    placement.add_argument("--index-blocks", type=int, default=1_000_000,
                           help="blocks in the prefix index (default: 1000000)")
    placement.add_argument("--placement-requests", type=int, default=10_000, help="requests timed (default: 10000)")
    placement.add_argument("--placement-prompt-len", type=int, default=512, help="prompt tokens (default: 512)")
    placement.add_argument("--placement-inflight", type=int, default=1024,
                           help="requests running at once; the oldest finishes as each new one is placed "
                                "(default: 1024)")
    placement.add_argument("--shared-fraction", type=float, default=0.5,
                           help="share of requests that start with an indexed shared prefix (default: 0.5)")
    out = parser.add_argument_group("report")
    out.add_argument("--output", type=Path, default=None, help="write the JSON report here")
    out.add_argument("--plot", type=Path, default=None,
                     help="write the PNG here (default: --output with .png; needs matplotlib)")


# -- the client: its own process --------------------------------------------------------------


@dataclass
class ClientPlan:
    """What the client process sends. Times in seconds."""

    urls: list[str]  # each gateway's /v1/completions
    concurrency: int
    warmup_s: float
    duration_s: float
    ramp_s: float  # stream j starts at j * ramp_s / concurrency, so requests do not end in waves
    max_tokens: int
    prompt_len: int
    prompt_kind: str
    vocab_size: int
    first_request: int = 0  # request numbers (hence prompts) start here: unique across the runs of a cluster
    request_timeout_s: float = 600.0


@dataclass
class ClientTally:
    """The client's counts: sent/completed/failed over the whole run, the rest over the window."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    window_tokens: int = 0
    window_completed: int = 0
    ttft_s: list[float] = field(default_factory=list)  # of requests whose first token came in the window
    itl_s: list[float] = field(default_factory=list)  # gaps ending in the window; 0 for events read together
    errors: list[str] = field(default_factory=list)

    def fail(self, error: str) -> None:
        self.failed += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(error)


def request_bodies(plan: ClientPlan, seed: int = 0):
    """Request i's JSON body, made from a fixed template: its first two prompt items differ per
    request (no prefix-cache hits: block hashes are chained), the rest is shared."""
    head = json.dumps({"model": SERVED_MODEL, "max_tokens": plan.max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True})[:-1].encode() + b', "prompt": '
    rng = random.Random(seed)
    v = plan.vocab_size
    if plan.prompt_kind == "tokens":
        rest = ",".join(str(rng.randrange(v)) for _ in range(max(plan.prompt_len - 2, 0)))
        return lambda i: head + f"[{i % v},{i // v % v}{',' if rest else ''}{rest}]}}".encode()
    text = " ".join(rng.choice(_WORDS) for _ in range(max(plan.prompt_len - 2, 0)))
    return lambda i: head + f'"{i % v} {i // v % v} {text}"}}'.encode()


class SseTokenCounter:
    """Counts the token events of one /v1/completions SSE stream from raw reads, wherever the reads
    split it: every event but the final [DONE] carries one token (a mock step makes one per
    sequence; without include_usage there is no usage event). Cheaper than parsing each event."""

    def __init__(self) -> None:
        self._last = b""  # the previous read's last byte: half of a split "\n\n"?
        self._tail = b""  # the stream's last bytes: has it ended with [DONE]?

    def feed(self, buf: bytes) -> int:
        """Token events whose end is in this read."""
        if not buf:
            return 0
        events = buf.count(b"\n\n") + (self._last == b"\n" and buf[:1] == b"\n")
        self._last, self._tail = buf[-1:], (self._tail + buf)[-len(_DONE):]
        return events - int(self.done)

    @property
    def done(self) -> bool:
        return self._tail == _DONE


async def _one(session, url: str, body: bytes, plan: ClientPlan, tally: ClientTally,
               window: tuple[float, float]) -> None:
    """One streamed request; its tokens and latencies count in the tally where they fall in the window."""
    start = time.perf_counter()
    tally.sent += 1
    w0, w1 = window
    counter = SseTokenCounter()
    tokens, first, last = 0, None, start
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                tally.fail(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return
            async for buf in resp.content.iter_any():
                now = time.perf_counter()
                events = counter.feed(buf)
                if b'data: {"error"' in buf:
                    tally.fail(f"error event: {buf.decode(errors='replace')[:200]}")
                    return
                if events <= 0:
                    continue
                tokens += events
                if w0 <= now < w1:
                    tally.window_tokens += events
                    if first is None:
                        tally.ttft_s.append(now - start)
                    else:
                        tally.itl_s.append(now - last)
                    tally.itl_s.extend([0.0] * (events - 1))  # read together: no gap between them
                first = first or now
                last = now
        if not counter.done or tokens != plan.max_tokens:
            ending = "" if counter.done else ", no [DONE]"
            tally.fail(f"stream ended with {tokens} tokens of {plan.max_tokens}{ending}")
            return
        tally.completed += 1
        if w0 <= time.perf_counter() < w1:
            tally.window_completed += 1
    except Exception as e:  # a failed request is counted, never fatal
        tally.fail(f"{type(e).__name__}: {e}")


async def _drive(plan: ClientPlan, conn: Connection) -> ClientTally:
    import aiohttp

    tally = ClientTally()
    make_body = request_bodies(plan)
    counter = itertools.count(plan.first_request)
    start = time.perf_counter()
    window = (start + plan.warmup_s, start + plan.warmup_s + plan.duration_s)

    async def stream(j: int) -> None:
        await asyncio.sleep(j * plan.ramp_s / plan.concurrency)
        while time.perf_counter() < window[1]:
            i = next(counter)
            await _one(session, plan.urls[i % len(plan.urls)], make_body(i), plan, tally, window)

    async def mark(at: float, what: str) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        conn.send(what)  # the parent reads every process's CPU time now

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=plan.request_timeout_s)) as session:
        marks = [asyncio.ensure_future(mark(window[0], "start")), asyncio.ensure_future(mark(window[1], "end"))]
        await asyncio.gather(*(stream(j) for j in range(plan.concurrency)))
        await asyncio.gather(*marks)
    return tally


def client_main(plan: ClientPlan, conn: Connection) -> None:
    """The client process: sends "start" and "end" at the window's edges, then its ClientTally as a dict."""
    import uvloop

    tally = uvloop.run(_drive(plan, conn))
    conn.send(asdict(tally))
    conn.close()


# -- the cluster: processes on loopback ------------------------------------------------------


# Ports this process has handed out: a port is free only until its owner binds it, so two picks in a
# row (a stack's REST, gRPC and scheduler ports) could otherwise return the same one.
_handed_out: set[int] = set()


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive loopback ports, free now, for processes to bind soon, none of
    them handed out before by this process. Picked below the kernel's ephemeral range, from which it
    hands out the ports of `--port 0` listeners (the workers' token streams): a port picked there
    could be taken by one of them before its owner binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        base = random.randrange(max(1024, low - 12000), low - count + 1)
        run = range(base, base + count)
        if _handed_out.intersection(run) or not all(_bindable(port) for port in run):
            continue
        _handed_out.update(run)
        return base


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(on-CPU seconds, seconds runnable but waiting for a core) of one process, every live thread
    (children not), from /proc/<pid>/task/*/schedstat: exact to the nanosecond, where
    /proc/<pid>/stat's utime + stime count 10 ms ticks (too coarse for a scheduler that is busy for
    a few hundred ms of a window). A thread that exited is not counted."""
    on_cpu = waiting = 0
    for task in os.scandir(f"/proc/{pid}/task"):
        try:
            with open(f"{task.path}/schedstat") as f:
                fields = f.read().split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        on_cpu += int(fields[0])
        waiting += int(fields[1])
    return on_cpu / 1e9, waiting / 1e9


def established_remote_ports(pid: int) -> set[int]:
    """Remote ports of the process's established TCP connections (its socket inodes in /proc/net/tcp*)."""
    inodes = set()
    for fd in os.scandir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(fd.path)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)  # the header
            for line in f:
                fields = line.split()  # sl, local, remote, state (01: ESTABLISHED), ..., inode (10th)
                if fields[3] == "01" and fields[9] in inodes:
                    ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


def busy_core_seconds() -> float:
    """CPU seconds all cores of this machine spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class Cluster:
    """A scheduler, gateways and mock workers, each `metroserve <component>` in its own process,
    authenticated with a fresh cluster secret passed in their environment. Not thread-safe."""

    def __init__(self, model_dir: Path, vocab_size: int, args: argparse.Namespace, log_dir: Path,
                 gateway_cpus: float | None = None):
        from metroserve.rpc.auth import ENV_SECRET, generate_secret

        self.model_dir, self.vocab_size, self.args, self.log_dir = model_dir, vocab_size, args, log_dir
        self.secret = generate_secret()
        # Tracing off whatever this shell's OTEL settings say: its cost is not what is measured.
        self.env = {**os.environ, ENV_SECRET: self.secret, "OTEL_SDK_DISABLED": "true"}
        self.scheduler_address = f"127.0.0.1:{free_port()}"
        self.scheduler: subprocess.Popen | None = None
        self.gateways: list[tuple[subprocess.Popen, int]] = []  # (process, REST port)
        self.workers: list[subprocess.Popen] = []
        # Requests sent so far: a later run's prompts must not hit the prefix caches an earlier one filled.
        self.requests_sent = 0
        self.scheduler_starts = 0
        self.gateway_cpus = gateway_cpus  # each gateway's CPU cap in cores (a cgroup quota); None: no cap
        self.gateway_quotas: list[CpuQuota] = []

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        from metroserve.services.serve import die_with_parent

        with open(self.log_dir / f"{name}.log", "wb") as out:  # the child writes through its own descriptor
            return subprocess.Popen([sys.executable, "-m", "metroserve.services.cli", *argv], stdout=out,
                                    stderr=subprocess.STDOUT, env=self.env, preexec_fn=die_with_parent)

    @property
    def scheduler_log(self) -> Path:
        return self.log_dir / "scheduler.log"

    def start(self, num_gateways: int) -> None:
        self.restart_scheduler()
        for i in range(num_gateways):
            port = free_port()
            proc = self._spawn(f"gateway-{i}", [
                "gateway", "--scheduler", self.scheduler_address, "--port", str(port), "--grpc-port", "0",
                "--model", str(self.model_dir), "--served-model-name", SERVED_MODEL])
            self.gateways.append((proc, port))
            if self.gateway_cpus:
                self.gateway_quotas.append(CpuQuota(f"metroserve-bench-{os.getpid()}-gateway-{i}", self.gateway_cpus))
                self.gateway_quotas[-1].add(proc.pid)

    def restart_scheduler(self) -> None:
        """Start the scheduler (again, after it died: on the same port, as `serve` would)."""
        name = "scheduler" if not self.scheduler_starts else f"scheduler-{self.scheduler_starts}"
        self.scheduler_starts += 1
        self.scheduler = self._spawn(name, ["scheduler", "--port", self.scheduler_address.split(":")[1]])

    def grow(self, num_workers: int) -> None:
        a = self.args
        for i in range(len(self.workers), num_workers):
            self.workers.append(self._spawn(f"worker-{i}", [
                "worker", "--engine", "mock", "--scheduler", self.scheduler_address, "--worker-id", f"bench-w{i}",
                "--served-model-name", SERVED_MODEL, "--mock-vocab-size", str(self.vocab_size),
                "--mock-num-blocks", str(a.mock_num_blocks), "--mock-step-fixed-ms", str(a.mock_step_fixed_ms),
                "--mock-prefill-token-us", str(a.mock_prefill_token_us),
                "--mock-decode-seq-us", str(a.mock_decode_seq_us)]))

    def status(self):
        """The scheduler's Cluster.GetStatus."""
        import grpc

        from metroserve.rpc import cluster_pb2, cluster_pb2_grpc
        from metroserve.rpc.auth import SECRET_METADATA_KEY

        with grpc.insecure_channel(self.scheduler_address) as channel:
            return cluster_pb2_grpc.ClusterStub(channel).GetStatus(
                cluster_pb2.ClusterStatusRequest(), metadata=((SECRET_METADATA_KEY, self.secret),), timeout=5)

    def _check_alive(self) -> None:
        procs = [("scheduler", self.scheduler)] + [(f"gateway-{i}", p) for i, (p, _) in enumerate(self.gateways)] + \
                [(f"worker-{i}", p) for i, p in enumerate(self.workers)]
        for name, proc in procs:
            if proc is not None and proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}; its log ends:\n{tail}")

    def _healthy(self, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _ready(self) -> bool:
        import grpc

        try:
            status = self.status()
        except grpc.RpcError:
            return False
        expected = {f"bench-w{i}" for i in range(len(self.workers))}
        if {w.worker_id for w in status.workers} != expected:
            return False
        token_ports = {int(w.address.rsplit(":", 1)[1]) for w in status.workers}
        for proc, port in self.gateways:
            if not self._healthy(port):
                return False
            # Subscribed to every worker's token stream: an open connection to each token port.
            if not token_ports <= established_remote_ports(proc.pid):
                return False
        return True

    def wait_ready(self, timeout_s: float) -> float:
        """Until every worker is registered and every gateway is healthy and subscribed to each;
        returns the seconds it took."""
        start = time.monotonic()
        while not self._ready():
            self._check_alive()
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"the cluster was not ready after {timeout_s:g} s (logs: {self.log_dir})")
            time.sleep(0.2)
        return time.monotonic() - start

    def stop(self) -> None:
        """Gateways, then workers, then the scheduler: SIGTERM, then SIGKILL after 30 s."""
        from metroserve.services.serve import stop_in_order

        stop_in_order([[p for p, _ in self.gateways], list(self.workers), [self.scheduler]], timeout_s=30)
        for quota in self.gateway_quotas:
            quota.remove()


# -- one run ----------------------------------------------------------------------------------


@dataclass
class Snapshot:
    at: float
    cpu: dict[int, tuple[float, float]]  # pid -> cpu_seconds()
    busy: float
    log_offset: int


def _snapshot(pids: list[int], scheduler_log: Path) -> Snapshot:
    return Snapshot(time.perf_counter(), {pid: cpu_seconds(pid) for pid in pids}, busy_core_seconds(),
                    scheduler_log.stat().st_size)


def _percentiles_ms(seconds: list[float], minus_s: float = 0.0) -> dict[str, float | None]:
    if not seconds:
        return {"p50": None, "p99": None, "mean": None}
    ms = (np.asarray(seconds) - minus_s) * 1e3
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "mean": float(ms.mean())}


def placement_latencies(scheduler_log: Path, start: int, end: int) -> list[float]:
    """queue_s (admission to first placement, seconds) of the request log lines written between two offsets."""
    with open(scheduler_log, "rb") as f:
        f.seek(start)
        text = f.read(end - start).decode(errors="replace")
    marker = "metroserve.requests: "
    values = []
    for line in text.splitlines():
        at = line.find(marker)
        if at < 0:
            continue
        try:
            queue_s = json.loads(line[at + len(marker):]).get("queue_s")
        except ValueError:  # a line cut by the window's edge
            continue
        if queue_s is not None:
            values.append(queue_s)
    return values


def mock_step_s(args: argparse.Namespace, workers: int) -> tuple[float, float]:
    """(a decode step, the first token's step) of the mock, in seconds, with the client's streams
    spread evenly over the busy workers."""
    per_worker = args.concurrency / min(args.concurrency, workers)
    decode = args.mock_step_fixed_ms / 1e3 + args.mock_decode_seq_us / 1e6 * per_worker
    first = decode + args.mock_prefill_token_us / 1e6 * args.prompt_len
    return decode, first


def measure_run(cluster: Cluster, args: argparse.Namespace, workers: int, gateways: int) -> dict[str, Any]:
    """One closed-loop run over the first `gateways` gateways; the CPU of every process over the window."""
    itl_step, ttft_step = mock_step_s(args, workers)
    request_s = ttft_step + args.max_tokens * itl_step
    warmup = args.warmup if args.warmup is not None else request_s + 1.0
    plan = ClientPlan(urls=[f"http://127.0.0.1:{port}/v1/completions" for _, port in cluster.gateways[:gateways]],
                      concurrency=args.concurrency, warmup_s=warmup, duration_s=args.duration, ramp_s=request_s,
                      max_tokens=args.max_tokens, prompt_len=args.prompt_len, prompt_kind=args.prompt_kind,
                      vocab_size=cluster.vocab_size, first_request=cluster.requests_sent)
    assert cluster.scheduler is not None, "start() first"
    kinds: dict[str, list[int]] = {"scheduler": [cluster.scheduler.pid],
                                   "gateways": [p.pid for p, _ in cluster.gateways[:gateways]],
                                   "workers": [p.pid for p in cluster.workers[:workers]]}
    hits_before = cluster.status().placement_prefix_hit_tokens
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    client = ctx.Process(target=client_main, args=(plan, child), daemon=True)
    client.start()
    child.close()
    assert client.pid is not None, "started"
    kinds["client"] = [client.pid]
    pids = [pid for group in kinds.values() for pid in group]
    timeout = warmup + args.duration + 2 * request_s + 120

    def receive() -> Any:
        if not parent.poll(timeout):
            raise RuntimeError("the client process sent nothing in time")
        return parent.recv()

    try:
        if receive() != "start":
            raise RuntimeError("the client process did not start its window")
        before = _snapshot(pids, cluster.scheduler_log)
        if receive() != "end":
            raise RuntimeError("the client process did not end its window")
        after = _snapshot(pids, cluster.scheduler_log)
        status = cluster.status()  # after the snapshot: not in the scheduler's CPU
        tally = ClientTally(**receive())
        cluster.requests_sent += tally.sent
    finally:
        client.join(timeout=30)
        if client.is_alive():
            client.kill()
    window = after.at - before.at
    tokens, requests = tally.window_tokens, tally.window_completed
    cpu = {kind: sum(after.cpu[pid][0] - before.cpu[pid][0] for pid in group) for kind, group in kinds.items()}
    waiting = {kind: sum(after.cpu[pid][1] - before.cpu[pid][1] for pid in group) for kind, group in kinds.items()}
    ours = sum(cpu.values())
    queue_s = placement_latencies(cluster.scheduler_log, before.log_offset, after.log_offset)
    return {
        "workers": workers, "gateways": gateways, "concurrency": args.concurrency, "window_s": window,
        "warmup_s": warmup, "tokens": tokens, "requests": requests,
        "tokens_per_s": tokens / window, "requests_per_s": requests / window,
        "ideal_tokens_per_s": args.concurrency / itl_step,
        "sent": tally.sent, "completed": tally.completed, "failed": tally.failed, "errors": tally.errors,
        "cpu_s": cpu,
        "cpu_s_per_1k_tokens": {k: v / tokens * 1000 if tokens else None for k, v in cpu.items()},
        "cpu_ms_per_request": {k: v / requests * 1000 if requests else None for k, v in cpu.items()},
        "cores": {k: v / window for k, v in cpu.items()},
        # With --gateway-cpus: the gateways' cores over their caps' sum (near 1: the gateways were the bottleneck).
        "gateway_cap_use": (cpu["gateways"] / window / (gateways * cluster.gateway_cpus)
                            if cluster.gateway_cpus else None),
        # Seconds per second the kind's threads were runnable but had no core (summed): CPU starvation.
        "runqueue_wait": {k: v / window for k, v in waiting.items()},
        "other_cores": (after.busy - before.busy - ours) / window,
        # Sequences the scheduler had on each worker at the window's end, most first: how evenly it spread them.
        "placed_per_worker_at_end": sorted((w.num_placed for w in status.workers), reverse=True),
        "prefix_hit_tokens": status.placement_prefix_hit_tokens - hits_before,  # expected 0: prompts are unique
        "placement_ms": {**_percentiles_ms(queue_s), "count": len(queue_s)},
        "mock_step_ms": {"decode": itl_step * 1e3, "first_token": ttft_step * 1e3},
        "ttft_ms": _percentiles_ms(tally.ttft_s), "itl_ms": _percentiles_ms(tally.itl_s),
        "ttft_added_ms": _percentiles_ms(tally.ttft_s, ttft_step),
        "itl_added_ms": _percentiles_ms(tally.itl_s, itl_step),
    }


def default_model_vocab(model: str | None) -> tuple[Path, int]:
    """The gateways' model directory (a GGUF converted once, here) and its vocabulary size (config.json's,
    else the tokenizer's): the mock workers draw token ids below it."""
    from metroserve.common.tokenizer import load_tokenizer
    from metroserve.worker.model_files import resolve_model_dir

    model_dir = resolve_model_dir(model)
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    return model_dir, int(vocab) if vocab else len(load_tokenizer(model_dir))


def run_cluster_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    model_dir, vocab = default_model_vocab(args.model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="metroserve-bench-cluster-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(model_dir, vocab, args, log_dir, args.gateway_cpus)
    runs = []
    ok = False
    try:
        cluster.start(max(args.gateways))
        for workers in args.workers:
            cluster.grow(workers)
            log(f"starting {workers} mock workers, {max(args.gateways)} gateways (vocabulary {vocab}) ...")
            took = cluster.wait_ready(args.startup_timeout)
            log(f"ready in {took:.1f} s")
            for gateways in args.gateways:
                log(f"run W={workers} G={gateways} C={args.concurrency}: warm-up, then {args.duration:g} s measured")
                run = measure_run(cluster, args, workers, gateways)
                runs.append(run)
                log(f"  {run['tokens_per_s']:.0f} tok/s, {run['requests_per_s']:.1f} req/s; CPU s/1k tok: "
                    + ", ".join(f"{k} {v:.4f}" for k, v in run["cpu_s_per_1k_tokens"].items() if v is not None)
                    + f"; other cores {run['other_cores']:.2f}; failed {run['failed']}")
        ok = all(r["failed"] == 0 for r in runs)
    finally:
        cluster.stop()
        if args.log_dir is None and ok:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif not ok:
            log(f"the services' logs are in {log_dir}")
    return runs


# -- placement mode: the scheduler's core in this process -------------------------------------


def _percentiles_of_ns(ns: np.ndarray) -> dict[str, float]:
    ms = ns / 1e6
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "p999": float(np.percentile(ms, 99.9)), "max": float(ms.max()), "mean": float(ms.mean())}


def run_placement(num_workers: int, index_blocks: int, num_requests: int, prompt_len: int, inflight: int,
                  shared_fraction: float, seed: int = 0) -> dict[str, Any]:
    """Admission + placement timed per request on SchedulerCore with fake workers (see the module doc)."""
    from metroserve.common.block_hash import hash_prompt_blocks
    from metroserve.common.sampling_params import SamplingParams
    from metroserve.kvstore import MemoryKVStore
    from metroserve.rpc import cluster_pb2, generation_pb2
    from metroserve.rpc.convert import params_to_proto
    from metroserve.scheduler.core import CoreOptions, SchedulerCore

    block_size, vocab, max_tokens = 16, 49152, 64
    rng = np.random.default_rng(seed)
    kv = MemoryKVStore()
    core = SchedulerCore(CoreOptions(), kv)
    now = time.monotonic()
    limits = cluster_pb2.RequestLimits(vocab_size=vocab, max_model_len=8192, max_num_seqs=256, block_size=block_size,
                                       num_blocks=52428)
    links = [core.worker_registered(cluster_pb2.Register(worker_id=f"w{i}", epoch=i + 1, model=SERVED_MODEL,
                                                         limits=limits, address=f"127.0.0.1:{i + 1}"), now)
             for i in range(num_workers)]
    gateway = core.gateway_registered(cluster_pb2.GatewayRegister(gateway_id="bench"), now)
    # Shared prefixes (half the prompt) on two workers each; random filler blocks fill the index.
    prefix_len = prompt_len // 2 // block_size * block_size
    prefixes = [rng.integers(0, vocab, prefix_len).tolist() for _ in range(64)]
    for prefix in prefixes:
        for w in rng.choice(num_workers, size=min(2, num_workers), replace=False):
            kv.add_blocks(links[w].worker_id, links[w].epoch, hash_prompt_blocks(prefix, block_size))
    filler_count = max(0, index_blocks - sum(kv.num_blocks(link.worker_id) for link in links))
    raw = rng.bytes(16 * filler_count)
    held: dict[str, deque[bytes]] = {}  # per worker, its evictable blocks, oldest first
    for w, link in enumerate(links):
        held[link.worker_id] = deque(raw[16 * j:16 * j + 16] for j in range(w, filler_count, num_workers))
        kv.add_blocks(link.worker_id, link.epoch, held[link.worker_id])
    index_size = sum(kv.num_blocks(link.worker_id) for link in links)
    params = params_to_proto(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

    def prompt() -> list[int]:
        if rng.random() < shared_fraction:
            head = prefixes[int(rng.integers(len(prefixes)))]
            return head + rng.integers(0, vocab, prompt_len - len(head)).tolist()
        return rng.integers(0, vocab, prompt_len).tolist()

    running: deque = deque()  # (link, placement) in placement order
    admit_ns = np.zeros(num_requests, dtype=np.int64)
    finish_ns = []
    hits = 0

    def finish_oldest() -> None:
        link, placement = running.popleft()
        # The worker's report: the placement finished, its prompt blocks stored, as many old ones evicted.
        blocks = held[link.worker_id]
        evicted = [blocks.popleft() for _ in range(min(len(placement.block_hashes), len(blocks)))]
        blocks.extend(placement.block_hashes)
        msg = cluster_pb2.WorkerMessage(
            finished=[cluster_pb2.PlacementFinish(placement_id=placement.placement_id, finish_reasons=["length"],
                                                  num_tokens=[max_tokens])],
            load=cluster_pb2.LoadReport(num_running=link.num_placed_seqs, num_free_blocks=40000,
                                        num_total_blocks=52428),
            blocks_stored=placement.block_hashes, blocks_removed=evicted)
        t = time.perf_counter_ns()
        core.worker_message(link, msg, time.monotonic())
        finish_ns.append(time.perf_counter_ns() - t)

    for n in range(num_requests):
        request_id = f"r{n}"
        msg = cluster_pb2.GatewayMessage(submit=[cluster_pb2.Submission(request=generation_pb2.GenerateRequest(
            request_id=request_id, model=SERVED_MODEL, token_ids=generation_pb2.TokenIds(ids=prompt()),
            params=params))])
        t = time.perf_counter_ns()
        core.gateway_message(gateway, msg, time.monotonic())
        admit_ns[n] = time.perf_counter_ns() - t
        gateway.take_message()
        (placement,) = core.requests[request_id].placements.values()
        assert placement.worker_id is not None, "placed at once: every worker has room"
        link = core.workers[placement.worker_id]
        link.take_message()
        hits += placement.prefill_tokens < placement.num_tokens
        running.append((link, placement))
        if len(running) > inflight:
            finish_oldest()
    finish = np.asarray(finish_ns, dtype=np.int64)
    admit_s, finish_s = admit_ns.sum() / 1e9, finish.sum() / 1e9
    return {
        "workers": num_workers, "index_blocks": index_size, "requests": num_requests, "prompt_len": prompt_len,
        "inflight": inflight, "shared_fraction": shared_fraction, "prefix_hit_requests": int(hits),
        "index_blocks_at_end": sum(kv.num_blocks(link.worker_id) for link in links),
        "placement_ms": _percentiles_of_ns(admit_ns), "finish_ms": _percentiles_of_ns(finish),
        "admissions_per_s": num_requests / admit_s,
        "lifecycle_per_s": len(finish) / (admit_ns[:len(finish)].sum() / 1e9 + finish_s) if len(finish) else None,
        "meets_placement_p99": bool(np.percentile(admit_ns, 99) / 1e6 <= PLACEMENT_P99_TARGET_MS),
        "meets_admissions": bool(num_requests / admit_s >= ADMISSIONS_TARGET_PER_S),
    }


# -- report -----------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _pair(stats: dict[str, Any], digits: int = 1) -> str:
    return f"{_fmt(stats['p50'], digits)} / {_fmt(stats['p99'], digits)}"


def _cost_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| W | G | C | tok/s | ideal tok/s | req/s | sched CPU s/1k tok | "
             f"x lower than before ({BEFORE_SCHEDULER_CPU_S_PER_1K}; target >= {TARGET_FACTOR}x) | "
             "gateways CPU s/1k tok | workers CPU s/1k tok | client CPU s/1k tok | sched ms/req | "
             "gateways ms/req | workers ms/req | other cores | failed |", "|" + "---|" * 16]
    for r in runs:
        per_1k, per_req = r["cpu_s_per_1k_tokens"], r["cpu_ms_per_request"]
        lower = BEFORE_SCHEDULER_CPU_S_PER_1K / per_1k["scheduler"] if per_1k["scheduler"] else None
        lines.append(f"| {r['workers']} | {r['gateways']} | {r['concurrency']} | {r['tokens_per_s']:.0f} | "
                     f"{r['ideal_tokens_per_s']:.0f} | {r['requests_per_s']:.1f} | {_fmt(per_1k['scheduler'], 5)} | "
                     f"{_fmt(lower, 1)}x | {_fmt(per_1k['gateways'], 4)} | {_fmt(per_1k['workers'], 4)} | "
                     f"{_fmt(per_1k['client'], 4)} | {_fmt(per_req['scheduler'])} | {_fmt(per_req['gateways'])} | "
                     f"{_fmt(per_req['workers'])} | {r['other_cores']:.2f} | {r['failed']} |")
    return lines


def _latency_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| W | G | placement p50 / p99 ms | TTFT p50 / p99 ms | TTFT added p50 / p99 ms | ITL p50 / p99 ms | "
             "ITL added p50 / p99 ms | cores: sched / gateways / workers / client | "
             "waiting for a core, s/s: sched / gateways / workers / client |", "|" + "---|" * 9]
    for r in runs:
        c, w = r["cores"], r["runqueue_wait"]
        lines.append(f"| {r['workers']} | {r['gateways']} | {_pair(r['placement_ms'], 3)} | {_pair(r['ttft_ms'])} | "
                     f"{_pair(r['ttft_added_ms'])} | {_pair(r['itl_ms'])} | {_pair(r['itl_added_ms'])} | "
                     f"{c['scheduler']:.2f} / {c['gateways']:.2f} / {c['workers']:.2f} / {c['client']:.2f} | "
                     f"{w['scheduler']:.2f} / {w['gateways']:.2f} / {w['workers']:.2f} / {w['client']:.2f} |")
    return lines


def _scaling_table(scaling: list[dict[str, Any]]) -> list[str]:
    lines = ["| W | cores per gateway | tok/s G=1 / G=2 | tok/s G=2 / G=1 | gateways' cap used G=1 / G=2 | "
             "gateways' CPU s per 1k tokens streamed: G=1 / G=2 | estimate from CPU per token: G=2 / G=1 |",
             "|---|---|---|---|---|---|---|"]
    for s in scaling:
        cap = s["gateway_cpus"]
        lines.append(f"| {s['workers']} | {_fmt(cap) if cap else 'no cap'} | {s['tokens_per_s'][0]:.0f} / "
                     f"{s['tokens_per_s'][1]:.0f} | {s['throughput_ratio']:.2f} | {_fmt(s['cap_use'][0])} / "
                     f"{_fmt(s['cap_use'][1])} | {s['per_gateway_s_per_1k'][0]:.4f} / "
                     f"{s['per_gateway_s_per_1k'][1]:.4f} | {s['capacity_ratio']:.2f} |")
    return lines


def _placement_table(p: dict[str, Any]) -> list[str]:
    pm, fm = p["placement_ms"], p["finish_ms"]
    verdict = (f"{'met' if p['meets_placement_p99'] else 'MISSED'}, "
               f"{'met' if p['meets_admissions'] else 'MISSED'}")
    return ["| workers | index blocks | prompt | placement p50 / p99 / p99.9 / max ms | admissions/s | "
            "finish p50 / p99 ms | admit+finish /s | targets (p99 <= 1 ms, >= 2,000/s) |", "|" + "---|" * 8,
            f"| {p['workers']} | {p['index_blocks']:,} | {p['prompt_len']} | {pm['p50']:.3f} / {pm['p99']:.3f} / "
            f"{pm['p999']:.3f} / {pm['max']:.1f} | {p['admissions_per_s']:,.0f} | {fm['p50']:.3f} / {fm['p99']:.3f} | "
            f"{_fmt(p['lifecycle_per_s'], 0)} | {verdict} |"]


def format_tables(report: dict[str, Any]) -> str:
    """The report as markdown tables: cost per run, latency per run, G=2 vs G=1, placement."""
    sections = []
    runs = report.get("runs") or []
    if runs:
        sections += [_cost_table(runs), _latency_table(runs)]
        if report.get("gateway_scaling"):
            sections.append(_scaling_table(report["gateway_scaling"]))
    if report.get("placement"):
        sections.append(_placement_table(report["placement"]))
    return "\n\n".join("\n".join(lines) for lines in sections)


def gateway_scaling(runs: list[dict[str, Any]], gateway_cpus: float | None) -> list[dict[str, Any]]:
    """G=2 against G=1 at each W: delivered throughput (with --gateway-cpus, each gateway capped: the
    measured scaling), and the estimate from CPU per token (gateways share nothing, so with a core
    each their capacity is G / per-gateway cost)."""
    out = []
    by_key = {(r["workers"], r["gateways"]): r for r in runs}
    for (workers, gateways), two in sorted(by_key.items()):
        one = by_key.get((workers, 1))
        if gateways != 2 or one is None or not one["tokens"] or not two["tokens"]:
            continue
        per_gateway = (one["cpu_s_per_1k_tokens"]["gateways"], two["cpu_s_per_1k_tokens"]["gateways"])
        out.append({"workers": workers, "gateway_cpus": gateway_cpus,
                    "tokens_per_s": (one["tokens_per_s"], two["tokens_per_s"]),
                    "throughput_ratio": two["tokens_per_s"] / one["tokens_per_s"],
                    "cap_use": (one.get("gateway_cap_use"), two.get("gateway_cap_use")),
                    "per_gateway_s_per_1k": per_gateway, "capacity_ratio": 2 * per_gateway[0] / per_gateway[1]})
    return out


def write_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Throughput and per-component CPU per 1,000 tokens against W, one line style per G."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return None
    runs = report["runs"]
    fig, (tput, cpu) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ["-", "--", ":", "-."]
    for g_index, gateways in enumerate(sorted({r["gateways"] for r in runs})):
        rs = sorted((r for r in runs if r["gateways"] == gateways), key=lambda r: r["workers"])
        ws = [r["workers"] for r in rs]
        style = styles[g_index % len(styles)]
        tput.plot(ws, [r["tokens_per_s"] for r in rs], "o" + style, label=f"G={gateways}")
        for c_index, kind in enumerate(("scheduler", "gateways", "workers", "client")):
            cpu.plot(ws, [r["cpu_s_per_1k_tokens"][kind] for r in rs], "o" + style, color=f"C{c_index}",
                     label=f"{kind}, G={gateways}")
    if runs:
        tput.axhline(runs[0]["ideal_tokens_per_s"], color="grey", linewidth=0.8, label="concurrency / mock step")
    tput.set(title="tokens/s delivered", xlabel="mock workers (W)", ylabel="tokens/s", ylim=(0, None))
    cpu.axhline(BEFORE_SCHEDULER_CPU_S_PER_1K, color="grey", linewidth=0.8, label="scheduler before (relaying)")
    cpu.set(title="CPU seconds per 1,000 tokens", xlabel="mock workers (W)", ylabel="CPU s / 1k tokens", yscale="log")
    for ax in (tput, cpu):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(args: argparse.Namespace) -> int:
    """Run the modes asked for; 0 when every request completed, 1 otherwise (or the cluster failed)."""
    report: dict[str, Any] = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(),
                              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                           if not callable(v)},
                              "before_scheduler_cpu_s_per_1k_tokens": BEFORE_SCHEDULER_CPU_S_PER_1K}
    status = 0
    if args.mode == "placement" and args.gateway_cpus is not None:
        log("error: --gateway-cpus caps the gateways of --mode cluster; placement mode starts none")
        return 1
    if args.mode in ("both", "cluster"):
        if args.gateway_cpus is not None:
            try:
                if args.gateway_cpus <= 0:
                    raise CpuQuotaError(f"--gateway-cpus must be positive, got {args.gateway_cpus:g}")
                CpuQuota.check()
            except CpuQuotaError as e:
                log(f"error: {e}")
                return 1
        try:
            report["runs"] = run_cluster_sweep(args)
        except RuntimeError as e:
            log(f"error: {e}")
            return 1
        report["gateway_scaling"] = gateway_scaling(report["runs"], args.gateway_cpus)
        status = int(any(r["failed"] for r in report["runs"]))
    if args.mode in ("both", "placement"):
        log(f"placement: {args.placement_workers} workers, {args.index_blocks:,} index blocks, "
            f"{args.placement_requests} requests of {args.placement_prompt_len} tokens ...")
        report["placement"] = run_placement(args.placement_workers, args.index_blocks, args.placement_requests,
                                            args.placement_prompt_len, args.placement_inflight, args.shared_fraction)
    print(format_tables(report))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {args.output}")
    plot = args.plot or (args.output.with_suffix(".png") if args.output is not None else None)
    if plot is not None and report.get("runs"):
        written = write_plot(report, plot)
        if written is not None:
            log(f"wrote {written}")
    return status
