"""A mock-worker cluster on loopback for service tests: a scheduler, a torch-free mock worker (or
none) and a gateway with the tiny model's tokenizer, each a real process logging to its own file."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from metroserve.rpc import generation_pb2, generation_pb2_grpc
from tests.stack import ROOT, free_port, scrape_metrics, wait_for

MODEL = "metro/mock"
VOCAB = 512  # the tiny model's vocabulary


@dataclass
class MockCluster:
    port: int
    grpc_port: int
    metrics_port: int
    procs: dict[str, subprocess.Popen]
    log_dir: Path

    def post(self, body: dict) -> tuple[int, http.client.HTTPMessage, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            return reply.status, reply.headers, json.loads(reply.read())
        finally:
            conn.close()

    def open_stream(self, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """A streaming completion left open, its headers read: it holds its slot or queue place until
        the caller reads it to its end or closes the connection (which aborts it)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "stream": True,
                                      "ignore_eos": True}))
        reply = conn.getresponse()
        assert reply.status == 200, reply.read()
        return conn, reply

    def grpc_generate_error(self) -> grpc.RpcError:
        request = generation_pb2.GenerateRequest(model=MODEL, text="hello",
                                                 params=generation_pb2.SamplingParams(max_tokens=4))
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel, pytest.raises(grpc.RpcError) as err:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30))
        return err.value

    def scheduler_gauges(self) -> tuple[float, float]:
        """(queue depth, active requests) from the scheduler's /metrics."""
        samples = scrape_metrics(f"http://127.0.0.1:{self.metrics_port}/metrics")
        depth = sum(v for (name, _), v in samples.items() if name.endswith("scheduler_queue_depth"))
        active = sum(v for (name, _), v in samples.items() if name.endswith("scheduler_active_requests"))
        return depth, active


def _spawn(log_dir: Path, name: str, argv: list[str]) -> subprocess.Popen:
    from metroserve.services.serve import die_with_parent

    with open(log_dir / f"{name}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "metroserve.services.cli", *argv], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "OTEL_SDK_DISABLED": "true"},
                                preexec_fn=die_with_parent)


def start_mock_cluster(tiny_model_dir: Path, log_dir: Path, with_worker: bool = True,
                       scheduler_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = (),
                       gateway_args: tuple[str, ...] = ()) -> MockCluster:
    """Start the processes (extra flags per process) and wait until the gateway's /health answers:
    200, or without a worker also 503."""
    scheduler_port = free_port()
    scheduler = f"127.0.0.1:{scheduler_port}"
    stack = MockCluster(free_port(), free_port(), free_port(), {}, log_dir)
    stack.procs["scheduler"] = _spawn(log_dir, "scheduler", [
        "scheduler", "--port", str(scheduler_port), "--metrics-port", str(stack.metrics_port), *scheduler_args])
    if with_worker:
        stack.procs["worker"] = _spawn(log_dir, "worker", [
            "worker", "--engine", "mock", "--scheduler", scheduler, "--served-model-name", MODEL,
            "--mock-vocab-size", str(VOCAB), *worker_args])
    stack.procs["gateway"] = _spawn(log_dir, "gateway", [
        "gateway", "--scheduler", scheduler, "--port", str(stack.port), "--grpc-port", str(stack.grpc_port),
        "--model", str(tiny_model_dir), "--served-model-name", MODEL, *gateway_args])

    def up() -> bool:
        exited = [name for name, p in stack.procs.items() if p.poll() is not None]
        assert not exited, f"{exited} exited; logs in {log_dir}"
        try:
            conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=2)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
        except OSError:
            return False
        return status == 200 if with_worker else status in (200, 503)

    wait_for(up, 120, "the gateway's /health")
    return stack


def stop_mock_cluster(stack: MockCluster) -> None:
    from metroserve.services.serve import stop_in_order

    stop_in_order([[stack.procs["gateway"]], [stack.procs.get("worker")], [stack.procs["scheduler"]]], timeout_s=30)
