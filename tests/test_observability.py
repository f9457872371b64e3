"""Metrics, traces and request logs of a real stack: scraped numbers equal what was sent."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
from openai.types import CompletionUsage
from prometheus_client.parser import text_string_to_metric_families

from tests.stack import ROOT, ServeStack, wait_for
from tests.stack import metric_value as value
from tests.stack import scrape_metrics as scrape

PREFIX_TOKENS = [(7 * i) % 500 + 3 for i in range(48)]  # three full blocks of 16, shared by every prompt
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ServeStack(tiny_model_dir, log_path=log, extra_args=["--max-model-len", "2048"]) as s:
        yield s


@pytest.mark.service
def test_scraped_counters_equal_the_known_workload(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    model = client.models.list().data[0].id
    prompts = [PREFIX_TOKENS + [400 + i] * (i + 1) for i in range(4)]
    usages: list[CompletionUsage] = []
    # One at a time, so each later prompt finds the shared prefix cached: 48 hit tokens each.
    for prompt in prompts:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                      extra_body={"ignore_eos": True})
        assert r.usage is not None
        usages.append(r.usage)
    n2_prompt = PREFIX_TOKENS + [450, 451]
    r = client.completions.create(model=model, prompt=n2_prompt, max_tokens=MAX_TOKENS, n=2,
                                  extra_body={"ignore_eos": True})
    assert r.usage is not None
    usages.append(r.usage)
    assert len(r.choices) == 2

    sent_prompt_tokens = sum(map(len, prompts)) + len(n2_prompt)
    cached = sum((u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0 for u in usages)
    assert cached == 48 * 4  # the first prompt computes the prefix; the other four reuse it
    assert sum(u.prompt_tokens for u in usages) == sent_prompt_tokens

    worker = wait_for(lambda: (s := scrape(stack.metrics_url("worker-0"))) and
                      value(s, "request_success_total", finished_reason="length") == 6 and s, 10,
                      "the worker to count six finished completions")
    assert value(worker, "request_success_total", finished_reason="length") == 6  # n=2 counts two
    assert value(worker, "request_success_total", finished_reason="abort") == 0
    assert value(worker, "prompt_tokens_total") == sent_prompt_tokens
    assert value(worker, "generation_tokens_total") == 6 * MAX_TOKENS
    assert value(worker, "prefix_cache_queries_total") == sent_prompt_tokens
    assert value(worker, "prefix_cache_hits_total") == cached
    assert value(worker, "time_to_first_token_seconds_count") == 5  # one first token per request
    assert value(worker, "e2e_request_latency_seconds_count") == 5
    assert value(worker, "request_generation_tokens_sum") == 6 * MAX_TOKENS
    # Each completion's tokens after its first are one inter-token gap each.
    assert value(worker, "inter_token_latency_seconds_count") == 6 * (MAX_TOKENS - 1)
    assert value(worker, "num_requests_running") == 0
    assert value(worker, "kv_cache_usage_perc") == 0

    scheduler = scrape(stack.metrics_url("scheduler"))
    assert value(scheduler, "scheduler_placements_total", worker="worker-0") == 5
    assert value(scheduler, "scheduler_placement_prefix_hit_tokens_total", worker="worker-0") == cached
    assert value(scheduler, "scheduler_queue_depth") == 0
    assert value(scheduler, "scheduler_migrations_total") == 0
    gateway = scrape(stack.metrics_url("gateway"))
    assert value(gateway, "gateway_requests_total", route="/v1/completions", status="200") == 5
    assert value(gateway, "gateway_cancellations_total", route="/v1/completions") == 0

    # A client that walks away mid-stream: one abort at the worker, one cancellation at the gateway.
    stream = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=1500, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    worker = wait_for(lambda: (s := scrape(stack.metrics_url("worker-0"))) and
                      value(s, "request_success_total", finished_reason="abort") == 1 and s, 10,
                      "the worker to count the aborted request")
    assert value(worker, "request_success_total", finished_reason="length") == 6
    assert value(worker, "prompt_tokens_total") == sent_prompt_tokens + 3
    assert value(worker, "e2e_request_latency_seconds_count") == 6
    gateway = wait_for(lambda: (s := scrape(stack.metrics_url("gateway"))) and
                       value(s, "gateway_cancellations_total", route="/v1/completions") == 1 and s, 10,
                       "the gateway to count the cancellation")
    assert value(gateway, "gateway_requests_total", route="/v1/completions", status="499") == 1
    assert value(gateway, "gateway_requests_total", route="/v1/completions", status="200") == 5
    stack.wait_idle()


@pytest.mark.service
def test_one_structured_log_line_per_finished_request(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=[9, 8, 7, 6], max_tokens=3, extra_body={"ignore_eos": True})

    def line_for(request_id_prefix):
        for line in stack.log_tail(10**7).splitlines():
            if "metroserve.requests:" in line and request_id_prefix in line:
                return json.loads(line.split("metroserve.requests: ", 1)[1])
        return None

    record = wait_for(lambda: line_for(r.id), 10, "the request's log line")
    assert record["event"] == "request_finished"
    assert record["workers"] == ["worker-0"]
    assert (record["prompt_tokens"], record["completion_tokens"]) == (4, 3)
    assert record["finish_reasons"] == ["length"]
    assert 0 <= record["queue_s"] <= record["e2e_s"]
    assert sum(r.id in line for line in stack.log_tail(10**7).splitlines()) == 1  # one line, none per token


@pytest.mark.service
def test_spans_of_the_three_services_share_one_trace(tiny_model_dir):
    """Gateway, scheduler and worker in one process, exporting to an in-memory span exporter."""
    proc = subprocess.run([sys.executable, "-m", "tests.trace_probe", str(tiny_model_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    spans = json.loads(proc.stdout.strip().splitlines()[-1])
    by_name = {s["name"]: s for s in spans}
    expected = {"POST /v1/completions": "metroserve.gateway", "scheduler.request": "metroserve.scheduler",
                "scheduler.queue": "metroserve.scheduler", "worker.request": "metroserve.worker",
                "worker.queue": "metroserve.worker", "worker.prefill": "metroserve.worker",
                "worker.decode": "metroserve.worker"}
    assert {n: by_name[n]["scope"] for n in expected if n in by_name} == expected
    assert len({s["trace_id"] for s in spans}) == 1, "every span belongs to the request's one trace"
    gateway, scheduler = by_name["POST /v1/completions"], by_name["scheduler.request"]
    worker = by_name["worker.request"]
    assert gateway["parent"] is None
    assert scheduler["parent"] == gateway["span_id"]
    assert by_name["scheduler.queue"]["parent"] == scheduler["span_id"]
    assert worker["parent"] == scheduler["span_id"]
    for phase in ("worker.queue", "worker.prefill", "worker.decode"):
        assert by_name[phase]["parent"] == worker["span_id"]
    assert by_name["worker.prefill"]["end"] <= by_name["worker.decode"]["start"] + 1_000  # ns rounding
    assert worker["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert worker["attributes"]["gen_ai.usage.input_tokens"] == 20
    assert worker["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    assert worker["attributes"]["metroserve.worker"] == "probe-worker"
    assert scheduler["attributes"]["metroserve.worker"] == "probe-worker"
    assert scheduler["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert gateway["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert "gen_ai.request.model" in worker["attributes"]


def test_histogram_buckets_follow_prometheus_le_semantics():
    from metroserve.worker.metrics import Histogram

    h = Histogram([0.1, 1.0])
    h.observe([0.1, 0.05, 0.5, 1.0, 3.0])
    h.observe([])
    assert h.counts.tolist() == [2, 2, 1]  # <= 0.1, (0.1, 1.0], +Inf
    assert h.count == 5 and h.sum == pytest.approx(4.65)
    family = h.family("x_seconds", "doc", {"model_name": "m"})
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert buckets == {"0.1": 2, "1.0": 4, "+Inf": 5}


def test_engine_collector_reports_speculation_and_respects_disable_log_stats(tiny_model_dir):
    from prometheus_client import CollectorRegistry, generate_latest

    from metroserve import LLM, SamplingParams
    from metroserve.worker.metrics import EngineCollector

    llm = LLM(model=str(tiny_model_dir), kv_cache_memory="32MiB",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "min_acceptance_rate": 0.0})
    registry = CollectorRegistry()
    registry.register(EngineCollector(llm.engine, {"model_name": "tiny"}))
    # Repetitive text: the n-gram proposer finds drafts in it.
    prompt = llm.get_tokenizer().encode("The module provides the module provides the module")
    outs = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    spec = llm.engine.stats().spec_decode
    assert spec.num_draft_tokens > 0
    assert samples[("metroserve:spec_decode_num_draft_tokens_total", None)] == spec.num_draft_tokens
    assert samples[("metroserve:spec_decode_num_accepted_tokens_total", None)] == spec.num_accepted_tokens
    assert samples[("metroserve:spec_decode_num_drafts_total", None)] == spec.num_drafts
    # Tokens count once however many a verification step accepted.
    assert samples[("metroserve:generation_tokens_total", None)] == len(outs[0].outputs[0].token_ids) == 24
    assert samples[("metroserve:request_success_total", "length")] == 1

    quiet = LLM(model=str(tiny_model_dir), kv_cache_memory="32MiB", disable_log_stats=True)
    quiet.generate([prompt], SamplingParams(max_tokens=4))
    assert quiet.engine.metrics is None
    registry = CollectorRegistry()
    registry.register(EngineCollector(quiet.engine, {"model_name": "tiny"}))
    names = {s.name for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert "metroserve:num_requests_running" in names and "metroserve:generation_tokens_total" not in names


@pytest.mark.service
def test_serve_exports_one_trace_per_request_from_three_processes(tiny_model_dir, tmp_path):
    """The deployed path: --otlp-endpoint on serve reaches each process, and the context crosses
    the gateway -> scheduler metadata and the scheduler -> worker stream."""
    from metroserve.benchmarks.observability_overhead import SpanSink

    sink = SpanSink()
    try:
        with ServeStack(tiny_model_dir, log_path=tmp_path / "serve.log", extra_args=["--otlp-endpoint", sink.url],
                        env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as stack:
            client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
            model = client.models.list().data[0].id
            client.completions.create(model=model, prompt=[3, 4, 5, 6], max_tokens=4, extra_body={"ignore_eos": True})

            expected = {("metroserve-gateway", "POST /v1/completions"),
                        ("metroserve-scheduler", "scheduler.request"), ("metroserve-scheduler", "scheduler.queue"),
                        ("metroserve-worker", "worker.request"), ("metroserve-worker", "worker.prefill"),
                        ("metroserve-worker", "worker.decode")}

            def names_by_trace():
                traces: dict[str, set[tuple[str, str]]] = {}
                for service, name, trace in sink.spans:
                    traces.setdefault(trace, set()).add((service, name))
                return traces

            # Each process exports in its own batches, so spans of one trace arrive at different times:
            # wait for the whole set rather than for the first span of each service.
            try:
                wait_for(lambda: any(names >= expected for names in names_by_trace().values()), 20,
                         "every span of the request under one trace id")
            except AssertionError as e:
                raise AssertionError(f"{e}; received {sink.spans}; serve log: {stack.log_tail()}") from None
            request_traces = {t for _, name, t in sink.spans if name in ("POST /v1/completions", "worker.decode")}
            assert len(request_traces) == 1, sink.spans
            trace_id = request_traces.pop()
            assert names_by_trace()[trace_id] >= expected
            # The request's log line names its trace (log lines are flushed in blocks: poll).
            wait_for(lambda: f'"trace_id": "{trace_id}"' in stack.log_tail(10**7), 10,
                     "the request's log line naming its trace")
    finally:
        sink.close()
