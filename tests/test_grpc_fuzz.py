"""Property-based fuzzing of the gateway's public gRPC API (hypothesis), on a mock-worker cluster.

Well-formed messages: every field of the request types generated from their protobuf descriptors
(any int32/int64 including the extremes, NaN and infinities, unicode strings, each oneof arm,
repeated and map fields), sent to Generate, Abort and ListModels. Each call must end OK or with a
status that names the client's mistake or the server's load: never INTERNAL or UNKNOWN (gRPC's
5xx). Malformed bytes: random payloads sent to every method get INVALID_ARGUMENT (or OK, where
the bytes happen to parse) and take no process down.
Afterwards no process has exited and a greedy completion is unchanged. A message past the
gateway's receive limit gets RESOURCE_EXHAUSTED.

METROSERVE_FUZZ_SCALE multiplies the example counts (the issue's 2,000-request run:
`METROSERVE_FUZZ_SCALE=4`, with tests/test_openapi.py's REST fuzzer; see benchmarks/README.md).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metroserve.rpc import generation_pb2, generation_pb2_grpc
from tests.mock_cluster import MODEL, MockCluster, start_mock_cluster, stop_mock_cluster

pytestmark = pytest.mark.service

SCALE = int(os.environ.get("METROSERVE_FUZZ_SCALE", "1"))
EXAMPLES = {"Generate": 250 * SCALE, "Abort": 60 * SCALE, "ListModels": 5}
RAW_EXAMPLES = 40 * SCALE  # malformed payloads per method
MAX_TOKENS = 4  # generation stays cheap: larger max_tokens / min_tokens / n are cut to this
SERVICE = "/metroserve.v1.Generation/"
# A request's own fault or the server's load; anything else (INTERNAL, UNKNOWN, ...) is a bug.
CLIENT_OR_LOAD = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                  grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.RESOURCE_EXHAUSTED}

_INT32, _INT64 = 2**31, 2**63
_SCALARS = {
    FieldDescriptor.TYPE_INT32: st.one_of(st.integers(-3, 600), st.integers(-_INT32, _INT32 - 1)),
    FieldDescriptor.TYPE_INT64: st.one_of(st.integers(-3, 600), st.integers(-_INT64, _INT64 - 1)),
    FieldDescriptor.TYPE_DOUBLE: st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True)),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.one_of(st.text(max_size=40), st.sampled_from(['{"type": "object"}', "a|b", "",
                                                                                   MODEL, 'root ::= "x"'])),
}


def _field_value(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        inner = message_strategy(field.message_type, depth + 1)
    else:
        inner = _SCALARS[field.type]
    return st.lists(inner, max_size=4) if field.is_repeated else inner


@st.composite
def _message_fields(draw, descriptor: Descriptor, depth: int) -> dict:
    values = {}
    oneof_fields = {f.name for o in descriptor.oneofs for f in o.fields}
    for oneof in descriptor.oneofs:  # at most one arm each
        arm = draw(st.sampled_from([None, *oneof.fields]))
        if arm is not None:
            values[arm.name] = draw(_field_value(arm, depth))
    for field in descriptor.fields:
        if field.name in oneof_fields or not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            values[field.name] = draw(st.dictionaries(_SCALARS[key.type], _SCALARS[value.type], max_size=4))
        else:
            values[field.name] = draw(_field_value(field, depth))
    return values


def message_strategy(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy:
    """Dicts of field values for `descriptor` (nested messages as dicts), three levels deep at most."""
    return st.just({}) if depth > 3 else _message_fields(descriptor, depth)


def _build(cls, values: dict):
    """A message from generated values; nested dicts become messages, map fields are updated."""
    msg = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        target = getattr(msg, name)
        if isinstance(value, dict) and field.message_type is not None and field.message_type.GetOptions().map_entry:
            target.update(value)
        elif isinstance(value, dict):
            target.CopyFrom(_build(getattr(generation_pb2, field.message_type.name), value))
        elif isinstance(value, list) and field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(_build(getattr(generation_pb2, field.message_type.name), item))
        elif isinstance(value, list):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


def _cheap(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    params = request.params
    params.max_tokens_unlimited = False
    for name in ("max_tokens", "min_tokens", "n", "logprobs", "prompt_logprobs"):
        if params.HasField(name) and getattr(params, name) > MAX_TOKENS:
            setattr(params, name, MAX_TOKENS)
    if not params.HasField("max_tokens"):
        params.max_tokens = MAX_TOKENS
    return request


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory) -> Iterator[MockCluster]:
    stack = start_mock_cluster(tiny_model_dir, tmp_path_factory.mktemp("grpc-fuzz"),
                               worker_args=("--mock-step-fixed-ms", "1"))
    try:
        yield stack
    finally:
        stop_mock_cluster(stack)


def _greedy_tokens(stub) -> list[int]:
    request = generation_pb2.GenerateRequest(model=MODEL, text="The same prompt each time",
                                             params=generation_pb2.SamplingParams(max_tokens=8, temperature=0,
                                                                                         ignore_eos=True))
    return [t for reply in stub.Generate(request, timeout=30) for o in reply.outputs for t in o.token_ids]


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


FUZZ_SETTINGS = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def test_generated_messages_get_no_server_error_and_malformed_bytes_crash_nothing(cluster):
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}")
    stub = generation_pb2_grpc.GenerationStub(channel)
    before = _greedy_tokens(stub)
    codes: Counter[tuple[str, str]] = Counter()
    bad: list[str] = []

    def check(method: str, request, call) -> None:
        code = _code(call)
        codes[(method, code.name)] += 1
        if code not in CLIENT_OR_LOAD:
            bad.append(f"{method} {code.name}: {request!r:.400}")

    @settings(FUZZ_SETTINGS, max_examples=EXAMPLES["Generate"])
    @given(message_strategy(generation_pb2.GenerateRequest.DESCRIPTOR), st.sampled_from(["", MODEL, None]))
    def generate(values, model):
        request = _cheap(_build(generation_pb2.GenerateRequest, values))
        if model is not None:  # two thirds name the served model or none, so most reach the cluster
            request.model = model
        check("Generate", request, lambda: list(stub.Generate(request, timeout=30)))

    @settings(FUZZ_SETTINGS, max_examples=EXAMPLES["Abort"])
    @given(message_strategy(generation_pb2.AbortRequest.DESCRIPTOR))
    def abort(values):
        request = _build(generation_pb2.AbortRequest, values)
        check("Abort", request, lambda: stub.Abort(request, timeout=30))

    @settings(FUZZ_SETTINGS, max_examples=EXAMPLES["ListModels"])
    @given(st.just({}))
    def list_models(values):
        request = generation_pb2.ListModelsRequest()
        check("ListModels", request, lambda: stub.ListModels(request, timeout=30))

    @settings(FUZZ_SETTINGS, max_examples=RAW_EXAMPLES)
    @given(st.sampled_from(["Generate", "Abort", "ListModels"]), st.binary(max_size=300))
    def malformed(method, payload):
        if method == "Generate":
            call = channel.unary_stream(SERVICE + method)
            check(f"raw {method}", payload, lambda: list(call(payload, timeout=30)))
        else:
            call = channel.unary_unary(SERVICE + method)
            check(f"raw {method}", payload, lambda: call(payload, timeout=30))

    for run in (generate, abort, list_models, malformed):
        run()
    total = sum(codes.values())
    print(f"\ngRPC fuzz: {total} calls; codes {dict(codes)}")
    assert not bad, f"{len(bad)} of {total} calls got a server error:\n" + "\n".join(bad[:20])
    exited = {name: p.returncode for name, p in cluster.procs.items() if p.poll() is not None}
    assert not exited, f"processes exited: {exited}; logs in {cluster.log_dir}"
    assert _greedy_tokens(stub) == before
    channel.close()


def test_a_message_past_the_receive_limit_gets_resource_exhausted(cluster):
    from metroserve.rpc import SERVER_GRPC_OPTIONS

    limit = dict(SERVER_GRPC_OPTIONS)["grpc.max_receive_message_length"]
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}",
                               options=[("grpc.max_send_message_length", 2 * limit)]) as channel:
        request = generation_pb2.GenerateRequest(model=MODEL, text="x" * (limit + 1))
        code = _code(lambda: list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(p.poll() is None for p in cluster.procs.values())
