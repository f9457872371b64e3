"""The REST API's published contract (services/openapi.py): GET /openapi.json is a valid OpenAPI 3.1
document of exactly the routes the app registers, the server enforces the request schemas it
publishes (a violation is a 400 naming the field), GET /docs renders every route, both are open
without the API key, and a schemathesis run of 500+ generated requests against `metroserve serve`
with SmolLM2 gets no 5xx and no response outside the documented statuses, media types and schemas."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from collections import Counter

import pytest

from metroserve.services.openai_api import BadRequest
from metroserve.services.openapi import (
    REQUEST_EXAMPLES,
    REQUEST_SCHEMAS,
    documented_routes,
    openapi_document,
    validate_body,
)
from tests.stack import ServeStack

API_KEY = "sekret"
# Generated requests per operation (hypothesis max_examples): the POST routes get most, the GET
# routes without parameters have one distinct request each. Positive (schema-valid) and negative.
# METROSERVE_FUZZ_SCALE multiplies them (4: the 2,000-request run, benchmarks/README.md).
SCALE = int(os.environ.get("METROSERVE_FUZZ_SCALE", "1"))
EXAMPLES = {k: v * SCALE for k, v in {"POST /v1/completions": 150, "POST /v1/chat/completions": 150,
                                      "POST /tokenize": 70, "POST /detokenize": 50,
                                      "GET /v1/models/{model_id}": 40}.items()}
NEGATIVE = {k: v * SCALE for k, v in {"POST /v1/completions": 30, "POST /v1/chat/completions": 30,
                                      "POST /tokenize": 15, "POST /detokenize": 15}.items()}
TOTAL = 500 * SCALE
GENERATION = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from metroserve.common.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


def _rest_api(tokenizer, api_key: str | None = None):
    from metroserve.services.gateway_metrics import GatewayMetrics
    from metroserve.services.http_limits import HttpLimits
    from metroserve.services.rest import RestAPI

    return RestAPI(None, tokenizer, "m", 8192, api_key, HttpLimits(max_body_bytes=1 << 20), GatewayMetrics())  # type: ignore[arg-type]


def _app_routes(app) -> set[tuple[str, str]]:
    return {(route.method, route.resource.canonical) for route in app.router.routes()
            if route.method != "HEAD" and route.resource is not None}


# -- in process: no stack -------------------------------------------------------------------------


def test_document_lists_exactly_the_app_routes(tokenizer):
    app = _rest_api(tokenizer).app()
    assert documented_routes() == _app_routes(app)
    posts = {path for method, path in _app_routes(app) if method == "POST"}
    assert posts == set(REQUEST_SCHEMAS), "every JSON body route validates against a published schema"


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "tools": [{"type": "function", "function": {}}]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "logprobs": 3}, "logprobs"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_a_schema_violation_names_the_field(route, body, param):
    with pytest.raises(BadRequest) as e:
        validate_body(route, body)
    assert e.value.param == param, str(e.value)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": None, "stop": "\n", "unknown_field": {"any": 1},
                         "logit_bias": {"42": -100}, "structured_outputs": {"regex": "[a-z]+"}}),
    ("/v1/completions", {"prompt": [[1, 2], "text"], "prompt_logprobs": 1, "echo": True, "best_of": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                           {"role": "assistant", "content": None, "tool_calls": [
                                               {"id": "c1", "type": "function",
                                                "function": {"name": "f", "arguments": "{}"}}]},
                                           {"role": "tool", "content": "42", "tool_call_id": "c1"}],
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}},
                              "stream": True, "stream_options": {"include_usage": True}}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}),
    ("/detokenize", {"tokens": [1, 2, 3]}),
])
def test_valid_bodies_pass(route, body):
    validate_body(route, body)


def test_request_examples_are_valid():
    for route, (name, _) in REQUEST_SCHEMAS.items():
        for example in REQUEST_EXAMPLES[name].values():
            validate_body(route, example)


def test_openapi_and_docs_are_open_without_the_api_key_and_bodies_are_checked_behind_it(tokenizer):
    from aiohttp.test_utils import TestClient, TestServer

    async def run():
        async with TestClient(TestServer(_rest_api(tokenizer, API_KEY).app())) as client:
            spec = await client.get("/openapi.json")
            assert spec.status == 200 and spec.content_type == "application/json"
            assert await spec.json() == json.loads(json.dumps(openapi_document()))
            docs = await client.get("/docs")
            assert docs.status == 200 and docs.content_type == "text/html"
            assert (await client.get("/tokenizer_info")).status == 401
            bad = await client.post("/v1/completions", json={"prompt": "x", "n": 0},
                                    headers={"Authorization": f"Bearer {API_KEY}"})
            assert bad.status == 400
            assert (await bad.json())["error"]["param"] == "n"

    asyncio.run(run())


# -- against `metroserve serve` ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    with ServeStack(smollm2_dir, workers=1, log_path=tmp_path_factory.mktemp("serve") / "serve.log") as s:
        yield s


def _origin(stack) -> str:
    return stack.base_url.removesuffix("/v1")


def _get(stack, path: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(_origin(stack) + path, timeout=30) as reply:
        return reply.status, reply.headers.get_content_type(), reply.read()


@pytest.mark.service
def test_served_document_is_valid_openapi_31_of_the_app_routes(stack, tokenizer):
    import schemathesis

    status, content_type, body = _get(stack, "/openapi.json")
    assert (status, content_type) == (200, "application/json")
    served = json.loads(body)
    assert served["openapi"].startswith("3.1")
    schema = schemathesis.openapi.from_url(_origin(stack) + "/openapi.json")
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    served_routes = {(method.upper(), path) for path, item in served["paths"].items()
                     for method in item if method != "parameters"}
    assert served_routes == _app_routes(_rest_api(tokenizer).app())


@pytest.mark.service
def test_docs_page_mentions_every_route(stack):
    status, content_type, body = _get(stack, "/docs")
    assert (status, content_type) == (200, "text/html")
    page = body.decode()
    assert 'href="/openapi.json"' in page and "<script" not in page
    for method, path in documented_routes():
        assert f'<span class="m">{method}</span>{path}' in page, (method, path)


def _cheap(case) -> None:
    """Keep generation short on CPU: at most 2 new tokens, n <= 2, at most 3 prompts. The values
    stay inside the published schema, so a valid case stays valid."""
    body = case.body
    if case.path not in GENERATION or not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            body[name] = min(value, 2)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 1  # chat's default is the whole context
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
        body["n"] = 2
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        body["prompt"] = prompt[:3]


def _greedy_text(session, stack) -> str:
    reply = session.post(stack.base_url + "/completions", timeout=120,
                         json={"prompt": "The paged KV cache", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.service
def test_schemathesis_finds_no_server_error_and_no_undocumented_response(stack):
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )
    from schemathesis.core.result import Ok

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_url(_origin(stack) + "/openapi.json")
    session = requests.Session()
    before = _greedy_text(session, stack)
    counts: Counter[str] = Counter()
    statuses: Counter[tuple[str, int]] = Counter()
    failures: list[str] = []

    def run(operation, strategy, examples: int, kind: str) -> None:
        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def one(case) -> None:
            _cheap(case)
            counts[operation.label] += 1
            try:
                response = case.call(base_url=_origin(stack), session=session, timeout=120)
            except requests.RequestException as e:  # no answer in time: a finding too, with its body
                failures.append(f"{operation.label} {kind} body={json.dumps(case.body)[:2000]} -> {e!r:.300}")
                return
            statuses[(operation.label, response.status_code)] += 1
            try:
                case.validate_response(response, checks=checks)
                assert kind != "example" or response.status_code == 200, "a documented example was refused"
            except Exception as e:  # collect every finding, not only the first
                failures.append(f"{operation.label} {kind} body={json.dumps(case.body)[:600]} -> "
                                f"{response.status_code} {response.text[:400]!r}: {str(e)[:600]}")

        one()

    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # an operation schemathesis cannot read
        operation = result.ok()
        for example in operation.get_strategies_from_examples():  # the document's request examples
            run(operation, example, 1, "example")
        run(operation, operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
            EXAMPLES.get(operation.label, 3), "positive")
        if operation.label in NEGATIVE:
            run(operation, operation.as_strategy(generation_mode=GenerationMode.NEGATIVE), NEGATIVE[operation.label],
                "negative")
    total = sum(counts.values())
    print(f"\nschemathesis: {total} requests; by operation {dict(counts)}; statuses {dict(statuses)}")
    assert not failures, f"{len(failures)} of {total} responses failed a check:\n" + "\n".join(failures[:30])
    assert total >= TOTAL, counts
    # schemathesis leaves out the operation that serves the schema itself (checked above)
    assert set(counts) == {f"{m} {p}" for m, p in documented_routes()} - {"GET /openapi.json"}
    assert _greedy_text(session, stack) == before
    assert "restarting it" not in stack.log_tail(10**8), "serve restarted a process"


def test_a_logprob_of_minus_infinity_is_written_as_vllms_minus_9999(tokenizer):
    """A token a grammar masked has logprob -inf, which JSON cannot carry (json.dumps writes the
    invalid -Infinity; a browser's JSON.parse refuses it)."""
    from metroserve.rpc import generation_pb2
    from metroserve.services.openai_api import MIN_LOGPROB, LogprobsRenderer

    entry = generation_pb2.TokenLogprobs(token_ids=[5, 6, 7], logprobs=[-0.5, float("-inf"), -1.0])
    render = LogprobsRenderer(tokenizer, 3, tokens_as_ids=True)
    completion = render.completion([entry])
    chat = render.chat([entry])
    prompt = render.prompt_logprobs([entry])
    values = [*completion["top_logprobs"][0].values(), *(t["logprob"] for t in chat["content"][0]["top_logprobs"]),
              *(v["logprob"] for v in prompt[1].values())]
    assert MIN_LOGPROB in values and min(values) == MIN_LOGPROB == -9999.0
    json.loads(json.dumps([completion, chat, prompt]), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
