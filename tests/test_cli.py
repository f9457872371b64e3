"""The `metroserve` command: generate and the benchmarks, on the tiny model."""

import json
import os

import pytest

from metroserve.services.cli import main


def test_generate_prints_completions(tiny_model_dir, capsys):
    main(["generate", "--model", str(tiny_model_dir), "--prompt", "hello", "--prompt", "the module",
          "--max-tokens", "5", "--kv-cache-memory", "64MiB"])
    out = capsys.readouterr().out
    assert out.count("### ") == 2 and "[5 tokens, length]" in out


def test_generate_bad_flag_is_one_clear_line(tiny_model_dir):
    with pytest.raises(SystemExit, match="top_p must be in"):
        main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--top-p", "2"])


def test_help_lists_every_command_and_benchmark(capsys):
    for argv in (["--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
    out = capsys.readouterr().out
    for command in ("generate", "serve", "scheduler", "gateway", "worker", "bench"):
        assert f"    {command} " in out
    for benchmark in ("throughput", "overhead", "speculative", "serve", "observability"):
        assert f"    {benchmark} " in out


def test_bench_parser_is_built_when_chosen(capsys):
    """A benchmark's flags and description come from its module, imported only when it is chosen."""
    from metroserve.benchmarks import serving

    with pytest.raises(SystemExit):
        main(["bench", "serve", "--help"])
    out = capsys.readouterr().out
    assert "--base-url" in out and serving.__doc__.strip().splitlines()[0] in out


def test_bench_throughput_runs_all_peers(tiny_model_dir, tmp_path, capsys):
    out_file = tmp_path / "tp.json"
    main(["bench", "throughput", "--model", str(tiny_model_dir), "--num-requests", "4", "--max-tokens", "8",
          "--json-out", str(out_file)])
    report = json.loads(out_file.read_text())
    assert set(report["peers"]) == {"engine", "hf-static", "hf-cb"}
    for peer in report["peers"].values():
        assert peer["requests"] == 4 and peer["output_tokens"] > 0
        # measured over the timed generation only (each peer in its own process), on Linux
        assert 0 <= peer["other_processes_cores"] <= os.cpu_count()
    assert "engine/peer" in capsys.readouterr().out


def test_bench_structured_outputs_measures_every_arm(smollm2_dir, tmp_path):
    out_file = tmp_path / "so.json"
    main(["bench", "structured-outputs", "--model", str(smollm2_dir), "--batch", "4", "--max-tokens", "12",
          "--rounds", "1", "--wait-idle", "0", "--json-min-items", "8", "--regex-min-chars", "40",
          "--json-out", str(out_file)])
    report = json.loads(out_file.read_text())
    (setting,) = report["settings"]
    (round_,) = setting["rounds"]
    assert sorted(round_["runs"]) == ["choice", "json", "regex", "unconstrained"]
    for arm, run in round_["runs"].items():
        assert run["full_batch_steps"] > 0 and sum(run["output_tokens"]) > 0, arm
        if arm != "unconstrained":  # the masks were filled and applied
            assert round_["summary"][arm]["fill_p50"] > 0 and round_["summary"][arm]["apply_p50"] > 0


@pytest.mark.service
def test_bench_overhead_runs_both_sides(tiny_model_dir, tmp_path):
    from tests.stack import free_port

    out_file = tmp_path / "ov.json"
    main(["bench", "overhead", "--model", str(tiny_model_dir), "--num-requests", "4", "--max-tokens", "8",
          "--concurrency", "2", "--rounds", "2", "--kv-cache-memory", "64MiB", "--port", str(free_port()),
          "--json-out", str(out_file)])
    report = json.loads(out_file.read_text())
    assert [r["mode"] for r in report["runs"]] == ["offline", "served", "served", "offline"]
    assert all(r["output_tokens"] == 4 * 8 for r in report["runs"])
    assert report["served_over_offline"] > 0


@pytest.mark.service
def test_bench_observability_runs_both_stacks_with_the_signals_on_one(tiny_model_dir, tmp_path):
    from tests.stack import free_port

    out_file = tmp_path / "obs.json"
    main(["bench", "observability", "--model", str(tiny_model_dir), "--num-requests", "4", "--max-tokens", "8",
          "--concurrency", "2", "--rounds", "2", "--scrape-interval", "0.05", "--kv-cache-memory", "64MiB",
          "--port", str(free_port()), "--json-out", str(out_file)])
    report = json.loads(out_file.read_text())
    assert [r["mode"] for r in report["runs"]] == ["on", "off", "off", "on"]
    assert all(r["output_tokens"] == 4 * 8 for r in report["runs"])
    evidence = report["evidence_on"]
    assert evidence["request_log_lines"] == 2 + 2 * 4  # warm-up (one per stream) + rounds x requests
    assert evidence["scrapes"] >= 2 * 3 and evidence["span_exports"] > 0
    assert report["on_over_off"] > 0 and report["median_round_ratio"] > 0


def test_bench_throughput_reports_speculation(tiny_model_dir, tmp_path, capsys):
    out_file = tmp_path / "tp.json"
    main(["bench", "throughput", "--model", str(tiny_model_dir), "--num-requests", "4", "--max-tokens", "8",
          "--peers", "engine", "--json-out", str(out_file),
          "--speculative-config", '{"method": "ngram", "prompt_lookup_min": 1, "min_acceptance_rate": 0}'])
    engine = json.loads(out_file.read_text())["peers"]["engine"]
    assert engine["spec_num_drafts"] > 0
    assert engine["spec_mean_acceptance_length"] == 1 + engine["spec_num_accepted_tokens"] / engine["spec_num_drafts"]
    assert "engine speculation:" in capsys.readouterr().out



def test_serve_splits_cpu_cores_between_workers(monkeypatch):
    """Two CPU workers with one thread per core each would oversubscribe the cores."""
    from metroserve.services.serve import ServeOptions, Stack
    from metroserve.worker.config import EngineConfig

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    stack = Stack(ServeOptions(engine=EngineConfig(device="cpu"), served_model_name="m", workers=3))
    env = stack._worker_env(0)
    assert env is not None and env["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's choice wins
    assert stack._worker_env(1) is None


@pytest.mark.parametrize(("argv", "named"), [
    (["--engine", "mock", "--kv-cache-memory", "1GiB", "--dtype", "float32"], "--dtype, --kv-cache-memory"),
    (["--mock-step-fixed-ms", "3"], "--mock-step-fixed-ms"),
])
def test_worker_refuses_flags_its_engine_does_not_use(argv, named):
    """Checked before anything starts: no scheduler is needed to get the error."""
    with pytest.raises(SystemExit) as err:
        main(["worker", "--scheduler", "127.0.0.1:1", *argv])
    assert f"metroserve: error: {named}: no effect with --engine" in str(err.value)
