"""A scheduler restart while streams run, on a cluster of real processes with mock workers whose
streams outlast the restart: the new scheduler adopts every running placement from the workers'
and the gateway's reports (no migration, no re-prefill), the streams never pause for it, and they
end with the text of an undisturbed run. (test_cluster.py kills the scheduler under `serve` with
the real model.)"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

import pytest

from metroserve.benchmarks.cluster import Cluster, default_model_vocab
from tests.stack import stream_completions, wait_for

pytestmark = pytest.mark.service

STEP_MS = 40.0  # 120 tokens take about 5 s: longer than a scheduler restart
PROMPTS = [f"Request {i}: tell me about the metro line number {i} and its stations" for i in range(16)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model_dir, vocab = default_model_vocab(None)
    args = argparse.Namespace(mock_num_blocks=4096, mock_step_fixed_ms=STEP_MS, mock_prefill_token_us=0.0,
                              mock_decode_seq_us=0.0)
    c = Cluster(model_dir, vocab, args, tmp_path_factory.mktemp("cluster-logs"))
    try:
        c.start(num_gateways=1)
        c.grow(2)
        c.wait_ready(120)
        yield c
    finally:
        c.stop()


def _streams(cluster, on_progress=None) -> list[tuple[str, str | None, int]]:
    (_, port), = cluster.gateways
    return stream_completions(f"http://127.0.0.1:{port}/v1", "mock", PROMPTS, 120, on_progress)


def test_restarted_scheduler_adopts_running_streams(cluster):
    undisturbed = _streams(cluster)
    assert all(finish == "length" and tokens == 120 for _, finish, tokens in undisturbed)
    seen: dict = {}

    async def restart(progress):
        assert cluster.scheduler is not None
        os.kill(cluster.scheduler.pid, signal.SIGKILL)
        cluster.scheduler.wait()
        at_kill = sum(progress.values())
        cluster.restart_scheduler()

        def adopted():
            try:
                status = cluster.status()
            except Exception:  # not listening yet
                return None
            placed = sum(w.num_placed for w in status.workers)
            return status if status.num_active_requests == len(PROMPTS) and placed == len(PROMPTS) else None

        # Polled from this loop's thread, like the streams; a short wait per poll keeps them flowing.
        deadline = asyncio.get_running_loop().time() + 30
        while (status := adopted()) is None:
            assert asyncio.get_running_loop().time() < deadline, "the new scheduler did not adopt the streams"
            await asyncio.sleep(0.05)
        seen["status"], seen["tokens_meanwhile"] = status, sum(progress.values()) - at_kill

    disturbed = _streams(cluster, restart)
    assert disturbed == undisturbed
    status = seen["status"]
    assert status.num_migrations == 0 and status.num_admitted == len(PROMPTS)  # adopted, none moved
    assert seen["tokens_meanwhile"] > 0  # the streams went on while no scheduler ran
    wait_for(lambda: _idle(cluster), 30, "every request to end and every block to be free")


def _idle(cluster) -> bool:
    status = cluster.status()
    return status.num_active_requests == 0 and all(
        w.num_placed == 0 and w.load.num_free_blocks == w.load.num_total_blocks for w in status.workers)
