"""`metroserve serve`: the whole stack on one machine, as separate processes on loopback.

One scheduler, --workers N worker processes (each owns its own KV pool) and one gateway, each
started as `metroserve <component>` so they behave exactly as in a real deployment. The model
is resolved (a GGUF converted) once, before the workers start, so they never race on the cache.
The children authenticate each other with an ephemeral cluster secret made here and passed in
their environment (never their command line), unless the user gave a secret or TLS files.
Any child that exits unexpectedly is restarted: a worker's work moves to the others meanwhile; a
restarted scheduler rebuilds its view from the workers' and the gateway's reports while running
streams go on; a restarted gateway's own clients are lost with it. SIGINT/SIGTERM stops the
gateway, drains the workers, then stops the scheduler.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from metroserve.rpc.auth import ClusterCredentials, child_process_auth, generate_secret
from metroserve.services.chat_serving import ChatServing
from metroserve.services.cors import CorsPolicy
from metroserve.services.http_limits import HttpLimits
from metroserve.services.prompt_log import PromptLog
from metroserve.worker.config import EngineConfig

logger = logging.getLogger("metroserve.serve")

RESTART_DELAY_S = 0.5


def die_with_parent() -> None:
    """Children get SIGTERM if serve itself dies, so no orphan keeps a port or a KV pool."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _visible_gpus() -> list[str]:
    """The GPUs workers may use. torch counts them in a short-lived child process: the supervisor
    lives as long as the stack and would otherwise hold torch's few hundred MB for one number."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    count = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, check=True).stdout
    return [str(i) for i in range(int(count))]


@dataclass
class ServeOptions:
    engine: EngineConfig
    served_model_name: str
    workers: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50052
    scheduler_port: int = 50051
    kvstore: str = "memory"
    api_key: str | None = None
    cors: CorsPolicy = field(default_factory=CorsPolicy)  # the gateway's
    chat: ChatServing = field(default_factory=ChatServing)  # the gateway's chat template and tool-call parser
    max_queue_len: int = 1024
    heartbeat_timeout_s: float = 30.0  # the scheduler's
    metrics_port: int = 9090  # the scheduler's; worker i's is this + 1 + i; 0: none
    otlp_endpoint: str | None = None
    log_requests: bool = True
    # Credentials the children share; none given: an ephemeral secret made at start.
    credentials: ClusterCredentials | None = None
    scheduler_wait_s: float = 30.0
    limits: HttpLimits = field(default_factory=HttpLimits)  # the gateway's
    prompt_log: PromptLog = field(default_factory=PromptLog)  # the gateway's


class Stack:
    def __init__(self, options: ServeOptions):
        self.options = options
        self.scheduler: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self._stopping = False
        self.gpus = [] if options.engine.device == "cpu" else _visible_gpus()
        self._auth_argv, self._auth_env = child_process_auth(options.credentials or ClusterCredentials(
            secret=generate_secret()))
        self._argv: dict[str, tuple[list[str], dict | None]] = {}  # child name -> how to start it again

    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        self._argv[name] = (args, env)
        return subprocess.Popen([sys.executable, "-m", "metroserve.services.cli", *args, *self._auth_argv],
                                preexec_fn=die_with_parent, start_new_session=True,
                                env={**(env or os.environ), **self._auth_env})

    def _worker_env(self, index: int) -> dict | None:
        """On a multi-GPU host, worker i gets GPU i mod count to itself, so pools never share a device.

        On CPU, workers split the cores (OMP_NUM_THREADS, unless the user set it): each worker's
        torch would otherwise start one thread per core, and N workers' OpenMP threads spinning on
        the same cores slowed a tiny model's steps from milliseconds to about 150 ms.
        """
        if self.options.engine.device == "cpu" or not self.gpus:
            if "OMP_NUM_THREADS" in os.environ:
                return None
            threads = max(1, (os.cpu_count() or 1) // self.options.workers)
            return {**os.environ, "OMP_NUM_THREADS": str(threads)}
        return {**os.environ, "CUDA_VISIBLE_DEVICES": self.gpus[index % len(self.gpus)]}

    def _tracing_argv(self) -> list[str]:
        return ["--otlp-endpoint", self.options.otlp_endpoint] if self.options.otlp_endpoint else []

    def _worker_argv(self, worker_id: str) -> list[str]:
        o = self.options
        index = int(worker_id.rsplit("-", 1)[1])
        metrics = ["--metrics-port", str(o.metrics_port + 1 + index)] if o.metrics_port else []
        return ["worker", "--scheduler", f"127.0.0.1:{o.scheduler_port}", "--worker-id", worker_id,
                "--served-model-name", o.served_model_name, *metrics, *self._tracing_argv(), *o.engine.to_cli_args()]

    def _gateway_argv(self) -> list[str]:
        o = self.options
        argv = ["gateway", "--scheduler", f"127.0.0.1:{o.scheduler_port}", "--host", o.host, "--port", str(o.port),
                "--grpc-port", str(o.grpc_port), "--served-model-name", o.served_model_name,
                "--scheduler-wait", str(o.scheduler_wait_s), *o.limits.to_cli_args(), *o.prompt_log.to_cli_args(),
                *o.cors.to_cli_args(), *o.chat.to_cli_args(),
                *self._tracing_argv()]
        if o.engine.model:
            argv += ["--model", o.engine.model]
        return argv

    def _gateway_env(self) -> dict | None:
        """The API key goes by environment, never on a command line (which any local user can read)."""
        return {**os.environ, "METROSERVE_API_KEY": self.options.api_key} if self.options.api_key else None

    def metrics_urls(self) -> list[str]:
        o = self.options
        host = o.host if o.host != "0.0.0.0" else "127.0.0.1"
        urls = [f"http://{host}:{o.port}/metrics (gateway)"]
        if o.metrics_port:
            urls.append(f"http://127.0.0.1:{o.metrics_port}/metrics (scheduler)")
            if not o.engine.disable_log_stats:
                urls += [f"http://127.0.0.1:{o.metrics_port + 1 + i}/metrics (worker-{i})" for i in range(o.workers)]
        return urls

    def start(self) -> None:
        o = self.options
        scheduler = ["scheduler", "--host", "127.0.0.1", "--port", str(o.scheduler_port), "--kvstore", o.kvstore,
                     "--max-queue-len", str(o.max_queue_len), "--metrics-port", str(o.metrics_port),
                     "--heartbeat-timeout", str(o.heartbeat_timeout_s),
                     *self._tracing_argv()]
        if not o.log_requests:
            scheduler.append("--disable-log-requests")
        self.scheduler = self._spawn("scheduler", scheduler)
        for i in range(o.workers):
            worker_id = f"worker-{i}"
            self.workers[worker_id] = self._spawn(worker_id, self._worker_argv(worker_id), self._worker_env(i))
        self.gateway = self._spawn("gateway", self._gateway_argv(), self._gateway_env())

    def wait_ready(self, timeout_s: float = 600.0) -> bool:
        """Poll the gateway's /health until every part is up (a worker loading the model takes a while)."""
        assert self.scheduler is not None and self.gateway is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        host = self.options.host if self.options.host != "0.0.0.0" else "127.0.0.1"
        url = f"http://{host}:{self.options.port}/health"
        while time.monotonic() < deadline:
            if self.scheduler.poll() is not None or self.gateway.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        return False

    def _restart(self, name: str, proc: subprocess.Popen) -> subprocess.Popen:
        logger.warning("the %s exited with %s; restarting it", name, proc.returncode)
        time.sleep(RESTART_DELAY_S)
        return self._spawn(name, *self._argv[name])

    def supervise(self) -> int:
        """Restart any child that dies until asked to stop; returns the exit code."""
        assert self.scheduler is not None and self.gateway is not None, "start() first"
        while not self._stopping:
            if self.scheduler.poll() is not None:
                self.scheduler = self._restart("scheduler", self.scheduler)
            if self.gateway.poll() is not None:
                self.gateway = self._restart("gateway", self.gateway)
            for worker_id, proc in list(self.workers.items()):
                if proc.poll() is not None and not self._stopping:
                    self.workers[worker_id] = self._restart(worker_id, proc)
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        self._stopping = True
        stop_in_order([[self.gateway], list(self.workers.values()), [self.scheduler]], timeout_s=60)


def stop_in_order(groups: list[list[subprocess.Popen | None]], timeout_s: float) -> None:
    """SIGTERM each group's live processes together, wait for them (SIGKILL after `timeout_s`),
    then the next group: gateways first, so no new work starts, then workers (they drain), then the
    scheduler they report to."""
    for group in groups:
        procs = [p for p in group if p is not None and p.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
