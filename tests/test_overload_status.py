"""Overload and outage as clients see them, over REST and gRPC, on real processes on loopback.

A full queue: 429 with Retry-After and OpenAI's error body (the openai client raises RateLimitError),
gRPC RESOURCE_EXHAUSTED; and once the load is gone, requests are served again. No live worker:
503 with Retry-After, gRPC UNAVAILABLE. The full cluster: a scheduler with --max-queue-len 1, one
mock worker (torch-free) with --max-num-seqs 1 and 20 ms steps, a gateway with the tiny model's
tokenizer; the outage: a scheduler and a gateway, no worker.
"""

from __future__ import annotations

import asyncio
import resource
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from tests.mock_cluster import MODEL, MockCluster, start_mock_cluster, stop_mock_cluster
from tests.stack import wait_for

pytestmark = pytest.mark.service

QUEUE_OF_ONE = ("--max-queue-len", "1")
WIDE_SEQS, WIDE_QUEUE = 64, 128  # the 600-stream test's worker slots and queue bound


@pytest.fixture(scope="module")
def full(tiny_model_dir, tmp_path_factory) -> Iterator[MockCluster]:
    stack = start_mock_cluster(tiny_model_dir, tmp_path_factory.mktemp("overload"), scheduler_args=QUEUE_OF_ONE,
                               worker_args=("--max-num-seqs", "1", "--mock-step-fixed-ms", "20"))
    try:
        yield stack
    finally:
        stop_mock_cluster(stack)


@pytest.fixture(scope="module")
def no_worker(tiny_model_dir, tmp_path_factory) -> Iterator[MockCluster]:
    stack = start_mock_cluster(tiny_model_dir, tmp_path_factory.mktemp("outage"), with_worker=False,
                               scheduler_args=QUEUE_OF_ONE)
    try:
        yield stack
    finally:
        stop_mock_cluster(stack)


def _assert_openai_error(reply: tuple[int, Any, dict], expected: int) -> None:
    status, headers, body = reply
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
        _assert_openai_error(full.post({"model": MODEL, "prompt": "hi", "max_tokens": 4}), expected=429)
        _assert_openai_error(full.post({"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}),
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
    _assert_openai_error(no_worker.post({"model": MODEL, "prompt": "hi", "max_tokens": 4}), expected=503)
    _assert_openai_error(no_worker.post({"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}),
                         expected=503)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{no_worker.port}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:  # the openai package's class for any 5xx
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert err.value.status_code == 503
    assert no_worker.grpc_generate_error().code() == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def wide(tiny_model_dir, tmp_path_factory) -> Iterator[MockCluster]:
    stack = start_mock_cluster(tiny_model_dir, tmp_path_factory.mktemp("wide"),
                               scheduler_args=("--max-queue-len", str(WIDE_QUEUE)),
                               worker_args=("--max-num-seqs", str(WIDE_SEQS), "--mock-step-fixed-ms", "20"))
    try:
        yield stack
    finally:
        stop_mock_cluster(stack)


async def _stream_status(session, url: str, max_tokens: int) -> tuple[int, str | None, int]:
    """(status, Retry-After, token chunks) of one streaming completion read to its end."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            error = await resp.json()
            assert set(error) == {"error"}, error
            return resp.status, resp.headers.get("Retry-After"), 0
        chunks, done = 0, False
        async for line in resp.content:
            chunks += line.startswith(b"data: {")
            done = done or line.startswith(b"data: [DONE]")
        assert done
        return resp.status, None, chunks


def test_600_concurrent_streams_get_only_200s_and_429s_with_retry_after(wide):
    import aiohttp

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))

    async def run() -> list[tuple[int, str | None, int]]:
        connector = aiohttp.TCPConnector(limit=0)  # every stream at once, one connection each
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            url = f"http://127.0.0.1:{wide.port}/v1/completions"
            return await asyncio.gather(*(_stream_status(session, url, 16) for _ in range(600)))

    results = asyncio.run(run())
    statuses = Counter(status for status, _, _ in results)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] >= WIDE_SEQS + WIDE_QUEUE  # the slots and the queue were filled
    assert statuses[429] > 0, statuses  # and the rest refused, not queued past the bound
    assert all(int(retry or 0) >= 1 for status, retry, _ in results if status == 429)
    assert all(chunks == 16 for status, _, chunks in results if status == 200)
    wait_for(lambda: wide.scheduler_gauges() == (0, 0), 30, "the queue to empty and every request to end")
