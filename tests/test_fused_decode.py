"""A decode step's layers in one C++ call (worker/fused_decode.py) compute bitwise what the Python
layer loop computes: every step's logits equal with the stack and without it, on quantized weights
(float32 and int8 inputs), float32 panels, a bfloat16 KV pool, biases and sliding windows, with
speculative verification rows; and it is taken only by the layers it implements."""

from __future__ import annotations

import pytest
import torch

from benchmarks.random_model import write_random_family
from metroserve import LLM, SamplingParams
from metroserve.worker.cpu_kernels import load_cpu_kernels
from metroserve.worker.fused_decode import FusedDecode
from tests.conftest import assert_all_blocks_free
from tests.test_greedy_vs_hf import tiny_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 64,
         "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    k = load_cpu_kernels()
    if k is None:
        pytest.skip("no C++ toolchain for the CPU kernels")
    return k


def logits_per_step(llm: LLM, prompts: list[list[int]], fused: bool) -> tuple[list[torch.Tensor], list[list[int]], int]:
    """Every step's logits and the greedy outputs, with the fused path on or off; and how many steps took it."""
    model = llm.engine.model
    stack = model.fused_decode
    assert stack is not None
    model.fused_decode = stack if fused else None
    seen: list[torch.Tensor] = []
    fused_steps = 0
    compute_logits, forward = model.compute_logits, stack.forward

    def record(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(compute_logits(hidden).clone())
        return seen[-1]

    def counted(*args, **kwargs):
        nonlocal fused_steps
        fused_steps += 1
        return forward(*args, **kwargs)

    model.compute_logits, stack.forward = record, counted
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    finally:
        model.compute_logits, stack.forward, model.fused_decode = compute_logits, forward, stack
    assert_all_blocks_free(llm)
    return seen, [o.outputs[0].token_ids for o in outs], fused_steps


def assert_fused_equals_python(llm: LLM, prompts: list[list[int]]) -> None:
    """Two runs of the same prompts (prefix caching off: a cached prefix changes the prefill's sums)."""
    fused, fused_out, steps = logits_per_step(llm, prompts, fused=True)
    python, python_out, none = logits_per_step(llm, prompts, fused=False)
    assert steps > 0 and none == 0
    assert fused_out == python_out
    assert len(fused) == len(python) and all(torch.equal(a, b) for a, b in zip(fused, python))


@pytest.mark.parametrize("options", [{}, {"quantized_activations": "int8"}, {"quantization": "none"},
                                     {"kv_cache_dtype": "bfloat16"}],
                         ids=["quantized", "int8-inputs", "float32-panels", "bfloat16-kv"])
def test_smollm2_decode_steps_are_bitwise_the_python_path(smollm2_dir, kernels, options):
    if options.get("quantized_activations") == "int8" and not kernels.int8_gemm_available():
        pytest.skip("the portable build has no int8-input GEMM")
    llm = LLM(None, kv_cache_memory="128MiB", speculative_config=NGRAM, enable_prefix_caching=False, **options)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "1, 2, 3, 4, 5, 6,", "Once upon a time")]
    assert_fused_equals_python(llm, prompts)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])  # windows; Qwen2's qkv biases
def test_windows_and_biases_are_bitwise_the_python_path(family, tmp_path):
    from transformers import AutoTokenizer

    path = write_random_family(tmp_path, family)
    prompts = tiny_prompts(AutoTokenizer.from_pretrained(str(path)))  # some longer than the window
    assert_fused_equals_python(LLM(str(path), speculative_config=NGRAM, enable_prefix_caching=False), prompts)


@pytest.mark.parametrize("family, fused", [("mistral", True), ("qwen3", False), ("phi3", False), ("gemma2", False),
                                           ("gemma3", False)])
def test_taken_only_by_the_layers_it_implements(family, fused, tmp_path):
    """Qwen3's q/k norms, Phi-3's partial rotary, Gemma's sandwich norms and GELU keep the Python path."""
    model = LLM(str(write_random_family(tmp_path, family))).engine.model
    assert (model.fused_decode is not None) == fused
    if fused:
        assert isinstance(model.fused_decode, FusedDecode)
