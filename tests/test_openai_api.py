"""The official openai client (sync and async; streaming and not; chat and completions) against
`metroserve serve` with SmolLM2 on 2 workers: greedy text equals the offline LLM's."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import cast

import grpc
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.stack import ROOT, ServeStack, free_port, wait_for

pytestmark = pytest.mark.service

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "Three primary colors are"]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2? Answer briefly."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a fruit."}],
]
MAX_TOKENS = 24


def _typed(chat: list[dict[str, str]]) -> list[ChatCompletionMessageParam]:
    """A CHATS entry as the openai client types messages (TypedDicts of this same shape)."""
    return cast(list[ChatCompletionMessageParam], chat)


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    with ServeStack(smollm2_dir, workers=2, log_path=tmp_path_factory.mktemp("serve") / "serve.log") as s:
        yield s


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """Offline greedy outputs on the same weights: text and token counts."""
    from metroserve import LLM, SamplingParams

    llm = LLM(model=str(smollm2_dir), kv_cache_memory="128MiB")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    completions = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    chats = [o.outputs[0] for o in llm.chat(CHATS, params, use_tqdm=False)]
    stop = completions[2].text.split()[2]  # a word the greedy output is known to contain
    stopped = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    return {"completions": completions, "chats": chats, "stop": stop, "stopped": stopped}


@pytest.fixture(scope="module")
def model_id(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused").models.list().data[0].id


def test_sync_completions_batch_and_stream(stack, reference, model_id):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    resp = client.completions.create(model=model_id, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [r.text for r in reference["completions"]]
    assert resp.usage is not None
    assert resp.usage.completion_tokens == sum(len(r.token_ids) for r in reference["completions"])

    for prompt, ref in zip(PROMPTS, reference["completions"]):
        chunks = list(client.completions.create(model=model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == len(ref.token_ids)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason


def test_sync_chat_and_stream(stack, reference, model_id):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    for messages, ref in zip(CHATS, reference["chats"]):
        resp = client.chat.completions.create(model=model_id, messages=_typed(messages), max_tokens=MAX_TOKENS,
                                              temperature=0)
        assert resp.choices[0].message.content == ref.text
        assert resp.choices[0].message.role == "assistant"
        assert resp.usage is not None and resp.usage.completion_tokens == len(ref.token_ids)

        stream = client.chat.completions.create(model=model_id, messages=_typed(messages), max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == len(ref.token_ids) and usage.prompt_tokens > 0


def test_async_clients_concurrently(stack, reference, model_id):
    async def run():
        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused")

        async def completion(prompt):
            return (await client.completions.create(model=model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                                    temperature=0)).choices[0].text

        async def completion_stream(prompt):
            stream = await client.completions.create(model=model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def chat(messages):
            return (await client.chat.completions.create(model=model_id, messages=messages, max_tokens=MAX_TOKENS,
                                                         temperature=0)).choices[0].message.content

        async def chat_stream(messages):
            stream = await client.chat.completions.create(model=model_id, messages=messages, max_tokens=MAX_TOKENS,
                                                          temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        jobs = [completion(p) for p in PROMPTS] + [completion_stream(p) for p in PROMPTS]
        jobs += [chat(m) for m in CHATS] + [chat_stream(m) for m in CHATS]
        return await asyncio.gather(*jobs)

    texts = asyncio.run(run())
    expected = [r.text for r in reference["completions"]] * 2 + [r.text for r in reference["chats"]] * 2
    assert texts == expected


def test_stop_string_and_n(stack, reference, model_id):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    stop = reference["stop"]
    for stream in (False, True):
        reply = client.completions.create(model=model_id, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                          stop=[stop], stream=stream)
        if isinstance(reply, openai.Stream):
            chunks = [c for c in reply if c.choices]
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = reply.choices[0].text, reply.choices[0].finish_reason
        assert text == reference["stopped"].text and stop not in text
        assert finish == "stop"
    resp = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert {c.text for c in resp.choices} == {reference["completions"][0].text}


def test_logprobs_shapes(stack, model_id):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    chat = client.chat.completions.create(model=model_id, messages=_typed(CHATS[0]), max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    chat_logprobs, usage = chat.choices[0].logprobs, chat.usage
    assert chat_logprobs is not None and chat_logprobs.content is not None and usage is not None
    entries = chat_logprobs.content
    assert len(entries) == usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob == e.top_logprobs[0].logprob  # greedy: the chosen token is the most likely
    comp = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp, usage = comp.choices[0].logprobs, comp.usage
    assert lp is not None and usage is not None
    assert lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == usage.completion_tokens
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text


def test_repeated_prompt_reports_cached_tokens(stack, model_id):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    long_prompt = "You are a helpful assistant who answers questions about geography. " * 12
    first = client.completions.create(model=model_id, prompt=long_prompt + "Q1", max_tokens=2, temperature=0)
    # The worker streams the answer to the gateway directly; its blocks reach the scheduler's prefix
    # index with the finish report, which can land after a back-to-back follow-up is placed (on the
    # other worker, by load). Once the scheduler has heard the finish, placement must find them.
    stack.wait_idle()
    second = client.completions.create(model=model_id, prompt=long_prompt + "Q2", max_tokens=2, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens > 100
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 96  # the shared head, in whole blocks


def test_second_gateway_with_api_key_rest_and_grpc(stack, smollm2_dir, reference, model_id, tmp_path):
    """Several gateways share one scheduler; --api-key protects REST and gRPC."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from metroserve.rpc import generation_pb2, generation_pb2_grpc

    port, grpc_port = free_port(), free_port()
    with open(tmp_path / "gateway.log", "wb") as log:  # the gateway writes through its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "metroserve.services.cli", "gateway",
                                 "--scheduler", stack.scheduler_address, "--port", str(port),
                                 "--grpc-port", str(grpc_port), "--model", str(smollm2_dir),
                                 "--served-model-name", model_id, "--api-key", "sekret"], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}/v1"

        def up():
            try:
                return openai.OpenAI(base_url=base, api_key="sekret").models.list().data
            except openai.APIConnectionError:
                return None
        wait_for(up, 120, "the second gateway")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong").completions.create(model=model_id, prompt="hi", max_tokens=1)
        resp = openai.OpenAI(base_url=base, api_key="sekret").completions.create(
            model=model_id, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert resp.choices[0].text == reference["completions"][0].text

        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(text=PROMPTS[0], params=generation_pb2.SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS))
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, timeout=60))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            messages = list(stub.Generate(request, timeout=60, metadata=[("authorization", "Bearer sekret")]))
            assert "".join(d.text for m in messages for d in m.outputs) == reference["completions"][0].text
            assert [t for m in messages for d in m.outputs for t in d.token_ids] == \
                reference["completions"][0].token_ids
            assert messages[-1].usage.completion_tokens == len(reference["completions"][0].token_ids)
            assert messages[-1].outputs[-1].finish_reason == "length"
            # Health stays open without a key, for probes.
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.terminate()
        proc.wait(timeout=30)
