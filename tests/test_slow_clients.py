"""Slow and idle HTTP clients are dropped by the gateway's timeouts while normal streams are served.

A mock-worker cluster whose gateway runs with --timeout-keep-alive 1 and --body-read-timeout 1.5.
Slowloris clients (a header a byte at a time), slow-body clients (whole headers, then a byte at a
time) and idle connections (nothing sent) are held open by the benchmark's own slow clients
(benchmarks/slowloris.py) beside normal streaming completions; each kind must be closed by its
timeout, not before, the slow bodies with a 408, and every normal stream must end whole. How much
the normal streams' ITL moves is a benchmark (`metroserve bench slowloris`), not asserted here.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Iterator

import pytest

from metroserve.benchmarks.slowloris import SlowClientStats, run_workload, slow_client
from tests.mock_cluster import MODEL, MockCluster, start_mock_cluster, stop_mock_cluster

pytestmark = pytest.mark.service

KEEP_ALIVE_S, BODY_READ_S = 1.0, 1.5
SLACK_S = 1.5  # the event loop's lateness on a loaded 2-core machine
SLOW_CLIENTS = 60  # of each kind
IDLE_CONNECTIONS = 20


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory) -> Iterator[MockCluster]:
    stack = start_mock_cluster(tiny_model_dir, tmp_path_factory.mktemp("slow"),
                               worker_args=("--max-num-seqs", "16", "--mock-step-fixed-ms", "10"),
                               gateway_args=("--timeout-keep-alive", str(KEEP_ALIVE_S),
                                             "--body-read-timeout", str(BODY_READ_S)))
    try:
        yield stack
    finally:
        stop_mock_cluster(stack)


async def _idle_connection(port: int) -> float:
    """Connect, send nothing; seconds from before the connect (the server's timer cannot start
    earlier) until the server closes the connection."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert await asyncio.wait_for(reader.read(), KEEP_ALIVE_S + 10) == b""
        return time.monotonic() - start
    finally:
        writer.close()


async def _slow_clients_beside_streams(port: int) -> tuple[SlowClientStats, SlowClientStats, list[float], int]:
    stop = asyncio.Event()
    headers, body = SlowClientStats(), SlowClientStats()
    slow = [asyncio.ensure_future(slow_client("127.0.0.1", port, mode, 0.2, stop, stats))
            for mode, stats in (("headers", headers), ("body", body)) for _ in range(SLOW_CLIENTS)]
    idle = [asyncio.ensure_future(_idle_connection(port)) for _ in range(IDLE_CONNECTIONS)]
    # Normal streams, repeated past both timeouts: 16 x 40 tokens of 10 ms steps, about 0.5 s a run.
    gaps, runs = await run_workload(f"http://127.0.0.1:{port}/v1/completions", MODEL, [[1, 2, 3, 4]] * 16, 40, 16,
                                    min_seconds=BODY_READ_S + 2 * SLACK_S)
    idle_lifetimes = await asyncio.gather(*idle)
    stop.set()
    await asyncio.gather(*slow)
    return headers, body, idle_lifetimes, runs


def test_slow_and_idle_clients_are_dropped_by_their_timeouts_while_streams_are_served(cluster):
    headers, body, idle_lifetimes, runs = asyncio.run(_slow_clients_beside_streams(cluster.port))
    assert runs >= 2  # every stream of every run ended with all of its 40 chunks (run_workload checks)
    for stats, timeout_s in ((headers, KEEP_ALIVE_S), (body, BODY_READ_S)):
        assert not stats.errors, stats.errors[:3]
        assert stats.closed_by_server >= SLOW_CLIENTS, stats.summary()  # each client dropped at least once
        assert timeout_s - 0.05 <= min(stats.lifetimes_s) and max(stats.lifetimes_s) <= timeout_s + SLACK_S, \
            stats.summary()
    assert headers.got_408 == 0  # no request yet: the connection is just closed
    assert body.got_408 == body.closed_by_server  # a request without its body: told why
    assert all(KEEP_ALIVE_S - 0.05 <= s <= KEEP_ALIVE_S + SLACK_S for s in idle_lifetimes), idle_lifetimes


def _get_health(sock: socket.socket) -> bytes:
    """One keep-alive GET /health on sock, read to the end of its body; its status line and headers."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += _recv(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    match = re.search(rb"(?i)content-length: *(\d+)", head)
    assert match, head
    while len(body) < int(match.group(1)):
        body += _recv(sock)
    return head


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(4096)
    assert data, "the server closed the connection mid-response"
    return data


def test_a_keep_alive_connection_serves_requests_then_closes_when_idle(cluster):
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=KEEP_ALIVE_S + 10) as sock:
        for _ in range(3):  # back to back: well inside the timeout
            assert _get_health(sock).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        assert sock.recv(4096) == b""  # blocks until the server closes the idle connection
        assert KEEP_ALIVE_S - 0.05 <= time.monotonic() - start <= KEEP_ALIVE_S + SLACK_S
