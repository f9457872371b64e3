"""`metroserve bench serve` (benchmarks/serving.py): datasets, the statistics, SSE parsing, server
counters, and a concurrency sweep against a real `metroserve serve` stack on the tiny model."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from metroserve.benchmarks import serving
from metroserve.benchmarks.serving import RunSetting, SLOs, arrival_offsets, summarize
from metroserve.benchmarks.serving_client import RequestRecord, Target, counter_deltas, parse_counters
from metroserve.benchmarks.serving_datasets import (
    BenchRequest,
    chat_jsonl_requests,
    random_requests,
    shared_prefix_requests,
)
from tests.stack import ServeStack, free_port


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return serving.load_bench_tokenizer(str(tiny_model_dir))


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _text(request: BenchRequest) -> str:
    assert isinstance(request.prompt, str), "a /v1/completions request: text, not messages"
    return request.prompt


# -- datasets ------------------------------------------------------------------------------------


def test_random_prompts_have_lengths_in_range(tokenizer):
    requests = random_requests(tokenizer, num_requests=40, input_len=60, output_len=10, range_ratio=0.5, seed=1)
    assert len(requests) == 40
    for r in requests:
        assert 30 <= n_tokens(tokenizer, _text(r)) <= 90 and r.prompt_len == n_tokens(tokenizer, _text(r))
        assert 5 <= r.max_tokens <= 15 and not r.is_chat
    assert len({r.prompt_len for r in requests}) > 5  # spread, not one length
    assert not any(s in r.prompt for r in requests for s in tokenizer.all_special_tokens)
    assert random_requests(tokenizer, 40, 60, 10, 0.5, seed=1) == requests  # seeded


def test_shared_prefix_requests_start_with_their_prefix_and_interleave(tokenizer):
    P, S = 4, 4
    requests = shared_prefix_requests(tokenizer, num_prefixes=P, suffixes_per_prefix=S, prefix_len=32,
                                      suffix_len=8, output_len=4, seed=0)
    assert len(requests) == P * S and all(r.max_tokens == 4 for r in requests)
    # Random-token prefixes share (almost) no leading text, so grouping by a short leading string
    # recovers the prefixes; each group's common text is the prefix.
    prompts = [_text(r) for r in requests]
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt[:12], []).append(i)
    assert sorted(len(g) for g in groups.values()) == [S] * P
    for members in groups.values():
        prefix = os.path.commonprefix([prompts[i] for i in members])
        assert abs(n_tokens(tokenizer, prefix) - 32) <= 1
        assert all(prompts[i].startswith(prefix) for i in members)
    order = [next(k for k, g in enumerate(groups.values()) if i in g) for i in range(P * S)]
    assert sum(a != b for a, b in zip(order, order[1:])) > P - 1  # not grouped by prefix


def test_chat_jsonl(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}\n'
                    '\n{"prompt": "What is a block table?", "max_tokens": 7}\n{"prompt": "third"}\n')
    requests = chat_jsonl_requests(path, num_requests=2, output_len=16)
    assert [r.max_tokens for r in requests] == [16, 7] and all(r.is_chat for r in requests)
    assert requests[1].prompt == [{"role": "user", "content": "What is a block table?"}]
    assert len(chat_jsonl_requests(path, None, 16)) == 3
    path.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError, match="messages"):
        chat_jsonl_requests(path, None, 16)


# -- statistics ----------------------------------------------------------------------------------


def test_summary_percentiles_and_goodput():
    records = [
        RequestRecord(success=True, prompt_tokens=10, completion_tokens=10, ttft_s=0.1, itl_s=[0.1] * 9, e2e_s=1.0),
        RequestRecord(success=True, prompt_tokens=20, completion_tokens=5, ttft_s=0.3, itl_s=[0.05] * 4, e2e_s=0.5),
        RequestRecord(success=True, prompt_tokens=30, completion_tokens=1, ttft_s=0.2, e2e_s=0.2),
        RequestRecord(error="HTTP 500: boom"),
    ]
    assert [r.tpot_s for r in records] == pytest.approx([0.1, 0.05, None, None])
    slos = SLOs.parse(["ttft:250", "tpot:80"])
    # 1st misses TPOT, 2nd misses TTFT, 3rd has no TPOT (one token) and meets TTFT, 4th failed.
    s = summarize(RunSetting(4, float("inf"), 1.0), records, duration_s=2.0, slos=slos,
                  server=counter_deltas(None, None))
    assert (s.completed, s.failed, s.total_input_tokens, s.total_output_tokens) == (3, 1, 60, 16)
    assert (s.request_throughput, s.output_throughput, s.total_token_throughput) == (1.5, 8.0, 38.0)
    assert s.goodput == 0.5 and s.errors == ["HTTP 500: boom"] and s.request_rate is None and s.name == "c=4"
    assert (s.ttft_ms.mean, s.ttft_ms.p50, s.ttft_ms.p95, s.ttft_ms.p99) == pytest.approx((200, 200, 290, 298))
    assert (s.tpot_ms.mean, s.tpot_ms.p50) == pytest.approx((75, 75))
    assert s.itl_ms.p50 == pytest.approx(100) and s.e2el_ms.p99 == pytest.approx(990)
    assert summarize(RunSetting(None, 2.0, 1.0), records, 2.0, None, {}).goodput is None
    for bad in (["ttft"], ["foo:1"], ["ttft:-1"], ["e2el:x"]):
        with pytest.raises(ValueError, match="--goodput"):
            SLOs.parse(bad)


def test_arrival_offsets():
    assert arrival_offsets(3, float("inf"), 1.0, np.random.default_rng(0)) == [0.0, 0.0, 0.0]
    poisson = np.diff(arrival_offsets(4000, 20.0, 1.0, np.random.default_rng(0)))
    bursty = np.diff(arrival_offsets(4000, 20.0, 0.25, np.random.default_rng(0)))
    assert poisson.mean() == pytest.approx(0.05, rel=0.05) and bursty.mean() == pytest.approx(0.05, rel=0.1)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)  # gamma shape 1/4: CV 2


def test_sweep_settings():
    settings, key = serving.sweep_settings(parse_args(["--max-concurrency", "1,4,16"]))
    assert key == "max_concurrency" and [s.name for s in settings] == ["c=1", "c=4", "c=16"]
    settings, key = serving.sweep_settings(parse_args(["--request-rate", "2,inf", "--max-concurrency", "8"]))
    assert key == "request_rate" and [s.name for s in settings] == ["c=8 rate=2", "c=8"]
    for argv in (["--max-concurrency", "1,2", "--request-rate", "1,2"], ["--max-concurrency", "0"],
                 ["--request-rate", "fast"], ["--burstiness", "0"]):
        with pytest.raises(ValueError):
            serving.sweep_settings(parse_args(argv))


def test_counters_match_by_suffix_and_sum_series():
    text = ("# TYPE vllm:prefix_cache_queries counter\n"
            'vllm:prefix_cache_queries_total{engine="0"} 10\nvllm:prefix_cache_queries_total{engine="1"} 30\n'
            "# TYPE metroserve:prefix_cache_hits counter\nmetroserve:prefix_cache_hits_total 5\n"
            "# TYPE metroserve:spec_decode_num_drafts counter\nmetroserve:spec_decode_num_drafts_total 2\n")
    assert parse_counters(text) == {"prefix_cache_queries": 40, "prefix_cache_hits": 5, "spec_drafts": 2}
    d = counter_deltas({"prefix_cache_queries": 40, "prefix_cache_hits": 5},
                       {"prefix_cache_queries": 60, "prefix_cache_hits": 20})
    assert d["prefix_cache_hit_rate"] == 0.75 and d["spec_acceptance_rate"] is None
    assert all(v is None for v in counter_deltas(None, {"prefix_cache_hits": 1}).values())


# -- the client against fake servers -------------------------------------------------------------


async def _send_to_fake(events: list[str], request: BenchRequest) -> RequestRecord:
    """One request to an aiohttp server that streams `events` as SSE data lines."""
    async def handler(http_request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(http_request)
        for event in events:
            await response.write(f"data: {event}\n\n".encode())
            await asyncio.sleep(0.01)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            return await Target(session, f"http://127.0.0.1:{port}", "m", 0.0, True, []).send(request)
    finally:
        await runner.cleanup()


def test_sse_parsing_usage_fallback_and_error_events():
    text = lambda t: json.dumps({"choices": [{"index": 0, "text": t}]})  # noqa: E731
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    r = asyncio.run(_send_to_fake([text("a"), text(""), text("b"), usage, "[DONE]"], BenchRequest("p", 3)))
    assert r.success and r.prompt_tokens == 7 and r.completion_tokens == 3 and len(r.itl_s) == 1
    assert r.ttft_s is not None and r.e2e_s is not None
    assert 0 < r.ttft_s < r.e2e_s and r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 2)

    chat = lambda t: json.dumps({"choices": [{"index": 0, "delta": {"content": t}}]})  # noqa: E731
    request = BenchRequest([{"role": "user", "content": "q"}], 2)
    r = asyncio.run(_send_to_fake([chat("x"), chat("y"), "[DONE]"], request))
    assert r.success and r.completion_tokens == 2  # no usage chunk: counted chunks

    r = asyncio.run(_send_to_fake([text("a"), json.dumps({"error": {"message": "worker died"}}), "[DONE]"],
                                  BenchRequest("p", 3)))
    assert not r.success and r.error is not None and "worker died" in r.error
    r = asyncio.run(_send_to_fake([text("a")], BenchRequest("p", 3)))
    assert not r.success and r.error is not None and "[DONE]" in r.error


def test_unreachable_server_is_one_line_and_exit_1(capsys):
    assert serving.main(parse_args(["--base-url", f"http://127.0.0.1:{free_port()}"])) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot reach" in err and "\n" not in err


# -- against a real stack ------------------------------------------------------------------------

METRICS = """# TYPE metroserve:prefix_cache_queries counter
metroserve:prefix_cache_queries_total{{worker="0"}} {q}
metroserve:prefix_cache_queries_total{{worker="1"}} {q}
# TYPE metroserve:prefix_cache_hits counter
metroserve:prefix_cache_hits_total{{worker="0"}} {h}
metroserve:prefix_cache_hits_total{{worker="1"}} {h}
# TYPE metroserve:spec_decode_num_draft_tokens counter
metroserve:spec_decode_num_draft_tokens_total {d}
# TYPE metroserve:spec_decode_num_accepted_tokens counter
metroserve:spec_decode_num_accepted_tokens_total {a}
# TYPE metroserve:spec_decode_num_drafts counter
metroserve:spec_decode_num_drafts_total {n}
"""


@pytest.fixture
def metrics_url():
    """A fake Prometheus endpoint per path whose counters grow by fixed steps at each scrape:
    queries 100, 300, 500, ... hits 0, 150, 300, ... (a 75% hit rate between any two scrapes)."""
    scrapes: dict[str, int] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            k = scrapes[self.path] = scrapes.get(self.path, -1) + 1
            body = METRICS.format(q=100 + 200 * k, h=150 * k, d=40 * k, a=30 * k, n=10 * k).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    with ServeStack(tiny_model_dir, log_path=tmp_path_factory.mktemp("serve") / "serve.log") as s:
        yield s


@pytest.mark.service
def test_concurrency_sweep_on_shared_prefixes(stack, tiny_model_dir, metrics_url, tmp_path, capsys):
    out, plots = tmp_path / "on.json", tmp_path / "plots"
    rc = serving.main(parse_args([
        "--base-url", stack.base_url, "--dataset", "shared-prefix", "--tokenizer", str(tiny_model_dir),
        "--num-prefixes", "2", "--suffixes-per-prefix", "3", "--prefix-len", "32", "--suffix-len", "8",
        "--output-len", "4", "--max-concurrency", "1,3", "--goodput", "e2el:60000",
        "--metrics-url", metrics_url + "/a/metrics", "--metrics-url", metrics_url + "/b/metrics",
        "--label", "cache on", "--result-json", str(out), "--plot-dir", str(plots)]))
    assert rc == 0
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["label"] == "cache on" and report["endpoint"] == "/v1/completions"
    assert report["sweep_key"] == "max_concurrency" and report["settings"]["num_prefixes"] == 2
    assert [run["summary"]["name"] for run in report["runs"]] == ["c=1", "c=3"]
    for run in report["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"], s["total_output_tokens"]) == (6, 0, 6 * 4)
        assert 0 < s["ttft_ms"]["p50"] <= s["e2el_ms"]["p50"] and s["tpot_ms"]["p50"] > 0
        assert s["output_throughput"] > 0 and s["goodput"] == pytest.approx(s["request_throughput"])
        # Two URLs x two series x (300 - 100) queries, 150 hits each: summed, then the delta ratio.
        assert s["server"]["prefix_cache_queries"] == 800 and s["server"]["prefix_cache_hits"] == 600
        assert s["server"]["prefix_cache_hit_rate"] == 0.75
        assert s["server"]["spec_acceptance_rate"] == 0.75 and s["server"]["spec_mean_acceptance_length"] == 4.0
        assert all(r["success"] and r["completion_tokens"] == 4 and r["prompt_tokens"] >= 32 and r["error"] is None
                   for r in run["requests"])
    rows = [line for line in stdout.splitlines() if line.startswith("| cache on |")]
    assert len(rows) == 2 and "| label | run |" in stdout and "75.0%" in rows[0]
    for name in ("cache-on-latency_cdf.png", "cache-on-sweep.png"):
        assert (plots / name).stat().st_size > 1000

    off = tmp_path / "off.json"
    off.write_text(json.dumps({**report, "label": "cache off"}))
    table = serving.compare_reports([out, off], plots)
    assert "| cache on | c=1 |" in table and "| cache off | c=3 |" in table
    assert (plots / "compare.png").stat().st_size > 1000 and (plots / "compare.md").read_text().strip() == table


@pytest.mark.service
def test_chat_dataset_and_failed_requests(stack, tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"prompt": "Hello"}\n{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}\n')
    out = tmp_path / "chat.json"
    common = ["--base-url", stack.base_url, "--dataset", "chat-jsonl", "--dataset-path", str(path),
              "--output-len", "5", "--warmup", "0", "--metrics-url", f"http://127.0.0.1:{free_port()}/metrics"]
    assert serving.main(parse_args([*common, "--result-json", str(out)])) == 0
    report = json.loads(out.read_text())
    assert report["endpoint"] == "/v1/chat/completions" and report["runs"][0]["summary"]["completed"] == 2
    assert [r["completion_tokens"] for r in report["runs"][0]["requests"]] == [5, 3]
    assert report["runs"][0]["summary"]["server"]["prefix_cache_hit_rate"] is None
    assert any("cannot read metrics" in note for note in report["notes"])
    # An unknown model fails every request; the run still finishes and keeps the errors.
    assert serving.main(parse_args([*common, "--model", "no-such-model", "--result-json", str(out)])) == 0
    s = json.loads(out.read_text())["runs"][0]["summary"]
    assert (s["completed"], s["failed"]) == (0, 2) and s["errors"][0].startswith("HTTP 4")
