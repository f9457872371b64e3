"""Finished means finished: however a request ends (stop string, length, EOS, client gone), the
worker's counter, the scheduler's request log line, the worker's span and the usage all say what
the client was told."""

from __future__ import annotations

import json

import openai
import pytest

from metroserve.common.tokenizer import load_tokenizer
from tests.stack import ServeStack, metric_value, scrape_metrics, wait_for

pytestmark = pytest.mark.service

PROMPT = [11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def traced_stack(tiny_model_dir, tmp_path_factory):
    from metroserve.benchmarks.observability_overhead import SpanSink

    sink = SpanSink()
    log = tmp_path_factory.mktemp("finish") / "serve.log"
    try:
        with ServeStack(tiny_model_dir, log_path=log, extra_args=["--otlp-endpoint", sink.url],
                        env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as stack:
            yield stack, sink
    finally:
        sink.close()


def _log_line(stack: ServeStack, request_id: str) -> dict | None:
    for line in stack.log_tail(10**7).splitlines():
        if "metroserve.requests:" in line and request_id in line:
            return json.loads(line.split("metroserve.requests: ", 1)[1])
    return None


def _worker_spans(sink, reason: str) -> list[dict]:
    return [s for s in sink.span_records if s["name"] == "worker.request"
            and s["attributes"].get("gen_ai.response.finish_reasons") == [reason]]


def _check(stack, sink, request_id: str, reason: str, completion_tokens: int, counted_before: float,
           spans_before: int) -> None:
    worker = wait_for(lambda: (s := scrape_metrics(stack.metrics_url("worker-0"))) and
                      metric_value(s, "request_success_total", finished_reason=reason) == counted_before + 1 and s,
                      10, f"the worker to count one more {reason!r}")
    assert metric_value(worker, "request_success_total", finished_reason=reason) == counted_before + 1
    record = wait_for(lambda: _log_line(stack, request_id), 10, "the request's log line")
    assert record["finish_reasons"] == [reason]
    assert record["completion_tokens"] == completion_tokens
    wait_for(lambda: len(_worker_spans(sink, reason)) == spans_before + 1, 20,
             f"one more worker span finished as {reason!r}")
    # The worker drops what it generated after the client's stream ended: its span counts the same.
    assert _worker_spans(sink, reason)[-1]["attributes"]["gen_ai.usage.output_tokens"] == completion_tokens


def _counted(stack, sink, reason: str) -> tuple[float, int]:
    """The worker's count of requests finished for `reason`, and its spans so far that say so."""
    return (metric_value(scrape_metrics(stack.metrics_url("worker-0")), "request_success_total",
                         finished_reason=reason), len(_worker_spans(sink, reason)))


def test_stop_length_eos_and_abort_agree_everywhere(traced_stack, tiny_model_dir):
    stack, sink = traced_stack
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    model = client.models.list().data[0].id
    ignore_eos = {"ignore_eos": True}

    # length
    before = _counted(stack, sink, "length")
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=ignore_eos)
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 8
    _check(stack, sink, r.id, "length", 8, *before)
    full_text = r.choices[0].text

    # a stop string found by the gateway: pick one that the greedy text contains past its start
    stop = next(full_text[i:i + 2] for i in range(2, len(full_text) - 1)
                if full_text[i:i + 2].strip() and full_text.find(full_text[i:i + 2]) == i)
    before = _counted(stack, sink, "stop")
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=64, stop=[stop], temperature=0,
                                  extra_body=ignore_eos)
    assert r.choices[0].finish_reason == "stop"
    assert full_text.startswith(r.choices[0].text) and stop not in r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens < 64
    _check(stack, sink, r.id, "stop", r.usage.completion_tokens, *before)

    # EOS, made certain by a logit bias, after min_tokens
    eos = load_tokenizer(tiny_model_dir).eos_token_id
    before = _counted(stack, sink, "stop")
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0,
                                  logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert r.choices[0].finish_reason == "stop" and r.usage is not None
    assert r.usage.completion_tokens == 4  # 3 + the EOS
    _check(stack, sink, r.id, "stop", 4, *before)

    # the client goes away mid-stream
    aborted_before, spans_before = _counted(stack, sink, "abort")
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=1500, stream=True, temperature=0,
                                       extra_body=ignore_eos)
    first = next(iter(stream))
    stream.close()
    worker = wait_for(lambda: (s := scrape_metrics(stack.metrics_url("worker-0"))) and
                      metric_value(s, "request_success_total", finished_reason="abort") == aborted_before + 1 and s,
                      10, "the worker to count the abort")
    assert metric_value(worker, "request_success_total", finished_reason="abort") == aborted_before + 1
    record = wait_for(lambda: _log_line(stack, first.id), 10, "the aborted request's log line")
    assert record["finish_reasons"] == ["abort"]
    wait_for(lambda: len(_worker_spans(sink, "abort")) == spans_before + 1, 20, "a worker span finished as 'abort'")
    assert _worker_spans(sink, "abort")[-1]["attributes"]["gen_ai.usage.output_tokens"] == record["completion_tokens"]
    stack.wait_idle()
