"""Structured outputs in the engine (SmolLM2): every output of 20 JSON schemas validates, with n = 3,
with n-gram speculation on and off, across preemption and a migration's replay; choice and regex
outputs always match; a constraint the grammar engine rejects is an error naming it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from metroserve import LLM, SamplingParams
from metroserve.common.structured_outputs import StructuredOutputsParams
from tests.conftest import assert_all_blocks_free
from tests.structured_schemas import SCHEMAS, prompt_for

MAX_TOKENS = 256
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def spec_llm(smollm2_dir):
    return LLM(str(smollm2_dir), kv_cache_memory="256MiB", speculative_config=NGRAM)


def _chat_prompts(llm, schemas):
    return [llm.apply_chat_template([{"role": "user", "content": prompt_for(s)}]) for s in schemas]


def _json_params(schema, **kwargs):
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
                          **kwargs)


def _assert_valid(outputs, schemas):
    for out, schema in zip(outputs, schemas, strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop", f"cut off at {len(c.token_ids)} tokens: {c.text!r}"
            jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("speculate", [False, True])
def test_twenty_schemas_n3_validate(llm, spec_llm, speculate):
    engine = spec_llm if speculate else llm
    prompts = _chat_prompts(engine, SCHEMAS)
    sampled = engine.generate(prompts, [_json_params(s, n=3, temperature=0.8) for s in SCHEMAS], use_tqdm=False)
    greedy = engine.generate(prompts, [_json_params(s, temperature=0) for s in SCHEMAS], use_tqdm=False)
    _assert_valid(sampled, SCHEMAS)
    _assert_valid(greedy, SCHEMAS)
    if speculate:  # the drafts went through the grammar's masks
        stats = engine.engine.speculator.stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert_all_blocks_free(engine)


def test_choice_and_regex_always_match(llm, spec_llm):
    choices = ("positive", "negative", "neutral")
    prompt = llm.apply_chat_template([{"role": "user", "content": "Is 'I love it' positive or negative?"}])
    for engine in (llm, spec_llm):
        # Constrained and free requests share the batch: the masks land on their own rows.
        constrained = SamplingParams(n=3, temperature=1.0, max_tokens=16,
                                     structured_outputs=StructuredOutputsParams(choice=choices))
        free = SamplingParams(temperature=0, max_tokens=16)
        out = engine.generate([prompt] * 6, [free, constrained] * 3, use_tqdm=False)
        assert all(c.text in choices for o in out[1::2] for c in o.outputs)
        assert all(o.outputs[0].text not in choices for o in out[::2])
        pattern = r"[A-Z][a-z]{2,8} \d{2}-\d{4}"
        out = engine.generate([prompt] * 4, SamplingParams(n=3, temperature=1.0, max_tokens=32,
                                                           structured_outputs=StructuredOutputsParams(regex=pattern)),
                              use_tqdm=False)
        assert all(re.fullmatch(pattern, c.text) for o in out for c in o.outputs), [c.text for o in out
                                                                                   for c in o.outputs]


def test_preempted_and_resumed_sequences_keep_their_grammar(smollm2_dir):
    # A pool this small preempts constrained sequences mid-output.
    small = LLM(str(smollm2_dir), kv_cache_memory="24MiB", block_size=16)
    prompts = _chat_prompts(small, SCHEMAS[:12])
    out = small.generate(prompts, [_json_params(s, n=2, temperature=0.8) for s in SCHEMAS[:12]], use_tqdm=False)
    assert small.engine.batcher.num_preemptions > 0
    _assert_valid(out, SCHEMAS[:12])
    # A migration: a fresh request resumes greedy output part-way; its matcher replays those tokens.
    schema = SCHEMAS[7]
    whole = small.generate(prompts[7:8], _json_params(schema, temperature=0), use_tqdm=False)[0].outputs[0]
    engine = small.engine
    request = engine.add_request(prompts[7], _json_params(schema, temperature=0),
                                 resume_token_ids=whole.token_ids[:5])
    while engine.has_unfinished_requests():
        engine.step()
    assert request.seqs[0].output_token_ids == whole.token_ids


@pytest.mark.parametrize("spec", [StructuredOutputsParams(json='{"type": "strange"}'),
                                  StructuredOutputsParams(regex="[a-"),
                                  StructuredOutputsParams(grammar="root ::= (")])
def test_rejected_constraints_name_the_field(llm, spec):
    with pytest.raises(ValueError, match="rejected by the grammar engine") as err:
        llm.generate(["hi"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert getattr(err.value, "param", None) == "structured_outputs"
    assert_all_blocks_free(llm)


def test_masks_match_xgrammars_own_kernel(llm):
    """Our unpack + masked_fill forbids exactly what xgrammar's apply_token_bitmask_inplace does."""
    import torch
    import xgrammar as xgr

    so = llm.engine.structured_outputs
    vocab = so.vocab_size
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, -(-vocab // 32)), dtype=torch.int32, generator=torch.Generator()
                            .manual_seed(0))
    bitmask[1] = 0
    bitmask[1, 3] = 1 << 5  # one allowed token: 3 * 32 + 5
    logits = torch.randn(6, vocab)
    rows = [0, 2, 3, 5]
    expected = logits.clone()
    full = torch.full((6, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full, indices=rows)
    ours = logits.clone()
    so.apply_masks(ours, so._forbidden(bitmask), rows)
    assert torch.equal(ours, expected)
    assert (ours[2] > float("-inf")).nonzero().flatten().tolist() == [3 * 32 + 5]
    every, every_expected = logits[:4].clone(), logits[:4].clone()
    so.apply_masks(every, so._forbidden(bitmask), [0, 1, 2, 3])
    xgr.apply_token_bitmask_inplace(every_expected, bitmask)
    assert torch.equal(every, every_expected)
