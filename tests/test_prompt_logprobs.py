"""Prompt logprobs, max_tokens 0, allowed_token_ids and bad words in the engine, against transformers."""

from __future__ import annotations

import pytest
import torch

from metroserve import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # A small step budget: a 60-token prompt takes several prefill chunks.
    return LLM(str(tiny_model_dir), max_num_batched_tokens=16, block_size=8)


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.get_tokenizer().encode("Inspect live objects: modules, classes, methods and functions " * 3)


@torch.inference_mode()
def _reference_prompt_logprobs(tiny_ref, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1, vocab]: row i scores tokens[i + 1]."""
    logits = tiny_ref.model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _check_against_reference(entries, prompt, ref, top_n):
    assert entries[0] is None and len(entries) == len(prompt)
    for i, entry in enumerate(entries[1:]):
        token = prompt[i + 1]
        assert entry[token] == pytest.approx(ref[i, token].item(), abs=1e-4), f"prompt token {i + 1}"
        assert set(ref[i].topk(top_n).indices.tolist()) <= set(entry)
        assert len(entry) <= top_n + 1


def test_prompt_logprobs_match_reference_across_chunks_and_cache_hits(llm, prompt, tiny_ref):
    assert len(prompt) > 3 * 16, "the prompt must span several prefill chunks"
    ref = _reference_prompt_logprobs(tiny_ref, prompt)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    # Warm the prefix cache with the same prompt, then ask for its logprobs: they must be computed.
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0, "a prompt asking for logprobs reads nothing from the prefix cache"
    _check_against_reference(out.prompt_logprobs, prompt, ref, 2)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm, prompt, tiny_ref):
    metrics = llm.engine.metrics
    prompt_tokens_before, generated_before = metrics.prompt_tokens, metrics.generation_tokens
    out = llm.generate([prompt, prompt[:9]], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    # The counters say what the client saw: both prompts processed, nothing generated.
    assert metrics.prompt_tokens - prompt_tokens_before == len(prompt) + 9
    assert metrics.generation_tokens == generated_before
    for o, p in zip(out, [prompt, prompt[:9]]):
        assert o.outputs[0].token_ids == [] and o.outputs[0].finish_reason == "length"
        _check_against_reference(o.prompt_logprobs, p, _reference_prompt_logprobs(tiny_ref, p), 0)
    assert_all_blocks_free(llm)


def test_allowed_token_ids_and_bad_words(llm, prompt):
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    free_ids = free[0].outputs[0].token_ids
    allowed = [3, 17, 42, 99]
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True,
                                                allowed_token_ids=allowed), use_tqdm=False)
    assert set(out[0].outputs[0].token_ids) <= set(allowed)
    # A one-token bad word is never generated; a two-token one only loses its last token right
    # after its first (the first alone still comes first).
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                bad_words_token_ids=[[free_ids[0]]]), use_tqdm=False)
    assert free_ids[0] not in out[0].outputs[0].token_ids
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                bad_words_token_ids=[free_ids[:2]]), use_tqdm=False)
    ids = out[0].outputs[0].token_ids
    assert ids[0] == free_ids[0] and ids[1] != free_ids[1]
    assert all(ids[i:i + 2] != free_ids[:2] for i in range(len(ids) - 1))
    assert_all_blocks_free(llm)
