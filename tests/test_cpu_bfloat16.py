"""--dtype bfloat16 on CPU: weights and projection matmuls in bfloat16 (oneDNN: AMX or AVX512-BF16
where the CPU has them, float32 accumulation), activations, KV pool and attention in float32
(worker/engine.py). Greedy output against transformers running the same bfloat16 matmuls, and each
oneDNN instruction-set path this CPU offers, forced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from metroserve import LLM, SamplingParams
from metroserve.worker.attention.cpu import CpuAttention
from metroserve.worker.cpu_kernels import cpu_flags, load_cpu_kernels
from metroserve.worker.model import Linear
from tests.conftest import assert_all_blocks_free
from tests.reference import HFReference
from tests.test_greedy_vs_hf import SMOL_QUESTIONS

BF16_ULPS = 2  # a tie: logits within this many bfloat16 rounding steps of each other


class Bf16MatmulReference(HFReference):
    """transformers' float32 model with every nn.Linear (the head too) multiplying as the engine does:
    input and weight rounded to bfloat16, float32 accumulation, a bfloat16 result widened to float32."""

    def __init__(self, model_dir: Path):
        super().__init__(model_dir)
        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear):
                weight, bias = module.weight.detach().bfloat16(), module.bias

                def forward(x, weight=weight, bias=bias):
                    out = F.linear(x.bfloat16(), weight).float()
                    return out if bias is None else out + bias

                module.forward = forward  # type: ignore[method-assign]

    @torch.inference_mode()
    def near_tie(self, tokens: list[int], a: int, b: int) -> tuple[float, float]:
        """The logits leave a bfloat16 matmul, rounded to 8 significant bits: two within BF16_ULPS
        rounding steps (2^-8 of the larger, each) are a tie at this precision, as are two whose
        difference an earlier layer's rounding moves as much."""
        logits = self.model(torch.tensor([tokens])).logits[0, -1].float()
        step = max(abs(logits[a].item()), abs(logits[b].item())) * 2.0**-8
        return abs(logits[a].item() - logits[b].item()), BF16_ULPS * step


def test_bfloat16_on_cpu_keeps_float32_activations(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="bfloat16")
    engine = llm.engine
    assert engine.kv_cache.k.dtype == torch.float32
    if load_cpu_kernels() is not None:
        assert isinstance(engine.attention, CpuAttention)
    model = engine.model
    projections = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert projections and all(m.panels is None for m in projections)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # oneDNN's packed bfloat16 copies replace the weights
        assert all(m.weight is None and m.packed is not None and m.packed.dtype == torch.bfloat16
                   for m in projections)
        assert model.lm_head_packed is not None and model.lm_head_packed.dtype == torch.bfloat16
    else:  # below AVX-512 (AVX2 CPUs) oneDNN has no bfloat16: plain bfloat16 weights and matmuls
        assert all(m.packed is None and m.weight.dtype == torch.bfloat16 for m in projections)
        assert model.lm_head_packed is None
    assert model.embed_tokens.weight.dtype == torch.float32  # lookups stay exact
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert_all_blocks_free(llm)


def test_bfloat16_resident_weights_are_half(tiny_model_dir):
    float32 = LLM(str(tiny_model_dir), kv_cache_memory="16MiB").engine.model
    bf16 = LLM(str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="16MiB").engine.model
    projection_bytes = 4 * sum(m.in_features * m.out_features for m in bf16.layers.modules() if isinstance(m, Linear))
    # float32 keeps the weights, oneDNN's packed copy and the panels: three copies; bfloat16 one, half as wide
    assert bf16.resident_bytes() < float32.resident_bytes() - 2.4 * projection_bytes


@pytest.fixture(scope="module")
def smollm2_bf16_ref(smollm2_dir):
    return Bf16MatmulReference(smollm2_dir)


def test_bfloat16_greedy_matches_transformers_with_bfloat16_matmuls(smollm2_dir, smollm2_bf16_ref):
    llm = LLM(None, dtype="bfloat16", kv_cache_memory="256MiB")
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in SMOL_QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert_all_blocks_free(llm)
    for prompt, out in zip(prompts, outs):
        smollm2_bf16_ref.assert_matches(prompt, out.outputs[0].token_ids, 24, stop_at_eos=True)


def test_explicit_quantization_with_bfloat16_is_refused(smollm2_dir):
    from metroserve.worker.model_files import ModelLoadError

    with pytest.raises(ModelLoadError, match="--quantization gguf: quantized weights need float32 on CPU"):
        LLM(None, quantization="gguf", dtype="bfloat16")


# oneDNN's instruction-set ceilings (ONEDNN_MAX_CPU_ISA), each with the /proc/cpuinfo flags it needs
# and the implementation its verbose log names for a bfloat16 projection there (None: torch finds no
# oneDNN bfloat16 below AVX-512, and the model keeps plain bfloat16 weights).
ONEDNN_ISAS = {
    "AVX2": ({"avx2"}, None),
    "AVX512_CORE": ({"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "gemm:jit"),
    "AVX512_CORE_BF16": ({"avx512_bf16"}, "avx512_core_bf16"),
    "AVX512_CORE_AMX": ({"amx_bf16", "amx_tile"}, "amx"),
}

# Run under each ceiling: the tiny model's logits for a prompt with --dtype bfloat16's matmuls, and
# with float32's (argv: model dir).
_PROBE = r"""
import json, sys
from pathlib import Path
import torch
from metroserve.worker.model_loader import load_model
from tests.test_quantized import teacher_forced_logits
model_dir = Path(sys.argv[1])
ids = list(range(3, 60))
bf16 = load_model(model_dir, torch.float32, torch.device("cpu"), matmul_dtype=torch.bfloat16)
exact = load_model(model_dir, torch.float32, torch.device("cpu"))
a, b = teacher_forced_logits(bf16, ids), teacher_forced_logits(exact, ids)
print(json.dumps({"packed": bf16.lm_head_packed is not None,
                  "error": ((a - b).abs().max() / b.abs().max()).item()}))
"""


@pytest.mark.parametrize("isa", sorted(ONEDNN_ISAS))
def test_bfloat16_matmuls_on_each_instruction_set(tiny_model_dir, isa):
    """--dtype bfloat16's model under each oneDNN ISA ceiling this CPU reaches: oneDNN's verbose log
    shows its bfloat16 projections ran in that ISA's kernel (below AVX-512: none, plain bfloat16
    matmuls instead), and the logits stay those of float32 matmuls up to bfloat16 rounding."""
    needs, kernel = ONEDNN_ISAS[isa]
    if not torch.backends.mkldnn.is_available() or not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - cpu_flags())} for oneDNN's {isa} path")
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tiny_model_dir)], capture_output=True, text=True,
                         timeout=300, check=True, cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "ONEDNN_VERBOSE": "1"})
    lines = out.stdout.splitlines()
    result = json.loads(lines[-1])
    bf16_products = [ln for ln in lines if ln.startswith("onednn_verbose") and ",exec," in ln
                     and "inner_product" in ln and "src:bf16" in ln]
    if kernel is None:
        assert not result["packed"] and not bf16_products
    else:
        assert result["packed"] and bf16_products, "\n".join(lines[-20:])
        assert all(kernel in ln for ln in bf16_products), bf16_products[:3]
    assert result["error"] < 0.05
