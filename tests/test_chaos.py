"""The chaos suite (`metroserve bench chaos`) as a test: each fault against `serve --workers 2`
(the default model) with 16 greedy streams through two gateways. Every fault but the killed
gateway's own clients ends with 16/16 streams identical to the undisturbed run, the surviving
gateway's clients untouched, every killed process restarted by serve, every block free after."""

from __future__ import annotations

import argparse
import shutil

import pytest

from metroserve.benchmarks import chaos
from metroserve.scheduler.core import heartbeat_interval_s

pytestmark = pytest.mark.service


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_every_single_fault_keeps_the_streams_identical_and_frees_every_block(smollm2_dir, tmp_path):
    args = argparse.Namespace(faults=list(chaos.FAULTS), streams=16, max_tokens=48, fault_after=8,
                              heartbeat_timeout=3.0, json_out=None)
    reports = {r["fault"]: r for r in chaos.run(args)["faults"]}
    assert list(reports) == list(chaos.FAULTS)
    for fault, r in reports.items():
        assert r["failed"] == [], (fault, r)
        assert r["idle_after_s"] is not None, f"{fault}: blocks not all free, or a request left running"
        expected = 8 if fault == "gateway-kill" else 0  # serve's gateway held every other stream
        assert (r["identical"], r["expected_losses"]) == (16 - expected, expected), (fault, r)
        assert r["restarted"] is (None if fault in ("worker-stop", "redis-kill") else True), (fault, r)
    # The worker really stalled until the scheduler declared it lost: its last message may have come
    # up to one heartbeat interval before the SIGSTOP, so the streams' gap is at least the difference.
    lost_after = args.heartbeat_timeout - heartbeat_interval_s(args.heartbeat_timeout)
    assert reports["worker-stop"]["max_gap_s"] >= lost_after, reports["worker-stop"]
