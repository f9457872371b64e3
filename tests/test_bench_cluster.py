"""`metroserve bench cluster` (benchmarks/cluster.py): a tiny sweep through the CLI against real
processes (scheduler, gateway, mock workers, the client process), the in-process placement mode,
and the client's SSE token counting at every read boundary."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from metroserve.benchmarks.cluster import _DONE, SseTokenCounter, run_placement
from metroserve.benchmarks.cpu_quota import CpuQuota, CpuQuotaError
from tests.stack import ROOT

RUN_FIELDS = ("tokens_per_s", "requests_per_s", "cpu_s", "cpu_s_per_1k_tokens", "cpu_ms_per_request", "runqueue_wait",
              "other_cores", "placement_ms", "ttft_ms", "itl_ms", "ttft_added_ms", "itl_added_ms", "mock_step_ms")
KINDS = {"scheduler", "gateways", "workers", "client"}


def test_token_counter_counts_each_event_whatever_the_reads():
    events = [b'data: {"choices": [{"text": "a\\n\\nb"}]}\n\n', b'data: {"choices": [{"text": ""}]}\n\n',
              b'data: {"choices": [{"text": "c"}]}\n\n', _DONE]
    stream = b"".join(events)
    for cut in range(1, len(stream)):  # every split into two reads, terminators and [DONE] included
        for second in (cut + 1, len(stream)):
            counter = SseTokenCounter()
            parts = (stream[:cut], stream[cut:second], stream[second:])
            assert sum(counter.feed(part) for part in parts) == 3, (cut, second)
            assert counter.done
    counter = SseTokenCounter()
    assert counter.feed(stream[:-1]) == 3 and not counter.done  # [DONE] not complete yet: not a token either


@pytest.mark.service
def test_tiny_sweep_through_the_cli_reports_every_component(tiny_model_dir, tmp_path):
    out = tmp_path / "cluster.json"
    argv = [sys.executable, "-m", "metroserve.services.cli", "bench", "cluster", "--mode", "cluster",
            "--workers", "2", "--gateways", "1", "--concurrency", "4", "--max-tokens", "8", "--prompt-len", "24",
            "--mock-step-fixed-ms", "10", "--duration", "2", "--warmup", "0.5", "--model", str(tiny_model_dir),
            "--output", str(out)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert all(field in run for field in RUN_FIELDS)
    assert (run["workers"], run["gateways"], run["concurrency"]) == (2, 1, 4)
    assert run["tokens"] > 0 and run["requests"] > 0 and run["prefix_hit_tokens"] == 0
    assert run["failed"] == 0 and run["completed"] == run["sent"] > 0, run["errors"]
    assert set(run["cpu_s_per_1k_tokens"]) == KINDS
    assert math.isfinite(run["cpu_s_per_1k_tokens"]["scheduler"]) and run["cpu_s_per_1k_tokens"]["scheduler"] > 0
    assert run["placement_ms"]["count"] > 0 and run["placement_ms"]["p50"] <= run["placement_ms"]["p99"]
    # Two tokens of a sequence are at least one mock step apart (beyond what reads together deliver).
    assert run["itl_ms"]["p99"] >= 10.0
    assert "| W | G | C | tok/s" in done.stdout
    assert out.with_suffix(".png").stat().st_size > 0


def _quota_unavailable() -> str | None:
    try:
        CpuQuota.check()
    except CpuQuotaError as e:
        return str(e)
    return None


@pytest.mark.service
@pytest.mark.skipif(_quota_unavailable() is not None, reason=f"no CPU quotas here: {_quota_unavailable()}")
def test_capped_gateways_report_their_scaling_and_leave_no_cgroup(tiny_model_dir, tmp_path):
    out = tmp_path / "cluster.json"
    argv = [sys.executable, "-m", "metroserve.services.cli", "bench", "cluster", "--mode", "cluster",
            "--workers", "2", "--gateways", "1,2", "--concurrency", "4", "--max-tokens", "8", "--prompt-len", "24",
            "--mock-step-fixed-ms", "10", "--duration", "1.5", "--warmup", "0.5", "--model", str(tiny_model_dir),
            "--gateway-cpus", "0.4", "--output", str(out)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["gateways"] for r in report["runs"]] == [1, 2]
    for run in report["runs"]:
        assert run["failed"] == 0 and run["tokens"] > 0, run["errors"]
        # A gateway cannot use more than its cap (0.4 cores each; 5% for the window's edges).
        assert 0 < run["gateway_cap_use"] <= 1.05
    (scaling,) = report["gateway_scaling"]
    assert scaling["gateway_cpus"] == 0.4 and scaling["workers"] == 2
    assert scaling["throughput_ratio"] == pytest.approx(scaling["tokens_per_s"][1] / scaling["tokens_per_s"][0])
    assert "cores per gateway" in done.stdout
    leftovers = [p for root in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup"))
                 for p in (root.glob("metroserve-bench-*") if root.is_dir() else [])]
    assert leftovers == []


@pytest.mark.parametrize(("mode", "cap", "message"), [("cluster", "0", "--gateway-cpus must be positive"),
                                                      ("placement", "0.5", "--gateway-cpus caps the gateways")])
def test_a_cap_it_cannot_apply_is_refused_by_name(tmp_path, mode, cap, message):
    argv = [sys.executable, "-m", "metroserve.services.cli", "bench", "cluster", "--mode", mode,
            "--gateway-cpus", cap, "--output", str(tmp_path / "x.json")]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and message in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_placement_mode_times_admission_on_the_core():
    result = run_placement(num_workers=4, index_blocks=5000, num_requests=300, prompt_len=64, inflight=32,
                           shared_fraction=0.5)
    assert result["index_blocks"] >= 5000
    # Each finish stores its prompt's blocks and evicts as many (fewer stored when a worker held some).
    assert 0.9 * result["index_blocks"] <= result["index_blocks_at_end"] <= result["index_blocks"]
    assert result["prefix_hit_requests"] > 0
    placement = result["placement_ms"]
    assert 0 < placement["p50"] <= placement["p99"] <= placement["max"]
    assert result["admissions_per_s"] > 0 and result["lifecycle_per_s"] < result["admissions_per_s"]
