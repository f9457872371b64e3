"""Invariant 3 at the service edge: bad input to a running `metroserve serve` stack gets a 400 with an
OpenAI-style error body (gRPC: INVALID_ARGUMENT; an unknown model: 404, NOT_FOUND, see
test_http_basics.py), never a 500 and never a crash; unknown fields are ignored as OpenAI's API
does; the stack keeps serving correctly afterwards."""

from __future__ import annotations

import http.client
import json
from typing import Any

import grpc
import openai
import pytest

from metroserve.rpc import generation_pb2, generation_pb2_grpc
from tests.stack import ServeStack

pytestmark = pytest.mark.service

VOCAB = 512  # the tiny model's vocabulary
CONTEXT = 2048  # the tiny model's max_position_embeddings
MAX_BODY_BYTES = 8 << 20  # the gateway's default --max-body-bytes
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {COMPLETIONS: {"prompt": "Hello there", "max_tokens": 4},
        CHAT: {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}}
NORMAL = {"prompt": "The paged KV cache", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
LONG_TEXT = "hello world " * 1200  # ~2400+ tokens with the tiny tokenizer: over the 2048 context


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    with ServeStack(tiny_model_dir, workers=1, log_path=tmp_path_factory.mktemp("serve") / "serve.log") as s:
        yield s


@pytest.fixture(scope="module")
def model_id(stack) -> str:
    status, _, body = post(stack, "/v1/models", None, method="GET")
    assert status == 200, body
    return body["data"][0]["id"]


@pytest.fixture(scope="module")
def baseline(stack) -> dict:
    """A greedy completion taken before any bad input (the first test to ask for it runs it)."""
    status, _, body = post(stack, COMPLETIONS, NORMAL)
    assert status == 200, body
    return body


def post(stack: ServeStack, path: str, body, method: str = "POST") -> tuple[int, str, Any]:
    """Raw HTTP: dict bodies are JSON-encoded, bytes are sent as is. Returns (status, content type, JSON);
    a reply that is not JSON comes back as {"_raw": its first 500 bytes}."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=60)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        reply = conn.getresponse()
        raw = reply.read()
        ctype = reply.getheader("Content-Type", "")
    finally:
        conn.close()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    return reply.status, ctype, parsed if parsed is not None else {"_raw": raw[:500].decode(errors="replace")}


def assert_openai_400(status: int, ctype: str, body: dict) -> None:
    assert_openai_error(status, ctype, body, expected=400)


def assert_openai_error(status: int, ctype: str, body: dict, expected: int) -> None:
    assert status == expected, body
    assert ctype.startswith("application/json"), ctype  # a plain error, never an SSE stream
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err


def test_normal_request_before_bad_input(stack, baseline):
    """Takes the baseline the last test compares against."""
    assert baseline["choices"][0]["text"]
    assert baseline["usage"]["completion_tokens"] == NORMAL["max_tokens"]


# -- REST: each bad body, on both endpoints, streaming or not ---------------------------------------

# id -> overrides merged into BASE[endpoint]; endpoint-specific ones say which endpoints they apply to.
FIELD_CASES = {
    "temperature-str": {"temperature": "hot"},
    "max_tokens-str": {"max_tokens": "10"},
    "n-float": {"n": 1.5},
    "logit_bias-list": {"logit_bias": [1, 2]},
    "n-too-large": {"n": 1000},
    "max_tokens-negative": {"max_tokens": -5},
    "max_tokens-zero-with-n": {"max_tokens": 0, "n": 2},
    "stop-int": {"stop": 5},
    "stop-empty-string": {"stop": [""]},
    "stop-int-list": {"stop": [1, 2]},
    "top_p-2": {"top_p": 2},
    "max_tokens-past-context": {"max_tokens": CONTEXT + 10},
}
COMPLETION_ONLY = {
    "prompt-number": {"prompt": 42},
    "prompt-ids-too-long": {"prompt": [5] * 2100},
    "prompt-text-too-long": {"prompt": LONG_TEXT},
    "prompt-id-outside-vocab": {"prompt": [5, 6, VOCAB]},
    "prompt-id-negative": {"prompt": [5, -1]},
    "prompt-empty": {"prompt": ""},
    "prompt-list-one-too-long": {"prompt": ["fine", [5] * 2100]},
    "prompt-list-mixed-types": {"prompt": ["fine", 5]},
    "logprobs-bool": {"logprobs": True},
}
CHAT_ONLY = {
    "messages-not-a-list": {"messages": "hello"},
    "messages-empty": {"messages": []},
    "message-role-missing": {"messages": [{"content": "hi"}]},
    "chat-text-too-long": {"messages": [{"role": "user", "content": LONG_TEXT}]},
    "max_completion_tokens-negative": {"max_completion_tokens": -1},
    "message-content-int": {"messages": [{"role": "user", "content": 5}]},
    "message-image-part": {"messages": [{"role": "user",
                                         "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "top_logprobs-without-logprobs": {"top_logprobs": 2},
}


def _cases():
    for endpoint in (COMPLETIONS, CHAT):
        only = COMPLETION_ONLY if endpoint == COMPLETIONS else CHAT_ONLY
        for name, overrides in {**FIELD_CASES, **only}.items():
            for stream in (False, True):
                yield pytest.param(endpoint, overrides, stream, id=f"{endpoint.rsplit('/', 1)[1]}-{name}-"
                                   f"{'stream' if stream else 'plain'}")


@pytest.mark.parametrize("endpoint, overrides, stream", list(_cases()))
def test_bad_field_gets_400(stack, endpoint, overrides, stream):
    body = {**BASE[endpoint], **overrides}
    if stream:
        body["stream"] = True
    assert_openai_400(*post(stack, endpoint, body))


@pytest.mark.parametrize("overrides, param", [
    ({"top_p": 2}, "top_p"),  # checked at the gateway
    ({"prompt": [5, 6, VOCAB]}, "prompt"),  # checked against the model's limits at the scheduler's admission
    ({"max_tokens": 100_000}, "max_tokens"),
])
def test_the_error_names_its_field_from_either_check(stack, overrides, param):
    status, ctype, body = post(stack, COMPLETIONS, {**BASE[COMPLETIONS], **overrides})
    assert_openai_400(status, ctype, body)
    assert body["error"]["param"] == param, body


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("raw", [b"{not json", b'{"prompt": "x",', b"\xff\xfe", b"", b"[1, 2]", b'"a string"', b"null"],
                         ids=["malformed", "truncated", "not-utf8", "empty", "array", "string", "null"])
def test_body_that_is_not_a_json_object_gets_400(stack, endpoint, raw):
    assert_openai_400(*post(stack, endpoint, raw))



def _nested(depth: int) -> str:
    """JSON text of `depth` nested objects: {"a": {"a": ... {} ...}}."""
    return '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)


def _deep_schema(depth: int) -> str:
    """A JSON schema nesting `depth` object levels (the grammar engine's compile time grows steeply
    with this: 2,000 levels did not compile in 120 s)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("depth", [100, 100_000])  # past the 64-level bound; past Python's recursion limit
def test_a_body_nested_past_the_bound_gets_400(stack, endpoint, depth):
    base = json.dumps(BASE[endpoint])
    raw = (base[:-1] + ', "metadata": ' + _nested(depth) + "}").encode()
    status, ctype, reply = post(stack, endpoint, raw)
    assert_openai_400(status, ctype, reply)
    assert "nests deeper than 64" in reply["error"]["message"] or "not valid JSON" in reply["error"]["message"]


def test_a_body_nested_within_the_bound_is_served(stack):
    raw = (json.dumps(BASE[COMPLETIONS])[:-1] + ', "metadata": ' + _nested(60) + "}").encode()
    status, _, reply = post(stack, COMPLETIONS, raw)
    assert status == 200, reply


def test_an_array_past_the_bound_gets_400(stack):
    """2^20 + 1 token ids fit in the body limit (2 MB) but not the array bound."""
    raw = b'{"max_tokens": 4, "prompt": [' + b"5," * (1 << 20) + b"5]}"
    assert len(raw) < MAX_BODY_BYTES
    status, ctype, reply = post(stack, COMPLETIONS, raw)
    assert_openai_400(status, ctype, reply)
    assert reply["error"]["code"] == "json_too_deep_or_long"
    assert "1048577 items" in reply["error"]["message"]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("raw", [b'"\xc3\x28"', b'"ok \xff"', b'"\xed\xa0\x80"', b'"a \\ud800 b"'],
                         ids=["bad-continuation", "stray-byte", "encoded-surrogate", "escaped-lone-surrogate"])
def test_invalid_utf8_inside_a_string_gets_400(stack, endpoint, raw):
    body = (b'{"prompt": ' + raw + b', "max_tokens": 4}' if endpoint == COMPLETIONS
            else b'{"messages": [{"role": "user", "content": ' + raw + b'}], "max_tokens": 4}')
    assert_openai_400(*post(stack, endpoint, body))


def test_an_escaped_surrogate_pair_is_served(stack):
    """What json.dumps sends for an emoji by default: one character, not an encoding error."""
    status, _, reply = post(stack, COMPLETIONS, b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert status == 200, reply


@pytest.mark.parametrize("field, value", [
    ("guided_json", _deep_schema(100)),
    ("guided_json", _deep_schema(2000)),
    ("guided_json", '{"a": ' * 100_000 + "1" + "}" * 100_000),  # past Python's recursion limit
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep_schema(2000)}}),
    ("structured_outputs", {"json": _deep_schema(100)}),
], ids=["guided_json-100", "guided_json-2000", "guided_json-100000", "response_format-2000",
        "structured_outputs-100"])
def test_a_json_schema_nested_past_the_bound_gets_400(stack, field, value):
    """Refused at the edge in well under the time the grammar engine would take to compile it."""
    status, ctype, reply = post(stack, COMPLETIONS, {**BASE[COMPLETIONS], field: value})
    assert_openai_400(status, ctype, reply)
    assert reply["error"]["param"] == field
    assert "nests deeper than 64" in reply["error"]["message"] or "not valid JSON" in reply["error"]["message"]


def test_a_json_schema_within_the_bound_is_served(stack):
    status, _, reply = post(stack, COMPLETIONS, {**BASE[COMPLETIONS], "max_tokens": 8, "guided_json": _deep_schema(8)})
    assert status == 200, reply


@pytest.mark.parametrize("stop, fragment", [(["s"] * 65, "at most 64"), (["x" * 1025], "at most 1024 characters")],
                         ids=["65-strings", "1025-chars"])
def test_stop_strings_past_the_bound_get_400(stack, stop, fragment):
    status, ctype, reply = post(stack, COMPLETIONS, {**BASE[COMPLETIONS], "stop": stop})
    assert_openai_400(status, ctype, reply)
    assert reply["error"]["param"] == "stop" and fragment in reply["error"]["message"]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("value", ["yes", 1, "true"])
def test_stream_of_the_wrong_type_gets_400(stack, endpoint, value):
    assert_openai_400(*post(stack, endpoint, {**BASE[endpoint], "stream": value}))


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
def test_oversized_body_gets_413(stack, endpoint, stream):
    body = dict(BASE[endpoint])
    body["stream"] = stream
    body["padding"] = "a" * (MAX_BODY_BYTES + 1024)  # an unknown field: only the size is wrong
    status, ctype, reply = post(stack, endpoint, body)
    assert_openai_error(status, ctype, reply, expected=413)
    assert reply["error"]["code"] == "body_too_large"


def _admission_counts(stack: ServeStack) -> tuple[int, int]:
    status = stack.cluster_status()
    return status.num_admitted, status.num_rejected


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompts, n, param", [
    (["hi"] * 100_000, 1, "prompt"),         # more prompts than --max-sequences-per-request (1024)
    ([[1, 2, 3]] * 100_000, 1, "prompt"),   # token id prompts alike
    (["hi"] * 100, 16, "n"),                 # few prompts, but prompts x n = 1600 sequences
])
def test_a_batch_past_the_sequence_bound_is_refused_whole_before_admission(stack, prompts, n, param, stream):
    """One 400 naming the field, and the scheduler hears of none of the batch's prompts."""
    before = _admission_counts(stack)
    status, ctype, reply = post(stack, COMPLETIONS, {"prompt": prompts, "n": n, "max_tokens": 4, "stream": stream})
    assert_openai_400(status, ctype, reply)
    assert reply["error"]["param"] == param
    assert "--max-sequences-per-request" in reply["error"]["message"]
    assert _admission_counts(stack) == before


def test_a_batch_at_the_sequence_bound_is_served(stack):
    """The bound counts sequences: 64 prompts x n=16 = 1024 is allowed (and answered in full)."""
    status, _, reply = post(stack, COMPLETIONS, {"prompt": ["Hi"] * 64, "n": 16, "max_tokens": 1, "temperature": 1.0,
                                                 "seed": 1})
    assert status == 200, reply
    assert sorted(c["index"] for c in reply["choices"]) == list(range(64 * 16))


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_gets_404_naming_the_model(stack, endpoint, stream):
    status, ctype, body = post(stack, endpoint, {**BASE[endpoint], "model": "no-such-model", "stream": stream})
    assert_openai_error(status, ctype, body, expected=404)
    assert body["error"]["param"] == "model" and "no-such-model" in body["error"]["message"]


def test_too_long_prompt_error_names_the_context_length(stack):
    status, ctype, body = post(stack, COMPLETIONS, {**BASE[COMPLETIONS], "prompt": [5] * 2100})
    assert_openai_400(status, ctype, body)
    assert "2100" in body["error"]["message"] and str(CONTEXT) in body["error"]["message"]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_unknown_fields_are_ignored(stack, endpoint, model_id):
    body = {**BASE[endpoint], "model": model_id, "foo": 1, "user": "x", "metadata": {"a": "b"},
            "response_format": {"type": "text"}, "service_tier": "auto", "store": False}
    status, _, reply = post(stack, endpoint, body)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert reply["usage"]["completion_tokens"] >= 1
    assert choice["finish_reason"] in ("length", "stop")


def test_openai_client_raises_bad_request(stack, model_id):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_id, prompt="hi", max_tokens=-1)
    assert err.value.status_code == 400 and "max_tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=-1, stream=True)
    assert err.value.status_code == 400 and "max_tokens" in err.value.message


# -- gRPC ---------------------------------------------------------------------------------------------


def _grpc_generate(address: str, request: generation_pb2.GenerateRequest) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30))
    return err.value


def _params(**kwargs) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(max_tokens=4, **kwargs)


GRPC_CASES = {
    "no-prompt": generation_pb2.GenerateRequest(params=_params()),
    "top_p-2": generation_pb2.GenerateRequest(text="hi", params=_params(top_p=2.0)),
    "prompt-ids-too-long": generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5] * 2100),
                                                          params=_params()),
    "prompt-id-outside-vocab": generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, VOCAB]),
                                                              params=_params()),
    "n-too-large": generation_pb2.GenerateRequest(text="hi", params=_params(n=1000)),
    "max_tokens-zero-with-n": generation_pb2.GenerateRequest(text="hi", params=generation_pb2.SamplingParams(
        max_tokens=0, n=2)),
    "empty-text": generation_pb2.GenerateRequest(text="", params=_params()),
    "schema-nested-2000": generation_pb2.GenerateRequest(text="hi", params=_params(
        structured_outputs=generation_pb2.StructuredOutputs(json=_deep_schema(2000)))),
    "schema-past-recursion-limit": generation_pb2.GenerateRequest(text="hi", params=_params(
        structured_outputs=generation_pb2.StructuredOutputs(json="[" * 100_000 + "]" * 100_000))),
    "stop-65-strings": generation_pb2.GenerateRequest(text="hi", params=_params(stop=["s"] * 65)),
}


@pytest.mark.parametrize("name", list(GRPC_CASES))
def test_grpc_gateway_invalid_argument(stack, name):
    err = _grpc_generate(f"127.0.0.1:{stack.grpc_port}", GRPC_CASES[name])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert err.details()


def test_grpc_gateway_refuses_bad_token_ids(stack):
    """Token ids go to the scheduler's admission, which checks them against the workers' limits."""
    err = _grpc_generate(f"127.0.0.1:{stack.grpc_port}", generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[5] * 2100), params=_params()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- tokenize / detokenize / models / health ------------------------------------------------------------


def test_tokenize_then_detokenize_round_trips(stack):
    text = "The quick brown fox jumps over the lazy dog."
    status, _, tok = post(stack, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200, tok
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == CONTEXT
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in tok["tokens"])
    status, _, detok = post(stack, "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200, detok
    assert detok["prompt"] == text


def test_tokenize_chat_messages(stack):
    status, _, tok = post(stack, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, tok
    assert tok["count"] == len(tok["tokens"]) > 2  # the template adds role markers around "hi"


@pytest.mark.parametrize("path, body", [
    ("/detokenize", {"tokens": [-1]}),
    ("/detokenize", {"tokens": [5, VOCAB]}),
    ("/detokenize", {"tokens": "abc"}),
    ("/detokenize", {"tokens": [True]}),
    ("/detokenize", {}),
    ("/detokenize", b"{not json"),
    ("/tokenize", {"prompt": 5}),
    ("/tokenize", {}),
    ("/tokenize", {"messages": "hi"}),
    ("/tokenize", b"[1]"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else (v.decode() if isinstance(v, bytes) else v))
def test_tokenize_detokenize_bad_input_gets_400(stack, path, body):
    assert_openai_400(*post(stack, path, body))


def test_models_lists_one_model(stack, model_id):
    status, _, body = post(stack, "/v1/models", None, method="GET")
    assert status == 200
    assert body["object"] == "list" and len(body["data"]) == 1
    assert body["data"][0]["id"] == model_id and body["data"][0]["max_model_len"] == CONTEXT


def test_health(stack):
    status, _, body = post(stack, "/health", None, method="GET")
    assert status == 200 and body == {"status": "ok"}


def test_unknown_route_gets_openai_style_404(stack):
    status, _, body = post(stack, "/v1/nope", {})
    assert status == 404 and isinstance(body["error"]["message"], str)


# -- after all of that ------------------------------------------------------------------------------------


def test_stack_still_serves_correctly_after_bad_input(stack, baseline):
    """Nothing above crashed a process, leaked a block or changed what a normal request gets."""
    assert stack.proc.poll() is None, stack.log_tail()
    assert stack.healthy()
    status, _, body = post(stack, COMPLETIONS, NORMAL)
    assert status == 200, body
    text = body["choices"][0]["text"]
    assert text and text == baseline["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == NORMAL["max_tokens"]
    status, _, chat = post(stack, CHAT, {**BASE[CHAT], "temperature": 0, "ignore_eos": True})
    assert status == 200 and chat["choices"][0]["message"]["content"], chat
    status = stack.wait_idle()
    assert status.num_rejected > 0  # the scheduler did see (and refuse) some of the bad requests
    log = stack.log_tail(10**7)
    assert "Traceback" not in log and "Error handling request" not in log, log[-4000:]


# -- known bug: integers outside the wire types' range ----------------------------------------------------

OUT_OF_RANGE: dict[str, dict[str, Any]] = {
    "max_tokens": {"max_tokens": 2**31},
    "seed": {"seed": 2**64},
    "priority": {"priority": 2**31},
    "stop_token_ids": {"stop_token_ids": [2**31]},
    "logit_bias-key": {"logit_bias": {str(2**31): 1}},
    "prompt-token-id": {"prompt": [5, 2**31]},
}


@pytest.mark.parametrize("name", list(OUT_OF_RANGE))
def test_integer_out_of_wire_range_gets_400(stack, name):
    """Runs after the log check above, since today each of these logs a traceback in the gateway."""
    assert_openai_400(*post(stack, COMPLETIONS, {**BASE[COMPLETIONS], **OUT_OF_RANGE[name]}))
    assert stack.proc.poll() is None
