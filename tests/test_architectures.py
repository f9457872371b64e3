"""Every model family the engine serves gives transformers' greedy token ids (up to shown
near-ties) through batching, chunked prefill, prefix caching, preemption and n-gram speculation.

Each family is a tiny random model built from transformers' own config class
(benchmarks/random_model.write_random_family) with its switches on: Qwen2's biases and its upper
layer sliding, Qwen3's q/k norms and attention biases, Mistral's and Phi-3's windows (Phi-3 with
partial rotary), Gemma 2's alternating windows, query scale and soft-capping, Gemma 3's q/k norms
and local RoPE. The windows (8-40 tokens) are shorter than the longer prompts (up to ~200 tokens),
so the sliding layers attend to a window, across block boundaries and after cached prefixes.
"""

from __future__ import annotations

import pytest

from benchmarks.random_model import FAMILIES, write_random_family
from metroserve import LLM, SamplingParams
from metroserve.worker.model import SLIDING
from tests.conftest import assert_all_blocks_free
from tests.reference import HFReference
from tests.test_greedy_vs_hf import tiny_prompts

NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
ALWAYS = {"disable_by_batch_size": 64, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(model dir, transformers reference, prompts) of one family."""
    from transformers import AutoTokenizer

    path = write_random_family(tmp_path_factory.mktemp(request.param), request.param)
    prompts = tiny_prompts(AutoTokenizer.from_pretrained(str(path)))
    return path, HFReference(path), prompts


def run(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm)
    return [o.outputs[0].token_ids for o in outs]


def check(ref: HFReference, prompts, outputs) -> None:
    for prompt, ours in zip(prompts, outputs):
        ref.assert_matches(prompt, ours, NEW, stop_at_eos=False)


def test_family_has_its_switches(family):
    path, _, prompts = family
    cfg = LLM(str(path)).engine.model_config
    if cfg.sliding_window:  # the window must bite: some prompts are longer
        assert SLIDING in cfg.layer_types and max(map(len, prompts)) > 2 * cfg.sliding_window


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mixed_batch(family, backend):
    path, ref, prompts = family
    check(ref, prompts, run(LLM(str(path), attention_backend=backend), prompts))


def test_chunked_prefill(family):
    path, ref, prompts = family
    check(ref, prompts, run(LLM(str(path), max_num_batched_tokens=7), prompts))


def test_prefix_caching(family):
    path, ref, prompts = family
    shared = prompts[4]
    extended = [shared + p for p in prompts[:4]]
    llm = LLM(str(path), block_size=16)
    outputs = run(llm, extended[:1]) + run(llm, extended[1:])
    assert llm.engine.stats().prefix_cache_hits >= 3 * (len(shared) // 16) * 16
    check(ref, extended, outputs)


def test_preemption(family):
    """A pool that fits the longest request alone: the rest are preempted and recomputed. Four times
    the prompts, in 64-token chunks, so that models whose blocks leave with their window (holding
    about window / block size + 1 per sequence) still outgrow it."""
    path, ref, prompts = family
    longest = max(len(p) for p in prompts) + NEW
    llm = LLM(str(path), block_size=4, num_gpu_blocks_override=-(-longest // 4) + 4, max_num_batched_tokens=64)
    outputs = run(llm, prompts * 4)
    assert llm.engine.stats().num_preemptions > 0
    check(ref, prompts * 4, outputs)


def test_ngram_speculation(family):
    """Drafts verified as query rows of up to 5 tokens each, in sliding layers too; greedy output
    unchanged. (Whether any draft is accepted depends on the random model repeating itself; the
    attention of a verification row is the same either way.)"""
    path, ref, prompts = family
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=24, num_gpu_blocks_override=96,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, **ALWAYS})
    outputs = run(llm, prompts)
    assert llm.engine.stats().spec_decode.num_draft_tokens >= len(prompts)
    check(ref, prompts, outputs)


def test_sharded_checkpoint(family, tmp_path):
    """A checkpoint split over several safetensors files (with its index) loads the same weights."""
    import shutil

    from transformers import AutoModelForCausalLM

    path, _, prompts = family
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(path)).save_pretrained(sharded, max_shard_size="40KB")
    for f in path.iterdir():
        if "token" in f.name or f.name == "generation_config.json":
            shutil.copy(f, sharded / f.name)
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert run(LLM(str(sharded)), prompts[:3]) == run(LLM(str(path)), prompts[:3])


def test_blocks_behind_the_window_are_released(family):
    """Every layer sliding: a long prompt's blocks go back to the pool as the window passes them, so
    the sequence holds about window + one chunk of blocks, and the output is unchanged; a repeat of
    the prompt still hits the prefix cache (released blocks stay cached until reused). A model with
    any full-attention layer keeps every block."""
    path, ref, prompts = family
    bs, chunk = 4, 16
    llm = LLM(str(path), block_size=bs, max_num_batched_tokens=chunk)
    bm = llm.engine.block_manager
    window = llm.engine.model_config.sliding_window
    all_sliding = window is not None and SLIDING in llm.engine.model_config.layer_types and \
        len(set(llm.engine.model_config.layer_types)) == 1
    assert bm.sliding_window == (window if all_sliding else None)
    prompt = prompts[4]
    first = run(llm, [prompt])
    second = run(llm, [prompt])
    stats = llm.engine.stats()
    assert second == first and stats.prefix_cache_hits > 0
    check(ref, [prompt], first)
    # n = 3 forks share the table, released entries included; each sample frees what it holds.
    forked = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, n=3),
                          use_tqdm=False)
    assert_all_blocks_free(llm)
    assert [o.token_ids for o in forked[0].outputs] == first * 3
    if all_sliding:
        assert stats.peak_used_blocks <= -(-window // bs) + chunk // bs + 2 < (len(prompt) + NEW) // bs
