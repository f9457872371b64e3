"""Speculative decoding: exact greedy output with both proposers, an exact sampler, no leaks."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from metroserve import LLM, LLMEngine, SamplingParams
from metroserve.worker.config import EngineConfig
from metroserve.worker.spec_decode.config import SpeculativeConfig
from metroserve.worker.spec_decode.ngram_proposer import NgramProposer
from metroserve.worker.spec_decode.rejection_sampler import rejection_sample
from tests.conftest import assert_all_blocks_free, build_tiny_model
from tests.reference import NEAR_TIE

NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
# Keep drafting whatever the acceptance, in any batch: these tests are about exactness.
ALWAYS = {"disable_by_batch_size": 64, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another random model with the same tokenizer: its drafts are mostly rejected."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    shared = tok.encode("Inspect live objects: modules, classes, methods, functions and code objects. " * 4)
    texts = ["Return a new dictionary object. Return a new dictionary object. Return a new",
             "x",
             "Wrap the text so every line is at most width characters long; wrap the text so every line",
             "The module provides the module provides the module"]
    # Half share a long prefix (prefix-cache hits), some are long enough to be chunked.
    return [tok.encode(t) for t in texts] + [shared + tok.encode(t) for t in texts]


def assert_same_greedy(ref, prompt, ours, plain):
    """ours == plain token for token, except after a divergence the HF reference shows is a near-tie."""
    for i, (a, b) in enumerate(zip(ours, plain)):
        if a != b:
            lp = ref.logprobs(prompt + plain[:i])
            gap = abs(lp[a].item() - lp[b].item())
            assert gap < NEAR_TIE, f"speculative output diverges at token {i}: {a} vs {b}, gap {gap:.2e}"
            return
    assert len(ours) == len(plain)


def run(llm, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    return [o.outputs[0].token_ids for o in outs]


# Prefix caching, chunked prefill (24-token steps) and preemption (a pool far too small for all
# prompts at once) are all active in the same run.
STRESS = dict(block_size=4, max_num_batched_tokens=24, num_gpu_blocks_override=64)


@pytest.mark.parametrize("method", ["ngram", "draft_model_random", "draft_model_self", "draft_model_bf16"])
def test_greedy_output_identical_under_stress(tiny_model_dir, tiny_ref, draft_dir, prompts, method):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, **ALWAYS}
    if method == "draft_model_random":
        spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3, **ALWAYS}
    elif method == "draft_model_self":  # the target as its own draft: every draft is accepted
        spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 5, **ALWAYS}
    elif method == "draft_model_bf16":  # the target in bfloat16 as the draft: mostly accepted
        spec = {"method": "draft_model", "model": str(tiny_model_dir), "draft_dtype": "bfloat16", **ALWAYS}
    plain = run(LLM(str(tiny_model_dir), **STRESS), prompts)
    llm = LLM(str(tiny_model_dir), speculative_config=spec, **STRESS)
    ours = run(llm, prompts)
    for prompt, a, b in zip(prompts, ours, plain):
        assert_same_greedy(tiny_ref, prompt, a, b)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    sd = stats.spec_decode
    assert sd.num_drafts > 0 and sd.num_accepted_tokens > 0
    if method == "draft_model_self":
        assert sd.num_accepted_tokens == sd.num_draft_tokens
    elif method != "draft_model_bf16":
        assert sd.num_accepted_tokens < sd.num_draft_tokens  # rejections (and rollbacks) happened
    assert sd.mean_acceptance_length == pytest.approx(1 + sd.num_accepted_tokens / sd.num_drafts)
    assert sd.acceptance_rate == pytest.approx(sd.num_accepted_tokens / sd.num_draft_tokens)


def test_smollm2_ngram_greedy_identical(smollm2_dir, smollm2_ref):
    """The real model on an input-grounded prompt, where n-gram drafts are mostly accepted."""
    import inspect
    import textwrap

    code = inspect.getsource(textwrap.indent)
    task = "Rename `prefix` to `pad` and output the whole function."
    msgs = [{"role": "user", "content": f"```python\n{code}```\n\n{task}"}]
    params = SamplingParams(temperature=0, max_tokens=64)
    plain = LLM(str(smollm2_dir), max_num_batched_tokens=128)
    spec = LLM(str(smollm2_dir), max_num_batched_tokens=128,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompt = plain.apply_chat_template(msgs)
    a = run(plain, [prompt], params)[0]
    b = run(spec, [prompt], params)[0]
    assert_same_greedy(smollm2_ref, prompt, b, a)
    sd = spec.engine.stats().spec_decode
    assert sd.num_accepted_tokens >= 16, sd


# -- the sampler: chi-square against the target's distribution ------------------------------------

def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of samples against probs; categories expected fewer than 5 times are pooled."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2).item()


@pytest.fixture(scope="module")
def distributions(tiny_model_dir, draft_dir):
    """Target p and draft q next-token distributions (temperature 1) at three contexts of the small model."""
    from transformers import AutoModelForCausalLM

    contexts = [[5, 17, 42], [5, 17, 42, 99], [300, 7]]

    def probs(path):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            return torch.stack([model(torch.tensor([c])).logits[0, -1].softmax(-1) for c in contexts])

    return probs(tiny_model_dir), probs(draft_dir)


DRAWS = 20_000


def speculative_draws(p, q, generator, sampler=rejection_sample):
    """DRAWS independent rounds with 2 drafts d_j ~ q_j; returns (first tokens, second tokens where emitted)."""
    k = 2
    drafts = torch.stack([torch.multinomial(q[j], DRAWS, replacement=True, generator=generator) for j in range(k)], 1)
    num_acc, nxt = sampler(p.expand(DRAWS, k + 1, -1), drafts, torch.full((DRAWS,), k),
                           q[:k].expand(DRAWS, k, -1), generator)
    first = torch.where(num_acc > 0, drafts[:, 0], nxt)
    second = torch.where(num_acc > 1, drafts[:, 1], nxt)[num_acc >= 1]
    return first, second


def test_rejection_sampler_matches_target_distribution(distributions):
    p, q = distributions
    assert (p[0] - q[0]).abs().sum() > 0.5  # the draft is far from the target: the test has power
    gen = torch.Generator().manual_seed(1234)
    first, second = speculative_draws(p, q, gen)
    assert chi_square_p_value(first, p[0]) > 0.01
    assert second.numel() > 2000
    assert chi_square_p_value(second, p[1]) > 0.01


def test_chi_square_rejects_a_sampler_that_always_accepts(distributions):
    def accept_all(target_probs, drafts, num_drafts, draft_probs, generator):
        bonus = torch.multinomial(target_probs[:, -1], 1, generator=generator)[:, 0]
        return num_drafts.clone(), bonus

    p, q = distributions
    first, _ = speculative_draws(p, q, torch.Generator().manual_seed(1234), sampler=accept_all)
    assert chi_square_p_value(first, p[0]) < 0.01


def test_rejection_sampler_with_point_mass_drafts(distributions):
    """n-gram drafts have no distribution: q is one-hot at the draft, and the output is still p."""
    p, _ = distributions
    gen = torch.Generator().manual_seed(99)
    draft = int(p[0].argmax())  # often accepted, so both branches run
    drafts = torch.full((DRAWS, 1), draft)
    num_acc, nxt = rejection_sample(p[:2].expand(DRAWS, 2, -1), drafts, torch.ones(DRAWS, dtype=torch.int64), None, gen)
    first = torch.where(num_acc > 0, drafts[:, 0], nxt)
    assert 0 < int(num_acc.sum()) < DRAWS
    assert chi_square_p_value(first, p[0]) > 0.01
    assert (nxt[num_acc == 0] != draft).all()  # a rejected draft is never re-drawn


def test_sampled_requests_run_with_both_proposers(tiny_model_dir, draft_dir, prompts):
    for spec in ({"method": "ngram", "prompt_lookup_min": 1, **ALWAYS},
                 {"method": "draft_model", "model": str(draft_dir), **ALWAYS}):
        llm = LLM(str(tiny_model_dir), speculative_config=spec, **STRESS)
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=NEW, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == NEW for o in outs)
        assert llm.engine.stats().spec_decode.num_drafts > 0
        assert_all_blocks_free(llm)


# -- block accounting --------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_no_block_leaks_with_preemption_and_aborts(tiny_model_dir, draft_dir, prompts, method):
    spec = ({"method": "ngram", "prompt_lookup_min": 1, **ALWAYS} if method == "ngram"
            else {"method": "draft_model", "model": str(draft_dir), **ALWAYS})
    engine = LLMEngine(model=str(tiny_model_dir), speculative_config=spec, **STRESS)
    params = [GREEDY, SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)]
    for i, prompt in enumerate(prompts * 2):
        engine.add_request(prompt, params[i % 2], request_id=f"r{i}")
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps % 7 == 0:  # abort whichever request is newest, often mid-draft
            running = [s for s in engine.batcher.running if not s.finished]
            if running:
                engine.abort_request(running[-1].request.request_id)
        bm = engine.block_manager
        for seq in engine.batcher.running:  # no sequence holds blocks beyond its lookahead
            assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens + seq.num_lookahead_tokens)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode.num_drafts > 0
    assert stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens
    assert_all_blocks_free(engine)


# -- switches and fallbacks --------------------------------------------------------------------------

def test_logit_bias_applies_at_every_verified_position(tiny_model_dir, prompts):
    """logit_bias is the one logits processing a speculating request can have; drafts see it too."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logit_bias={7: 6.0, 42: 6.0})
    plain = run(LLM(str(tiny_model_dir)), prompts, params)
    llm = LLM(str(tiny_model_dir), speculative_config={"method": "ngram", "prompt_lookup_min": 1, **ALWAYS})
    ours = run(llm, prompts, params)
    assert ours == plain
    assert sum(t in (7, 42) for out in plain for t in out) > len(prompts)  # the bias did change the text
    sd = llm.engine.stats().spec_decode
    assert 0 < sd.num_accepted_tokens < sd.num_draft_tokens


def test_per_request_switch_and_ineligible_requests(tiny_model_dir, prompts):
    llm = LLM(str(tiny_model_dir), speculative_config={"method": "ngram", "prompt_lookup_min": 1, **ALWAYS})
    for params in (SamplingParams(temperature=0, max_tokens=NEW, speculative=False),
                   SamplingParams(temperature=0, max_tokens=NEW, logprobs=2),
                   SamplingParams(temperature=0, max_tokens=NEW, repetition_penalty=1.2),
                   SamplingParams(temperature=0.7, max_tokens=NEW, seed=3)):
        llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.stats().spec_decode.num_drafts == 0, params
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)
    assert llm.engine.stats().spec_decode.num_drafts > 0


def test_falls_back_to_plain_decoding_in_large_batches(tiny_model_dir, prompts):
    spec = {"method": "ngram", "prompt_lookup_min": 1, "min_acceptance_rate": 0.0, "disable_by_batch_size": 2}
    engine = LLMEngine(model=str(tiny_model_dir), speculative_config=spec)
    for i, prompt in enumerate(prompts):  # staggered lengths: the batch shrinks as requests finish
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8 + 8 * i, ignore_eos=True))
    while engine.has_unfinished_requests():
        before = engine.stats().spec_decode.num_drafts
        num_running = len(engine.batcher.running)
        engine.step()
        if num_running > 2:
            assert engine.stats().spec_decode.num_drafts == before
    assert engine.stats().spec_decode.num_drafts > 0  # the last two sequences did speculate


def test_low_acceptance_pauses_drafting(tiny_model_dir, draft_dir, prompts):
    base = {"method": "draft_model", "model": str(draft_dir), "disable_by_batch_size": 64}
    eager = LLM(str(tiny_model_dir), speculative_config={**base, "min_acceptance_rate": 0.0})
    paused = LLM(str(tiny_model_dir), speculative_config={**base, "min_acceptance_rate": 0.5, "pause_steps": 8})
    a = run(eager, prompts)
    b = run(paused, prompts)
    assert a == b
    assert paused.engine.stats().spec_decode.num_drafts < eager.engine.stats().spec_decode.num_drafts / 2


# -- configuration -----------------------------------------------------------------------------------

def test_ngram_lookup_takes_the_longest_most_recent_match():
    ngram = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    assert ngram.lookup([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], 2) == [8, 7]
    assert ngram.lookup([5, 6, 7, 5, 9, 9, 6, 7], 3) == [5, 9, 9]  # [6, 7] matches, [5, 6, 7] does not
    assert ngram.lookup([1, 2, 3, 4], 4) == []
    assert ngram.lookup([4, 1, 4], 5) == [1, 4]
    assert NgramProposer(2, 3).lookup([4, 1, 4], 5) == []  # a 1-token match is below prompt_lookup_min


@pytest.mark.parametrize("bad, message", [
    ('{"method": "medusa"}', "method must be one of"),
    ('{"num_speculative_tokens": 4}', 'needs "method"'),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "must not exceed"),
    ('{"method": "ngram", "lookahead": 2}', "unknown field(s) lookahead"),
    ('{"method": "draft_model"}', 'needs "model"'),
    ('{"method": "ngram"', "not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
])
def test_bad_speculative_config_is_named(bad, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config=bad)
    assert message in str(e.value)


def test_draft_with_another_tokenizer_is_refused(tiny_model_dir, smollm2_dir):
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLMEngine(model=str(tiny_model_dir), speculative_config={"method": "draft_model", "model": str(smollm2_dir)})


def test_cli_flag_reaches_worker_processes():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    config = EngineConfig.from_cli_args(parser.parse_args(["--speculative-config", json.dumps(spec)]))
    assert SpeculativeConfig.parse(config.speculative_config) == SpeculativeConfig(**spec)
    # serve hands the engine flags to each worker process as argv
    again = EngineConfig.from_cli_args(parser.parse_args(EngineConfig(speculative_config=spec).to_cli_args()))
    assert SpeculativeConfig.parse(again.speculative_config) == SpeculativeConfig(**spec)


@pytest.mark.service
def test_serve_with_speculation_gives_plain_text(tiny_model_dir, tmp_path):
    """--speculative-config reaches the worker processes; text equals offline plain decoding either way."""
    from openai import OpenAI

    from tests.stack import ServeStack

    prompt = "Return a new dictionary object. Return a new dictionary object. Return a new"
    expected = LLM(str(tiny_model_dir)).generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text
    spec = json.dumps({"method": "ngram", "prompt_lookup_min": 1, **ALWAYS})
    with ServeStack(tiny_model_dir, extra_args=["--served-model-name", "tiny", "--speculative-config", spec],
                    log_path=tmp_path / "serve.log") as stack:
        client = OpenAI(base_url=stack.base_url, api_key="none")
        for extra in ({"ignore_eos": True}, {"ignore_eos": True, "speculative": False}):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0,
                                            extra_body=extra)
            assert out.choices[0].text == expected
        stack.wait_idle()


def test_bench_speculative_runs_every_section(tiny_model_dir, tmp_path, monkeypatch):
    import metroserve.benchmarks.speculative as bench
    from metroserve.services.cli import main

    monkeypatch.setattr(bench, "cache_root", lambda: tmp_path)  # the early-exit draft is written here
    out_file = tmp_path / "spec.json"
    main(["bench", "speculative", "--model", str(tiny_model_dir), "--rounds", "2", "--max-tokens", "8",
          "--batch-requests", "4", "--draft-layers", "1", "--json-out", str(out_file)])
    results = json.loads(out_file.read_text())["results"]
    assert [r["section"] for r in results] == ["single: n-gram", "single-chat: n-gram", "batch of 4: n-gram",
                                               "single: draft = the target in bfloat16",
                                               "single: draft = first 1 layers"]
    for r in results:
        assert r["plain_tokens_per_s"] > 0 and r["spec_tokens_per_s"] > 0
        assert r["identical_outputs"] == r["requests"]  # verification is exact
    assert (tmp_path / "drafts").is_dir()
