"""Sampling: seeds, n > 1, logprobs, biases, penalties, min/max tokens, stop tokens and strings."""

from __future__ import annotations

import pytest
import torch

from metroserve import LLM, SamplingParams
from metroserve.worker.sampler import Sampler
from metroserve.worker.sequence import Request
from tests.conftest import assert_all_blocks_free


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir))


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    return [tok.encode(t) for t in ("Return a new dictionary", "The module provides", "Wrap the text so every line",
                                     "Inspect live objects: modules, classes, methods, functions " * 3)]


def gen(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    return outs


def test_same_seed_same_text_alone_and_in_busy_batch(llm, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = gen(llm, [prompts[0]], seeded)[0].outputs[0]
    others = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=5, max_tokens=25, ignore_eos=True, seed=7)]
    busy = gen(llm, [prompts[3], prompts[1], prompts[0], prompts[2]], [others[0], others[1], seeded, others[2]])
    assert busy[2].outputs[0].token_ids == alone.token_ids
    assert busy[2].outputs[0].text == alone.text
    other_seed = gen(llm, [prompts[0]], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20,
                                                       ignore_eos=True))[0].outputs[0]
    assert other_seed.token_ids != alone.token_ids


def test_top_k_1_is_greedy(llm, prompts):
    greedy = gen(llm, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    top1 = gen(llm, prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_n_samples_fork_and_free(llm, prompts):
    out = gen(llm, [prompts[3]], SamplingParams(n=4, temperature=1.5, seed=5, max_tokens=15, ignore_eos=True))[0]
    assert sorted(c.index for c in out.outputs) == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 15 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = gen(llm, [prompts[3]], SamplingParams(n=4, temperature=1.5, seed=5, max_tokens=15, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy_n = gen(llm, [prompts[0]], SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))[0]
    single = gen(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert all(c.token_ids == single.outputs[0].token_ids for c in greedy_n.outputs), "forks see the parent's KV"


def test_logprobs_match_reference(llm, prompts, tiny_ref):
    out = gen(llm, [prompts[1]], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 5
    context = list(prompts[1])
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        ref = tiny_ref.logprobs(context)
        assert token in entry and 3 <= len(entry) <= 4
        assert entry[token] == pytest.approx(ref[token].item(), abs=1e-4)
        top3 = ref.topk(3).indices.tolist()
        assert set(top3) <= set(entry)
        total += entry[token]
        context.append(token)
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_logit_bias_min_tokens_stop_token_ids_ignore_eos(llm, prompts):
    eos = llm.engine.eos_token_ids[0]
    forced = gen(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=6, logit_bias={42: 100}))[0].outputs[0]
    assert forced.token_ids == [42] * 6 and forced.finish_reason == "length"
    eos_first = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100})
    assert gen(llm, [prompts[0]], eos_first)[0].outputs[0].token_ids == [eos]
    min5 = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100}, min_tokens=5)
    out = gen(llm, [prompts[0]], min5)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    stop_tok = gen(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=20, logit_bias={42: 100},
                                                     stop_token_ids=[42]))[0].outputs[0]
    assert stop_tok.token_ids == [42] and stop_tok.finish_reason == "stop" and stop_tok.stop_reason == 42
    assert stop_tok.text == "", "a stop token's text is not part of the output"
    ignore = gen(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=7, logit_bias={eos: 100},
                                                   ignore_eos=True))[0].outputs[0]
    assert ignore.token_ids == [eos] * 7 and ignore.finish_reason == "length"


def test_stop_strings_cut_text(llm, prompts):
    base = gen(llm, [prompts[2]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string, got {stop!r} from {text!r}"
    cut = text[: text.index(stop)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    out = gen(llm, [prompts[2]], params)[0].outputs[0]
    assert out.text == cut and out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 30
    kept = gen(llm, [prompts[2]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop,
                                                 include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == cut + stop
    # Before min_tokens, stop strings do not end the sequence.
    late = gen(llm, [prompts[2]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                 min_tokens=30))[0].outputs[0]
    assert late.text == text and late.finish_reason == "length"


def _seq(tokens, prompt_len, **params):
    request = Request("r", None, tokens[:prompt_len], SamplingParams(**params))
    seq = request.seqs[0]
    seq.token_ids = list(tokens)
    return seq


def test_sampler_penalties_and_filters():
    sampler = Sampler(eos_token_ids=[9], device=torch.device("cpu"))
    logits = torch.tensor([[2.0, 1.9, 1.0, 0.5, -1.0, -1.0, -1.0, -1.0, -1.0, 3.0]])
    # Token 9 (EOS) banned by min_tokens; token 0 repeated, so 2.0 / 1.5 < 1.9.
    seq = _seq([5, 0], 1, temperature=0, repetition_penalty=1.5, min_tokens=3)
    assert sampler(logits, [seq]).token_ids == [1]
    seq = _seq([5, 0, 0], 1, temperature=0, frequency_penalty=0.1, presence_penalty=0.0)
    # 3.0 for EOS still wins: penalties only touch generated tokens.
    assert sampler(logits, [seq]).token_ids == [9]
    seq = _seq([5, 9], 1, temperature=0, presence_penalty=1.5)
    assert sampler(logits, [seq]).token_ids == [0]

    probs = torch.tensor([[0.5, 0.3, 0.2] + [0.0] * 7]).clamp_min(1e-12).log()
    def draws(**params):
        seqs = [_seq([1], 1, seed=i, **params) for i in range(300)]
        return set(sampler(probs.repeat(300, 1), seqs).token_ids)
    assert draws(temperature=1.0) == {0, 1, 2}
    assert draws(temperature=1.0, top_k=2) == {0, 1}
    assert draws(temperature=1.0, top_p=0.5) == {0}
    assert draws(temperature=1.0, top_p=0.8) == {0, 1}
    assert draws(temperature=1.0, min_p=0.5) == {0, 1}
    # top-p is measured within the top-k set (renormalized), as in HF and vLLM.
    probs = torch.tensor([[0.4, 0.3, 0.12, 0.1, 0.08] + [0.0] * 5]).clamp_min(1e-12).log()
    assert draws(temperature=1.0, top_k=3, top_p=0.85) == {0, 1}


def test_a_temperature_below_sampling_eps_is_greedy(llm, prompts):
    """Logits divided by 1e-300 overflow to infinities whose softmax is NaN: such a row picked token 0,
    and under a grammar a token the grammar forbids, which stopped the engine (found by fuzzing)."""
    from metroserve.common.sampling_params import SAMPLING_EPS
    from metroserve.common.structured_outputs import StructuredOutputsParams

    def tokens(temperature: float) -> list[list[int]]:
        params = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True)
        return [o.outputs[0].token_ids for o in gen(llm, prompts, params)]

    greedy = tokens(0.0)
    for temperature in (5e-324, 1e-300, SAMPLING_EPS / 2):
        assert SamplingParams(temperature=temperature).greedy
        assert tokens(temperature) == greedy
    choice = StructuredOutputsParams(choice=("yes", "no"))
    out = llm.generate(prompts, SamplingParams(temperature=1e-300, max_tokens=8, structured_outputs=choice),
                       use_tqdm=False)
    assert all(o.outputs[0].text in ("yes", "no") for o in out)
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy
    assert_all_blocks_free(llm)


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token(llm, prompts):
    """5e-324 is 0 in float32: every token was dropped, the row became NaN and picked token 0
    (under a grammar, a forbidden one: found by fuzzing). The top token always stays."""
    probs = Sampler.probs(torch.tensor([[1.0, 3.0, 2.0]]), [SamplingParams(top_p=5e-324)])
    assert probs.tolist() == [[0.0, 1.0, 0.0]]
    greedy = [o.outputs[0].token_ids for o in gen(llm, prompts, SamplingParams(temperature=0, max_tokens=8,
                                                                               ignore_eos=True))]
    sampled = gen(llm, prompts, SamplingParams(temperature=1.0, top_p=5e-324, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in sampled] == greedy


@pytest.mark.parametrize("penalty", [5e-324, 1e300])
def test_an_extreme_repetition_penalty_gives_no_nan(penalty):
    """Either extreme rounded to 0 or inf in float32 made NaN logits (found by fuzzing)."""
    logits = torch.tensor([[2.0, 0.0, -1.0, float("-inf")]])
    out = Sampler([3], torch.device("cpu")).process_logits(logits, [_seq([0, 1, 2, 3], 4, repetition_penalty=penalty)])
    assert not out.isnan().any() and out[0, 3] == float("-inf"), out
