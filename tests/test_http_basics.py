"""The gateway's HTTP basics that vLLM / OpenAI users expect: 404 model_not_found (gRPC NOT_FOUND),
GET /version, GET /v1/models/{id}, GET /tokenizer_info, CORS (--allowed-origins ...), X-Request-Id
and gRPC server reflection. One stack of real processes on loopback for the module: a scheduler, a
mock worker (torch-free) and a gateway with the tiny model's tokenizer, an API key and CORS on."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import grpc
import openai
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from metroserve.rpc import generation_pb2, generation_pb2_grpc
from metroserve.services.cors import CorsPolicy, parse_list
from tests.stack import ROOT, free_port, wait_for

MODEL = "metro/tiny"  # with a '/': the client sends it as %2F in /v1/models/{id}
API_KEY = "sekret"
ORIGIN, OTHER_ORIGIN = "https://app.example", "https://evil.example"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
VOCAB = 512  # the tiny model's vocabulary
UUID_HEX = re.compile(r"[0-9a-f]{32}")


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self):
        return json.loads(self.body)


@dataclass
class Gateway:
    port: int
    grpc_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={**({"Content-Type": "application/json"} if data else {}),
                                                           **(headers or {})})
            reply = conn.getresponse()
            return Reply(reply.status, reply.headers, reply.read())  # a stream: read to its end
        finally:
            conn.close()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=API_KEY, max_retries=0)


def _spawn(log_dir: Path, name: str, argv: list[str]) -> subprocess.Popen:
    from metroserve.services.serve import die_with_parent

    with open(log_dir / f"{name}.log", "wb") as log:  # the child writes through its own descriptor
        return subprocess.Popen([sys.executable, "-m", "metroserve.services.cli", *argv], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "OTEL_SDK_DISABLED": "true"},
                                preexec_fn=die_with_parent)


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, tmp_path_factory) -> Iterator[Gateway]:
    from metroserve.services.serve import stop_in_order

    log_dir = tmp_path_factory.mktemp("http-basics")
    scheduler = f"127.0.0.1:{free_port()}"
    gw = Gateway(free_port(), free_port())
    procs = {"scheduler": _spawn(log_dir, "scheduler", ["scheduler", "--port", scheduler.split(":")[1]]),
             "worker": _spawn(log_dir, "worker", ["worker", "--engine", "mock", "--scheduler", scheduler,
                                                  "--served-model-name", MODEL, "--mock-vocab-size", str(VOCAB)]),
             "gateway": _spawn(log_dir, "gateway", [
                 "gateway", "--scheduler", scheduler, "--port", str(gw.port), "--grpc-port", str(gw.grpc_port),
                 "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--api-key", API_KEY,
                 "--allowed-origins", f"{ORIGIN},https://second.example", "--allowed-methods", '["GET", "POST"]',
                 "--allow-credentials"])}

    def ready() -> bool:
        exited = [name for name, p in procs.items() if p.poll() is not None]
        assert not exited, f"{exited} exited; logs in {log_dir}"
        try:
            return gw.request("GET", "/health").status == 200
        except OSError:
            return False

    try:
        wait_for(ready, 120, "the gateway's /health")
        yield gw
    finally:
        stop_in_order([[procs["gateway"]], [procs["worker"]], [procs["scheduler"]]], timeout_s=30)


def _error(reply: Reply) -> dict:
    assert reply.headers["Content-Type"].startswith("application/json"), reply.headers
    body = reply.json()
    assert set(body) == {"error"}, body
    return body["error"]


# -- 404 for an unknown model ------------------------------------------------------------------


@pytest.mark.service
def test_unknown_model_raises_not_found_in_the_openai_client(gateway):
    client = gateway.client()
    with pytest.raises(openai.NotFoundError) as completion:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError) as chat:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, stream=True)
    for err in (completion.value, chat.value):
        assert err.status_code == 404 and "no-such-model" in err.message
        assert err.code == "model_not_found" and err.param == "model" and err.type == "invalid_request_error"


@pytest.mark.service
def test_tokenize_with_unknown_model_is_404_and_known_model_works(gateway):
    unknown = gateway.request("POST", "/tokenize", {"prompt": "hi", "model": "no-such-model"}, AUTH)
    assert unknown.status == 404
    assert _error(unknown) | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": "model",
                                                 "code": "model_not_found"}
    known = gateway.request("POST", "/tokenize", {"prompt": "hi", "model": MODEL}, AUTH)
    assert known.status == 200 and known.json()["count"] > 0


@pytest.mark.service
def test_grpc_unknown_model_is_not_found(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel, pytest.raises(grpc.RpcError) as err:
        request = generation_pb2.GenerateRequest(model="no-such-model", text="hi",
                                                 params=generation_pb2.SamplingParams(max_tokens=2))
        list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30,
                                                                  metadata=[("authorization", f"Bearer {API_KEY}")]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in (err.value.details() or "")


# -- /v1/models/{id}, /version, /tokenizer_info -------------------------------------------------


@pytest.mark.service
def test_models_retrieve_returns_the_listed_model(gateway):
    client = gateway.client()
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL]
    retrieved = client.models.retrieve(MODEL)
    assert retrieved.model_dump() == listed[0].model_dump()
    assert retrieved.object == "model" and retrieved.model_dump()["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found" and "no-such-model" in err.value.message


@pytest.mark.service
def test_version_is_the_package_version_and_needs_no_key(gateway):
    reply = gateway.request("GET", "/version")
    assert reply.status == 200 and reply.json() == {"version": version("metroserve")}


@pytest.mark.service
def test_tokenizer_info_describes_the_gateway_tokenizer(gateway, tiny_model_dir):
    from metroserve.common.tokenizer import load_tokenizer

    assert gateway.request("GET", "/tokenizer_info").status == 401  # the chat template is the operator's
    reply = gateway.request("GET", "/tokenizer_info", headers=AUTH)
    assert reply.status == 200
    info, tokenizer = reply.json(), load_tokenizer(tiny_model_dir)
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["vocab_size"] == VOCAB and info["max_model_len"] == 2048
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<|im_start|>", "<|im_end|>",
                                                                         "<|endoftext|>")
    assert (info["bos_token_id"], info["eos_token_id"], info["pad_token_id"]) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert info["unk_token"] is None and info["unk_token_id"] is None
    assert info["chat_template"] == tokenizer.chat_template and "{%" in info["chat_template"]


# -- CORS ----------------------------------------------------------------------------------------


def _preflight(gateway, path: str, origin: str, method: str = "POST") -> Reply:
    return gateway.request("OPTIONS", path, headers={"Origin": origin, "Access-Control-Request-Method": method,
                                                     "Access-Control-Request-Headers": "authorization, content-type"})


def _cors_headers(reply: Reply) -> dict[str, str]:
    return {k.lower(): v for k, v in reply.headers.items() if k.lower().startswith("access-control-")}


@pytest.mark.service
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models", "/no/such/route"])
def test_preflight_from_an_allowed_origin_needs_no_key(gateway, path):
    reply = _preflight(gateway, path, ORIGIN)
    assert reply.status == 204, reply.body
    cors = _cors_headers(reply)
    assert cors["access-control-allow-origin"] == ORIGIN and reply.headers["Vary"] == "Origin"
    assert cors["access-control-allow-credentials"] == "true"
    assert set(cors["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
    assert cors["access-control-allow-headers"] == "authorization, content-type"


@pytest.mark.service
def test_preflight_refusals_carry_no_permission(gateway):
    other = _preflight(gateway, "/v1/completions", OTHER_ORIGIN)
    assert other.status == 401 and _cors_headers(other) == {}  # not a preflight for us: the key check
    delete = _preflight(gateway, "/v1/completions", ORIGIN, method="DELETE")  # --allowed-methods GET,POST
    assert delete.status == 400 and "access-control-allow-methods" not in _cors_headers(delete)


@pytest.mark.service
def test_actual_responses_to_an_allowed_origin_say_so(gateway):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    stream = gateway.request("POST", "/v1/chat/completions", body, {**AUTH, "Origin": ORIGIN})
    assert stream.status == 200 and stream.headers["Content-Type"].startswith("text/event-stream")
    assert stream.body.endswith(b"data: [DONE]\n\n")
    not_found = gateway.request("POST", "/v1/completions", {"model": "x", "prompt": "hi"}, {**AUTH, "Origin": ORIGIN})
    unauthorized = gateway.request("GET", "/v1/models", headers={"Origin": ORIGIN})
    assert (not_found.status, unauthorized.status) == (404, 401)
    for reply in (stream, not_found, unauthorized):
        cors = _cors_headers(reply)
        assert cors["access-control-allow-origin"] == ORIGIN and cors["access-control-allow-credentials"] == "true"
        assert "X-Request-Id" in cors["access-control-expose-headers"]
    assert _cors_headers(gateway.request("GET", "/v1/models", headers={**AUTH, "Origin": OTHER_ORIGIN})) == {}
    assert _cors_headers(gateway.request("GET", "/v1/models", headers=AUTH)) == {}


def test_cors_policy_semantics():
    """What the service test does not reach: '*' with and without credentials, header lists, flags."""
    anyone = CorsPolicy(allowed_origins=("*",))
    assert anyone.allows("https://x.example") and anyone.response_headers("https://x.example")[
        "Access-Control-Allow-Origin"] == "*"
    credentialed = CorsPolicy(allowed_origins=("*",), allow_credentials=True)
    assert credentialed.response_headers("https://x.example")["Access-Control-Allow-Origin"] == "https://x.example"
    listed = CorsPolicy(allowed_origins=("https://a.example",), allowed_headers=("Authorization",))
    assert not listed.allows("https://b.example") and not CorsPolicy().enabled
    assert listed.preflight_headers("https://a.example", "POST", "x-custom") is None
    allowed = listed.preflight_headers("https://a.example", "post", "Authorization, Content-Type")
    assert allowed is not None and "authorization" in allowed["Access-Control-Allow-Headers"].split(", ")
    assert parse_list('["https://a.example", "https://b.example"]') == parse_list(" https://a.example,https://b.example,")
    assert CorsPolicy(("https://a.example",), ("GET",), ("*",), True).to_cli_args() == [
        "--allowed-origins", '["https://a.example"]', "--allowed-methods", '["GET"]', "--allowed-headers", '["*"]',
        "--allow-credentials"]


def test_serve_passes_cors_flags_to_its_gateway():
    from metroserve.services.cli import build_parser
    from metroserve.services.cors import policy_from_args
    from metroserve.services.serve import ServeOptions, Stack
    from metroserve.worker.config import EngineConfig

    args = build_parser().parse_args(["serve", "--allowed-origins", '["https://a.example"]', "--allow-credentials"])
    cors = policy_from_args(args)
    argv = Stack(ServeOptions(engine=EngineConfig(device="cpu"), served_model_name="m", cors=cors))._gateway_argv()
    gateway_args = build_parser().parse_args(argv)
    assert policy_from_args(gateway_args) == cors == CorsPolicy(("https://a.example",), ("*",), ("*",), True)
    assert "--allowed-origins" not in Stack(ServeOptions(engine=EngineConfig(device="cpu"),
                                                         served_model_name="m"))._gateway_argv()


# -- X-Request-Id --------------------------------------------------------------------------------


@pytest.mark.service
def test_request_id_is_echoed_on_every_kind_of_response(gateway):
    stream = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
    replies = {
        "json": gateway.request("GET", "/v1/models", headers={**AUTH, "X-Request-Id": "client-1"}),
        "stream": gateway.request("POST", "/v1/completions", stream, {**AUTH, "X-Request-Id": "client-2"}),
        "404": gateway.request("GET", "/v1/models/nope", headers={**AUTH, "X-Request-Id": "client-3"}),
        "401": gateway.request("GET", "/v1/models", headers={"X-Request-Id": "client-4"}),
        "preflight": gateway.request("OPTIONS", "/v1/completions", headers={
            "X-Request-Id": "client-5", "Origin": ORIGIN, "Access-Control-Request-Method": "POST"}),
    }
    assert {k: r.status for k, r in replies.items()} == {"json": 200, "stream": 200, "404": 404, "401": 401,
                                                         "preflight": 204}
    assert [r.headers["X-Request-Id"] for r in replies.values()] == [f"client-{i}" for i in range(1, 6)]


@pytest.mark.service
def test_request_id_is_generated_when_absent(gateway):
    ids = [gateway.request("GET", "/health").headers["X-Request-Id"] for _ in range(2)]
    assert all(UUID_HEX.fullmatch(i) for i in ids) and ids[0] != ids[1]


# -- gRPC reflection -------------------------------------------------------------------------------


@pytest.mark.service
def test_grpc_reflection_lists_services_and_describes_generate_without_a_key(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert set(database.get_services()) == {"metroserve.v1.Generation", "grpc.health.v1.Health",
                                                "grpc.reflection.v1alpha.ServerReflection"}
        generate = DescriptorPool(database).FindServiceByName("metroserve.v1.Generation").methods_by_name["Generate"]
        assert generate.input_type.full_name == "metroserve.v1.GenerateRequest"
        assert generate.output_type.full_name == "metroserve.v1.GenerateResponse"
        assert generate.server_streaming and not generate.client_streaming
        with pytest.raises(grpc.RpcError) as err:  # open reflection, but calls still need the key
            generation_pb2_grpc.GenerationStub(channel).ListModels(generation_pb2.ListModelsRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
