"""Structured outputs through `metroserve serve` with the official openai client: 20 JSON schemas via
response_format, streaming and not, n = 3, with n-gram speculation on and off, all validate with
jsonschema; vLLM's structured_outputs and guided_* fields on completions; choice and regex always
match; a schema the grammar engine rejects is a 400 naming the field, streaming or not; gRPC."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import openai
import pytest

from metroserve.rpc import generation_pb2, generation_pb2_grpc
from tests.stack import ServeStack
from tests.structured_schemas import SCHEMAS, prompt_for

pytestmark = pytest.mark.service

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "ngram"])
def stack(request, smollm2_dir, tmp_path_factory):
    extra = ["--speculative-config", NGRAM] if request.param else []
    with ServeStack(smollm2_dir, workers=1, extra_args=extra,
                    log_path=tmp_path_factory.mktemp("serve") / "serve.log") as s:
        yield s


def _response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


async def _one_chat(client, schema: dict, stream: bool) -> list[tuple[str, str | None]]:
    """(text, finish reason) of each of the n = 3 choices."""
    kwargs = {"model": "", "messages": [{"role": "user", "content": prompt_for(schema)}], "n": 3,
              "temperature": 0.8, "max_tokens": 256, "response_format": _response_format(schema)}
    if not stream:
        out = await client.chat.completions.create(**kwargs)
        return [(c.message.content, c.finish_reason) for c in sorted(out.choices, key=lambda c: c.index)]
    texts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finish: dict[int, str | None] = {}
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index].append(c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    return [("".join(texts[i]), finish.get(i)) for i in range(3)]


@pytest.mark.parametrize("stream", [False, True])
def test_twenty_schemas_validate(stack, stream):
    async def run():
        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(_one_chat(client, s, stream) for s in SCHEMAS))

    for schema, choices in zip(SCHEMAS, asyncio.run(run()), strict=True):
        for text, finish in choices:
            assert finish == "stop", f"cut off: {text!r}"
            jsonschema.validate(json.loads(text), schema)


def test_vllm_fields_on_completions(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    choices = ["alpha", "beta", "gamma"]
    out = client.completions.create(model="", prompt="Pick a Greek letter:", n=3, temperature=1.0, max_tokens=8,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices for c in out.choices)
    pattern = r"\d{3}-[a-z]{3}"
    out = client.completions.create(model="", prompt="A code:", n=3, temperature=1.0, max_tokens=16,
                                    extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.text) for c in out.choices), [c.text for c in out.choices]
    stream = client.completions.create(model="", prompt="A JSON object:", max_tokens=128, temperature=0, stream=True,
                                       extra_body={"guided_json": SCHEMAS[0]})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[0])
    # json_object bounds nothing: a prompt whose greedy answer is short.
    out = client.completions.create(model="", prompt='The JSON object {"ok": true} written again:', max_tokens=64,
                                    temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop", out.choices[0].text
    assert isinstance(json.loads(out.choices[0].text), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_rejected_schema_is_a_400_naming_the_field(stack, stream):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}],  # type: ignore[call-overload]
                                       stream=stream, max_tokens=8,
                                       response_format=_response_format({"type": "strange"}))
    assert err.value.param == "response_format" and "grammar engine" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="", prompt="hi", stream=stream, extra_body={"guided_regex": "[a-"})
    assert err.value.param == "guided_regex"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="", prompt="hi", extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert err.value.param == "guided_choice"


def test_grpc_structured_outputs(stack):
    params = generation_pb2.SamplingParams(max_tokens=8, temperature=1.0, n=2, structured_outputs=generation_pb2.
                                           StructuredOutputs(choice=generation_pb2.Choice(options=["yes", "no"])))
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        replies = list(generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(text="Yes or no?", params=params), timeout=60))
    texts = {0: "", 1: ""}
    for reply in replies:
        for delta in reply.outputs:
            texts[delta.index] += delta.text
    assert set(texts.values()) <= {"yes", "no"}
