"""Invariant 1: greedy output equals Hugging Face transformers token for token, whatever the
batch composition, chunking, prefix caching or preemption (up to shown near-ties)."""

from __future__ import annotations

import pytest

from metroserve import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free


def tiny_prompts(tokenizer) -> list[list[int]]:
    texts = [
        "Return a new dictionary object",
        "The module provides",
        "x",
        "A list of tuples with the name and value of each attribute of the object, sorted by name. " * 3,
        "Inspect live objects: modules, classes, methods, functions, tracebacks, frame objects and code objects. " * 6,
        "Wrap the text so every line is at most width characters long.",
    ]
    return [tokenizer.encode(t) for t in texts]


TINY_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=TINY_NEW, ignore_eos=True)


def run(llm: LLM, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_prompts_ids(tiny_model_dir):
    from transformers import AutoTokenizer

    return tiny_prompts(AutoTokenizer.from_pretrained(str(tiny_model_dir)))


def check_all(ref, prompts, outputs, max_new=TINY_NEW, stop_at_eos=False):
    for prompt, ours in zip(prompts, outputs):
        ref.assert_matches(prompt, ours, max_new, stop_at_eos=stop_at_eos)


def test_tiny_single_request(tiny_model_dir, tiny_ref, tiny_prompts_ids):
    llm = LLM(str(tiny_model_dir))
    for prompt in tiny_prompts_ids:
        check_all(tiny_ref, [prompt], run(llm, [prompt]))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_tiny_mixed_batch(tiny_model_dir, tiny_ref, tiny_prompts_ids, backend):
    llm = LLM(str(tiny_model_dir), attention_backend=backend)
    outputs = run(llm, tiny_prompts_ids)
    assert llm.engine.stats().num_preemptions == 0
    check_all(tiny_ref, tiny_prompts_ids, outputs)


def test_tiny_chunked_prefill(tiny_model_dir, tiny_ref, tiny_prompts_ids):
    # A 7-token budget splits every long prompt into many chunks, interleaved with decodes.
    llm = LLM(str(tiny_model_dir), max_num_batched_tokens=7)
    check_all(tiny_ref, tiny_prompts_ids, run(llm, tiny_prompts_ids))


def test_tiny_prefix_caching(tiny_model_dir, tiny_ref, tiny_prompts_ids):
    shared = tiny_prompts_ids[4]  # long enough for several full blocks
    prompts = [shared + p for p in tiny_prompts_ids[:4]]
    llm = LLM(str(tiny_model_dir), block_size=16)
    first = run(llm, prompts[:1])
    rest = run(llm, prompts[1:])
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 3 * (len(shared) // 16) * 16
    check_all(tiny_ref, prompts, first + rest)


def test_tiny_preemption(tiny_model_dir, tiny_ref, tiny_prompts_ids):
    # Every prompt fits alone, but not all at once: the newest get preempted and recomputed.
    longest = max(len(p) for p in tiny_prompts_ids) + TINY_NEW
    num_blocks = -(-longest // 4) + 4
    llm = LLM(str(tiny_model_dir), block_size=4, num_gpu_blocks_override=num_blocks)
    outputs = run(llm, tiny_prompts_ids)
    assert llm.engine.stats().num_preemptions > 0
    check_all(tiny_ref, tiny_prompts_ids, outputs)


def test_tiny_preemption_with_prefix_caching_off(tiny_model_dir, tiny_ref, tiny_prompts_ids):
    longest = max(len(p) for p in tiny_prompts_ids) + TINY_NEW
    llm = LLM(str(tiny_model_dir), block_size=4, num_gpu_blocks_override=-(-longest // 4) + 4,
              enable_prefix_caching=False, max_num_batched_tokens=16)
    outputs = run(llm, tiny_prompts_ids)
    assert llm.engine.stats().num_preemptions > 0
    check_all(tiny_ref, tiny_prompts_ids, outputs)


# SmolLM2-135M end to end: real chat prompts, natural EOS.

SMOL_NEW = 20
SMOL_GREEDY = SamplingParams(temperature=0, max_tokens=SMOL_NEW)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return LLM(str(smollm2_dir), kv_cache_memory="512MiB")


SMOL_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
                  "Explain in one sentence what a hash table is. " * 4, "List three prime numbers."]


@pytest.fixture(scope="module")
def smol_prompts(smol):
    return [smol.apply_chat_template([{"role": "user", "content": q}]) for q in SMOL_QUESTIONS]


def test_smollm2_single_request(smol, smollm2_ref, smol_prompts):
    for prompt in smol_prompts[:2]:
        check_all(smollm2_ref, [prompt], run(smol, [prompt], SMOL_GREEDY), SMOL_NEW, stop_at_eos=True)


def test_smollm2_mixed_batch(smol, smollm2_ref, smol_prompts):
    check_all(smollm2_ref, smol_prompts, run(smol, smol_prompts, SMOL_GREEDY), SMOL_NEW, stop_at_eos=True)


def test_smollm2_chunked_prefill(smollm2_dir, smollm2_ref, smol_prompts):
    llm = LLM(str(smollm2_dir), max_num_batched_tokens=24, kv_cache_memory="256MiB")
    check_all(smollm2_ref, smol_prompts, run(llm, smol_prompts, SMOL_GREEDY), SMOL_NEW, stop_at_eos=True)


def test_smollm2_prefix_caching(smol, smollm2_ref, smol_prompts):
    # The same conversations again, plus follow-ups that extend them: all hit the cache.
    before = smol.engine.stats().prefix_cache_hits
    first = run(smol, smol_prompts, SMOL_GREEDY)
    tok = smol.get_tokenizer()
    follow = [smol.apply_chat_template([{"role": "user", "content": q},
                                        {"role": "assistant", "content": tok.decode(o, skip_special_tokens=True)},
                                        {"role": "user", "content": "Shorter, please."}])
              for q, o in zip(SMOL_QUESTIONS, first)]
    again = run(smol, smol_prompts + follow, SMOL_GREEDY)
    assert smol.engine.stats().prefix_cache_hits - before >= sum(len(p) // 16 * 16 for p in smol_prompts)
    assert again[: len(first)] == first
    check_all(smollm2_ref, follow, again[len(first):], SMOL_NEW, stop_at_eos=True)


def test_smollm2_preemption(smollm2_dir, smollm2_ref, smol_prompts):
    longest = max(len(p) for p in smol_prompts) + SMOL_NEW
    llm = LLM(str(smollm2_dir), block_size=16, num_gpu_blocks_override=-(-longest // 16) + 3)
    outputs = run(llm, smol_prompts, SMOL_GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    check_all(smollm2_ref, smol_prompts, outputs, SMOL_NEW, stop_at_eos=True)


def test_cpu_model_uses_packed_weights_with_plain_matmul_results(tiny_model_dir):
    """float32 on CPU: every projection and the vocabulary head run through pre-packed weights (the
    compiled panel GEMM up to PANEL_MAX_ROWS rows where the CPU kernels build, oneDNN's packing above
    and for the head) and agree with plain matmuls."""
    import torch
    import torch.nn.functional as F

    from metroserve.worker.model import PANEL_MAX_ROWS, Linear
    from metroserve.worker.model_loader import load_model

    model = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    projections = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert len(projections) == 4 * model.cfg.num_layers
    assert model.lm_head_packed is not None and all(m.packed is not None for m in projections)
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 5, 37, PANEL_MAX_ROWS + 1):  # decode-sized batches, and one past the panel GEMM's
        hidden = torch.randn(rows, model.cfg.hidden_size, generator=gen)
        expected = F.linear(model.norm(hidden), model.lm_head_weight())
        torch.testing.assert_close(model.compute_logits(hidden), expected, atol=1e-4, rtol=1e-4)
        for proj in projections[:4]:
            x = torch.randn(rows, proj.in_features, generator=gen)
            torch.testing.assert_close(proj(x), F.linear(x, proj.weight), atol=1e-4, rtol=1e-4)
    # A bfloat16 model (a draft's: tests/test_cpu_bfloat16.py covers the engine's --dtype bfloat16) packs
    # for oneDNN's bfloat16 kernels where torch finds them (AVX-512 and up); float16 keeps plain matmuls.
    packed = load_model(tiny_model_dir, torch.bfloat16, torch.device("cpu")).lm_head_packed
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert packed is not None and packed.dtype == torch.bfloat16
    else:
        assert packed is None
    assert load_model(tiny_model_dir, torch.float16, torch.device("cpu")).lm_head_packed is None
