"""Quantized serving (worker/quantization.py): a GGUF's Q4_1/Q8_0 matrices served as they are, and
int8 (Q8_0) made at load, against transformers' float32 model of the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metroserve import LLM, SamplingParams
from metroserve.worker.attention import BatchLayout, TorchAttention, block_tables_to_slots
from metroserve.worker.cpu_kernels import load_cpu_kernels
from metroserve.worker.kv_cache import KVCache
from metroserve.worker.model import DecoderForCausalLM, Linear
from metroserve.worker.model_files import ModelLoadError
from tests.conftest import assert_all_blocks_free
from tests.reference import HFReference
from tests.test_greedy_vs_hf import SMOL_QUESTIONS

TEXT = ("The history of bread begins in the Neolithic era, when people first ground grains into flour and "
        "mixed it with water. Early breads were flat and dense; leavened bread came later, when wild yeasts "
        "were found to make dough rise. Bakers in Egypt built ovens of clay, and by Roman times bakeries were "
        "common in cities, with guilds that set rules for the trade. ") * 3


@pytest.fixture(scope="module")
def quantized(smollm2_dir):
    return LLM(None, kv_cache_memory="256MiB")


@torch.inference_mode()
def teacher_forced_top1(model: DecoderForCausalLM, ids: list[int]) -> torch.Tensor:
    """The model's argmax after each prefix of ids (one prefill of the whole sequence)."""
    return teacher_forced_logits(model, ids).argmax(-1)


@torch.inference_mode()
def teacher_forced_logits(model: DecoderForCausalLM, ids: list[int]) -> torch.Tensor:
    """The model's logits [len(ids), vocab] after each prefix of ids (one prefill of the whole sequence)."""
    n = len(ids)
    attention = TorchAttention(16)
    cfg = model.cfg
    blocks = list(range(-(-n // 16)))
    cache = KVCache(cfg.num_layers, len(blocks), 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    positions = np.arange(n)
    table, slots = block_tables_to_slots([blocks], np.zeros(n, dtype=np.int64), positions, 16, torch.device("cpu"))
    layout = BatchLayout([0], [n], [n], [blocks], table, slots)
    hidden = model(torch.tensor(ids), torch.from_numpy(positions), attention, cache,
                   model.prepare_attention(attention, layout))
    return model.compute_logits(hidden)


def hf_top1(ref, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref.model(torch.tensor([ids])).logits[0].argmax(-1)


def test_gguf_matrices_are_served_in_their_own_types(quantized):
    model = quantized.engine.model
    projections = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert projections and all(m.weight is None for m in projections)
    weights = [m.quantized for m in projections if m.quantized is not None]
    assert len(weights) == len(projections)
    assert {p.qtype for w in weights for p in w.parts} == {3}  # Q4_1
    head = model.lm_head_quantized
    assert head is not None and head.parts[0].qtype == 8  # Q8_0
    quantized_bytes = sum(w.nbytes for w in weights) + head.nbytes
    float_bytes = 4 * (sum(m.in_features * m.out_features for m in projections) + model.embed_tokens.weight.numel())
    assert quantized_bytes < float_bytes / 5  # Q4_1 reads 0.625 bytes per weight, Q8_0 1.06


def test_gguf_quantized_greedy_matches_transformers(quantized, smollm2_ref):
    prompts = [quantized.apply_chat_template([{"role": "user", "content": q}]) for q in SMOL_QUESTIONS]
    outs = quantized.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert_all_blocks_free(quantized)
    for prompt, out in zip(prompts, outs):
        smollm2_ref.assert_matches(prompt, out.outputs[0].token_ids, 20, stop_at_eos=True)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_teacher_forced_top1_agreement(smollm2_dir, smollm2_ref, quantization):
    """>= 99% of next-token argmaxes over a 400-token text equal transformers' float32 model's:
    the GGUF's own Q4_1 / Q8_0 blocks (the same weights transformers dequantized), and int8 made
    from those float32 weights at load (a second rounding)."""
    llm = LLM(None, quantization=quantization, kv_cache_memory="64MiB")
    ids = llm.get_tokenizer().encode(TEXT)[:400]
    ours, ref = teacher_forced_top1(llm.engine.model, ids), hf_top1(smollm2_ref, ids)
    agreement = (ours == ref).float().mean().item()
    assert agreement >= 0.99, agreement
    if quantization == "int8":
        assert {p.qtype for p in llm.engine.model.layers[0].qkv_proj.quantized.parts} == {8}


@pytest.fixture(scope="module")
def int8_inputs(smollm2_dir):
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.int8_gemm_available():
        pytest.skip("the CPU kernels are portable here: no int8-input GEMM")
    return LLM(None, kv_cache_memory="256MiB", quantized_activations="int8")


def quant_parts(llm: LLM) -> list:
    """Every quantized part of the model's projections and head."""
    model = llm.engine.model
    weights = [m.quantized for m in model.layers.modules() if isinstance(m, Linear)] + [model.lm_head_quantized]
    assert all(w is not None for w in weights)
    return [p for w in weights if w is not None for p in w.parts]


def test_inputs_are_float32_by_default(quantized):
    assert not any(p.int8_activations for p in quant_parts(quantized))


def test_int8_inputs_when_asked(int8_inputs):
    assert all(p.int8_activations for p in quant_parts(int8_inputs))


def test_int8_inputs_stay_close_to_transformers(int8_inputs, smollm2_ref):
    """int8 inputs round every projection's input, so greedy output is no longer transformers' (the
    float model's) up to near-ties; what holds is closeness: teacher-forced top-1 agreement >= 95%
    (98.3% measured) with the NLL of the text within 2% of the float inputs', and >= 90% of the
    tokens it generates greedily (the decode path) are the float model's argmax after them."""
    ids = int8_inputs.get_tokenizer().encode(TEXT)[:400]
    logits = teacher_forced_logits(int8_inputs.engine.model, ids)
    with torch.inference_mode():
        ref = smollm2_ref.model(torch.tensor([ids])).logits[0]
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95

    def nll(x: torch.Tensor) -> float:
        return torch.nn.functional.cross_entropy(x[:-1].double(), torch.tensor(ids[1:])).item()

    assert abs(nll(logits) - nll(ref)) <= 0.02 * nll(ref)
    prompts = [int8_inputs.apply_chat_template([{"role": "user", "content": q}]) for q in SMOL_QUESTIONS]
    outs = int8_inputs.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert_all_blocks_free(int8_inputs)
    same = total = 0
    for prompt, out in zip(prompts, outs):
        tokens = prompt + list(out.outputs[0].token_ids)
        with torch.inference_mode():
            best = smollm2_ref.model(torch.tensor([tokens])).logits[0, len(prompt) - 1 : -1].argmax(-1)
        same += (best == torch.tensor(out.outputs[0].token_ids)).sum().item()
        total += len(out.outputs[0].token_ids)
    assert same >= 0.9 * total, (same, total)


def test_int8_inputs_need_a_build_with_integer_products(smollm2_dir, monkeypatch):
    """A portable build (no AVX2) has no int8 GEMM; every x86 machine here has one, so the loader
    is shown such a build's answer."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no CPU kernels here")
    monkeypatch.setattr(kernels, "int8_gemm_available", lambda: False)
    with pytest.raises(ModelLoadError, match="needs CPU kernels built for AVX2 or AVX-512"):
        LLM(None, kv_cache_memory="64MiB", quantized_activations="int8")


@pytest.mark.parametrize("options", [{"quantization": "none"}, {"dtype": "bfloat16"}])
def test_int8_inputs_without_quantized_projections_are_refused(smollm2_dir, options):
    with pytest.raises(ModelLoadError, match="--quantized-activations int8 applies to projections served quantized"):
        LLM(None, kv_cache_memory="64MiB", quantized_activations="int8", **options)


def test_quantization_none_serves_float_weights(smollm2_dir):
    model = LLM(None, quantization="none", kv_cache_memory="64MiB").engine.model
    assert model.lm_head_quantized is None and model.layers[0].qkv_proj.quantized is None


def test_gguf_quantization_needs_a_quantized_checkpoint(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="--quantization gguf"):
        LLM(str(tiny_model_dir), quantization="gguf")


def test_int8_on_a_float_checkpoint(tiny_model_dir):
    """int8 of a Hugging Face model at load: every projection and the head Q8_0, and next-token argmaxes
    (teacher-forced) those of transformers running the same Q8_0-rounded weights. (The tiny random
    model's logits are near-flat, so against its float32 weights the rounding itself flips argmaxes.)"""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from metroserve.worker.quantization import quantize_q8_0

    llm = LLM(str(tiny_model_dir), quantization="int8")
    model = llm.engine.model
    assert all(m.quantized is not None for m in model.layers.modules() if isinstance(m, Linear))
    assert model.lm_head_quantized is not None
    ref = HFReference(tiny_model_dir)
    ref.model.lm_head.weight = torch.nn.Parameter(ref.model.lm_head.weight.clone())  # the embedding stays float
    for module in ref.model.modules():
        if isinstance(module, torch.nn.Linear):
            rounded = dequantize(quantize_q8_0(module.weight), GGMLQuantizationType.Q8_0)
            module.weight.data = torch.from_numpy(rounded).reshape(module.weight.shape)
    ids = llm.get_tokenizer().encode(TEXT)[:300]
    agreement = (teacher_forced_top1(model, ids) == hf_top1(ref, ids)).float().mean().item()
    assert agreement >= 0.99, agreement


def test_quantized_weights_need_float32_on_cpu(smollm2_dir):
    with pytest.raises(ModelLoadError, match="float32 on CPU"):
        LLM(None, quantization="gguf", dtype="bfloat16")


def test_fused_projection_parts_by_type():
    """Q/K/V stored in two types (as a Q4_K_M file keeps V apart) make one projection of two parts,
    each multiplied into its rows; adjacent shards of one type pack as one part."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from metroserve.worker.cpu_kernels import load_cpu_kernels
    from metroserve.worker.quantization import make_weight

    kernels = load_cpu_kernels(required=True)
    gen = np.random.default_rng(0)
    shards = [(quantize(gen.standard_normal((rows, 96)).astype(np.float32), GGMLQuantizationType[kind]), kind)
              for rows, kind in ((48, "Q4_1"), (16, "Q4_1"), (16, "Q8_0"))]
    weight = make_weight(shards, kernels)
    assert [(p.rows, p.qtype) for p in weight.parts] == [(64, 3), (16, 8)]
    dense = np.concatenate([dequantize(b, GGMLQuantizationType[k]).reshape(b.shape[0], 96) for b, k in shards])
    x = torch.from_numpy(gen.standard_normal((5, 96)).astype(np.float32))
    torch.testing.assert_close(weight(x), x @ torch.from_numpy(dense).T, atol=1e-3, rtol=1e-4)


def test_super_block_parts():
    """A projection of Q4_K rows then Q6_K rows (a Q4_K_M file's mix) over 512 inputs: two parts whose
    input count comes from the 256-input super-blocks, multiplying as the dequantized weight."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from metroserve.worker.cpu_kernels import load_cpu_kernels
    from metroserve.worker.quantization import make_weight
    from tests.test_quant_linear import random_super_blocks

    kernels = load_cpu_kernels(required=True)
    gen = np.random.default_rng(1)
    shards = [(random_super_blocks(GGMLQuantizationType[kind], 512, gen), kind) for kind in ("Q4_K", "Q6_K")]
    weight = make_weight(shards, kernels)
    assert [p.qtype for p in weight.parts] == [12, 14] and weight.out_features == 2 * shards[0][0].shape[0]
    dense = np.concatenate([dequantize(b, GGMLQuantizationType[k]).reshape(b.shape[0], 512) for b, k in shards])
    x = torch.from_numpy(gen.standard_normal((3, 512)).astype(np.float32))
    torch.testing.assert_close(weight(x), x @ torch.from_numpy(dense).T, atol=1e-3, rtol=1e-4)
