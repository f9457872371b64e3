"""Overload and outage as clients see them, over REST and gRPC, on real processes on loopback.

A full queue: 429 with Retry-After and OpenAI's error body (the openai client raises RateLimitError),
gRPC RESOURCE_EXHAUSTED; and once the load is gone, requests are served again. No live worker:
503 with Retry-After, gRPC UNAVAILABLE. The full cluster: a scheduler with --max-queue-len 1, one
mock worker (torch-free) with --max-num-seqs 1 and 20 ms steps, a gateway with the tiny model's
tokenizer; the outage: a scheduler and a gateway, no worker.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

from metroserve.rpc import generation_pb2, generation_pb2_grpc
from tests.stack import ROOT, free_port, scrape_metrics, wait_for

pytestmark = pytest.mark.service

MODEL = "metro/overload"
VOCAB = 512  # the tiny model's vocabulary


@dataclass
class Stack:
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


def _start(tiny_model_dir: Path, log_dir: Path, with_worker: bool) -> Stack:
    scheduler_port = free_port()
    scheduler = f"127.0.0.1:{scheduler_port}"
    stack = Stack(free_port(), free_port(), free_port(), {}, log_dir)
    stack.procs["scheduler"] = _spawn(log_dir, "scheduler", [
        "scheduler", "--port", str(scheduler_port), "--max-queue-len", "1", "--metrics-port", str(stack.metrics_port)])
    if with_worker:
        stack.procs["worker"] = _spawn(log_dir, "worker", [
            "worker", "--engine", "mock", "--scheduler", scheduler, "--served-model-name", MODEL,
            "--mock-vocab-size", str(VOCAB), "--max-num-seqs", "1", "--mock-step-fixed-ms", "20"])
    stack.procs["gateway"] = _spawn(log_dir, "gateway", [
        "gateway", "--scheduler", scheduler, "--port", str(stack.port), "--grpc-port", str(stack.grpc_port),
        "--model", str(tiny_model_dir), "--served-model-name", MODEL])

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


def _stop(stack: Stack) -> None:
    from metroserve.services.serve import stop_in_order

    stop_in_order([[stack.procs["gateway"]], [stack.procs.get("worker")], [stack.procs["scheduler"]]], timeout_s=30)


@pytest.fixture(scope="module")
def full(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    stack = _start(tiny_model_dir, tmp_path_factory.mktemp("overload"), with_worker=True)
    try:
        yield stack
    finally:
        _stop(stack)


@pytest.fixture(scope="module")
def no_worker(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    stack = _start(tiny_model_dir, tmp_path_factory.mktemp("outage"), with_worker=False)
    try:
        yield stack
    finally:
        _stop(stack)


def _assert_openai_error(status: int, headers, body: dict, expected: int) -> None:
    assert status == expected, body
    assert headers["Content-Type"].startswith("application/json")
    assert int(headers["Retry-After"]) >= 1
    assert set(body) == {"error"} and body["error"]["message"], body


def test_a_full_queue_gets_429_on_rest_and_resource_exhausted_on_grpc_then_serves_again(full):
    running_conn, running = full.open_stream(max_tokens=1500)  # the worker's one slot: ~30 s of 20 ms steps
    try:
        assert running.readline().startswith(b"data: ")  # its first token: it runs
        waiting_conn, waiting = full.open_stream(max_tokens=4)  # the queue's one place
        wait_for(lambda: full.scheduler_gauges()[0] == 1, 30, "the second request to wait in the queue")
        _assert_openai_error(*full.post({"model": MODEL, "prompt": "hi", "max_tokens": 4}), expected=429)
        _assert_openai_error(*full.post({"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}),
                             expected=429)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{full.port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert full.grpc_generate_error().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        running_conn.close()  # the client leaves: its request is aborted and the waiting one runs
    assert waiting.read().rstrip().endswith(b"data: [DONE]")
    waiting_conn.close()
    wait_for(lambda: full.scheduler_gauges() == (0, 0), 30, "the queue to empty and every request to end")
    status, _, body = full.post({"model": MODEL, "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body


def test_no_live_worker_gets_503_on_rest_and_unavailable_on_grpc(no_worker):
    _assert_openai_error(*no_worker.post({"model": MODEL, "prompt": "hi", "max_tokens": 4}), expected=503)
    _assert_openai_error(*no_worker.post({"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}),
                         expected=503)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{no_worker.port}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:  # the openai package's class for any 5xx
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert err.value.status_code == 503
    assert no_worker.grpc_generate_error().code() == grpc.StatusCode.UNAVAILABLE
