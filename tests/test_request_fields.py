"""Request fields through `metroserve serve` with real clients: echo and prompt logprobs (what
lm-evaluation-harness's loglikelihood requests send), vLLM's extra fields, and the refusal of every
field the server cannot honour."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from metroserve.services.unsupported_fields import UNSUPPORTED
from tests.stack import ServeStack

pytestmark = pytest.mark.service

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    with ServeStack(smollm2_dir, workers=1, log_path=tmp_path_factory.mktemp("serve") / "serve.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from metroserve.common.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


def _post(stack, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(stack.base_url.removesuffix("/v1") + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@torch.inference_mode()
def _reference_prompt_logprobs(smollm2_ref, tokens: list[int]) -> list[float]:
    logits = smollm2_ref.model(torch.tensor([tokens])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_the_prompt_like_transformers(client, model_id, tokenizer, smollm2_ref, max_tokens):
    """lm-eval's local-completions loglikelihood request: token ids in, echo, logprobs=1."""
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode("Two plus two equals four.")]
    out = client.completions.create(model=model_id, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens,
                                    temperature=0)
    assert len(out.choices) == 2
    for choice, tokens in zip(sorted(out.choices, key=lambda c: c.index), prompts):
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.tokens is not None and len(lp.tokens) == len(tokens) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = _reference_prompt_logprobs(smollm2_ref, tokens)
        assert lp.token_logprobs[1:len(tokens)] == pytest.approx(ref, abs=2e-3)
        for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert 1 <= len(top) <= 2 and chosen in top.values()  # the token itself is always listed
        assert choice.text.startswith(tokenizer.decode(tokens))
        assert choice.finish_reason == "length" if max_tokens == 0 else choice.finish_reason in ("length", "stop")
    assert out.usage is not None and out.usage.completion_tokens == 2 * max_tokens


def test_echo_streams_the_prompt_first(client, model_id):
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, echo=True, max_tokens=4, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    plain = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + plain.choices[0].text


def test_vllm_prompt_logprobs_and_token_ids(stack, tokenizer):
    status, body = _post(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                    "prompt_logprobs": 2, "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    tokens = tokenizer.encode(PROMPT)
    assert choice["prompt_token_ids"] == tokens and len(choice["token_ids"]) == 2
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(tokens)
    for token, entry in zip(tokens[1:], entries[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3


def test_tokens_as_token_ids(stack):
    status, body = _post(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1,
                                                    "return_tokens_as_token_ids": True, "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_logprobs_zero_lists_the_sampled_token(client, model_id):
    out = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=3, logprobs=0, temperature=0)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.tokens is not None
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]


def test_sampling_fields_take_effect(client, model_id, tokenizer):
    free = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0)
    first_word = free.choices[0].text.split()[0]
    banned = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0,
                                       extra_body={"bad_words": [first_word]})
    assert first_word not in banned.choices[0].text
    allowed = tokenizer.encode(" Rome Milan Venice", add_special_tokens=False)
    only = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=5, temperature=0,
                                     extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(only.model_extra["choices"][0]["token_ids"] if only.model_extra and "choices" in only.model_extra
               else only.choices[0].model_extra["token_ids"]) <= set(allowed)
    cut = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": 5})
    assert cut.usage is not None and cut.usage.prompt_tokens == 5


def test_continuous_usage_stats(client, model_id):
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts and counts == sorted(counts) and counts[-1] == 5


def test_chat_template_fields_and_tool_messages(stack, tokenizer):
    template = ("{{ greeting }}{% for m in messages %}[{{ m.role }}"
                "{% if m.tool_call_id %} {{ m.tool_call_id }}{% endif %}"
                "{% if m.tool_calls %} {{ m.tool_calls[0].function.name }}{% endif %}]{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    status, body = _post(stack, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 1, "chat_template": template, "add_generation_prompt": False,
        "chat_template_kwargs": {"greeting": "Hello!"}, "return_token_ids": True})
    assert status == 200, body
    expected = "Hello![user]Weather?[assistant get_weather][tool call_1]sunny"
    assert body["prompt_token_ids"] == tokenizer.encode(expected, add_special_tokens=False)


def test_stream_options_need_stream(stack):
    status, body = _post(stack, "/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}})
    assert status == 400 and body["error"]["param"] == "stream_options"


# A value that would change the result, per refused field.
_EFFECTIVE = {"use_beam_search": True, "best_of": 3, "length_penalty": 0.5, "early_stopping": True,
              "logits_processors": ["x"], "spaces_between_special_tokens": False,
              "guided_whitespace_pattern": " ", "functions": [{"name": "f"}], "function_call": "auto", "echo": True,
              "documents": [{"text": "x"}], "mm_processor_kwargs": {"a": 1}, "prompt_embeds": "AAAA",
              "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "prediction": {"type": "content"},
              "audio": {"voice": "x"}, "modalities": ["text", "audio"], "web_search_options": {},
              "reasoning_effort": "high", "store": True, "service_tier": "flex"}
_CASES = [(name, endpoint) for name, rule in UNSUPPORTED.items() for endpoint in rule.endpoints]


def test_every_refused_field_has_a_case():
    assert set(_EFFECTIVE) == set(UNSUPPORTED)


@pytest.mark.parametrize(("field", "endpoint"), _CASES)
def test_unsupported_fields_are_refused_by_name(stack, field, endpoint):
    body: dict = ({"messages": [{"role": "user", "content": "Hi"}]} if endpoint == "chat" else {"prompt": PROMPT})
    body.update({"max_tokens": 2, field: _EFFECTIVE[field]})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    status, reply = _post(stack, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == field and field in reply["error"]["message"]
    # The inert value clients send by default passes.
    inert = {"best_of": 1, "length_penalty": 1.0, "spaces_between_special_tokens": True, "function_call": "none",
             "modalities": ["text"], "service_tier": "auto", "web_search_options": None}.get(field, False)
    body[field] = inert
    status, reply = _post(stack, path, body)
    assert status == 200, reply
