"""The decoder layer's fused CPU kernels (csrc/layer_ops.cpp) and the panel GEMM (csrc/packed_linear.cpp)
against the torch ops they replace, the model with them against the model without them, and the
attention kernels built for the instruction sets this machine's own build does not use (builds that
tests/test_quant_linear.py shares)."""

import platform
import subprocess
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import get_cxx_compiler

from metroserve.worker.attention import TorchAttention
from metroserve.worker.attention.cpu import CpuAttention
from metroserve.worker.cpu_kernels import CFLAGS, CSRC, cpu_flags, kernel_build, load_cpu_kernels, load_or_build
from metroserve.worker.kv_cache import KVCache
from metroserve.worker.model import apply_rope
from tests.test_attention import SCALES_AND_CAPS, WINDOWS, random_layout, windowed_case


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    if k is None:
        pytest.skip("no C++ toolchain for the CPU kernels")
    return k


@pytest.mark.parametrize("rows", [1, 7, 300])  # one decode row, a few, and more rows than one parallel task
def test_layer_ops_match_torch(kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    hidden, inter, heads, kv_heads, head_dim = 96, 160, 6, 2, 16
    x, residual = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), F.rms_norm(x, (hidden,), weight, 1e-5))

    summed = x + residual
    normed = kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, summed)  # the residual stream is updated in place, exactly
    torch.testing.assert_close(normed, F.rms_norm(summed, (hidden,), weight, 1e-5))

    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), F.silu(gate) * up)

    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)
    freqs = torch.randint(0, 4000, (rows,), generator=gen).float()[:, None] * (
        1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    rotated = heads + kv_heads
    expected = apply_rope(qkv[:, : rotated * head_dim].view(rows, rotated, head_dim), cos[:, None], sin[:, None])
    values = qkv[:, rotated * head_dim :].clone()
    kernels.rotary_embedding(qkv, rotated, head_dim, cos, sin)
    torch.testing.assert_close(qkv[:, : rotated * head_dim].view(rows, rotated, head_dim), expected)
    assert torch.equal(qkv[:, rotated * head_dim :], values)  # V is not rotated


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37])
def test_store_kv_matches_index_copy(kernels, pool_dtype, tokens):
    """store_kv writes what the torch backend's index_copy_ pair writes, bit for bit (bfloat16 pools
    rounded as .to() rounds), from K and V that are column slices of one qkv row, and nothing else."""
    gen = torch.Generator().manual_seed(tokens)
    num_blocks, block_size, kv_heads, head_dim, q_size = 8, 16, 2, 16, 64
    kv_size = kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen) * 3
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_pool, v_pool = torch.randn(shape, generator=gen).to(pool_dtype), torch.randn(shape, generator=gen).to(pool_dtype)
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    expected_k.view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(pool_dtype))
    expected_v.view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(pool_dtype))
    kernels.store_kv(k, v, k_pool, v_pool, slots)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.store_kv(k, v, k_pool, v_pool, torch.full((tokens,), num_blocks * block_size))


@pytest.mark.parametrize("rows", [1, 5, 13, 64, 300])  # partial and whole row tiles of AVX2 (6) and AVX-512 (12)
def test_packed_linear_matches_torch(kernels, rows):
    """The panel GEMM against F.linear, with output columns that end inside a panel and an odd K."""
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(100, 67, generator=gen), torch.randn(rows, 67, generator=gen)
    panels = kernels.pack_linear_weight(weight)
    assert panels.shape[0] * panels.shape[2] >= 100 and panels.shape[1] == 67
    torch.testing.assert_close(kernels.packed_linear(x, panels, 100), F.linear(x, weight))
    strided = torch.randn(rows, 80, generator=gen)[:, :67]  # rows need not be adjacent
    torch.testing.assert_close(kernels.packed_linear(strided, panels, 100), F.linear(strided, weight))
    with pytest.raises(RuntimeError, match="out_features"):
        kernels.packed_linear(x, panels, 60)


def test_model_with_kernels_matches_torch_path(kernels, tiny_model_dir):
    """The whole model (packed weights, panel GEMM, fused norms, RoPE and SiLU) against its torch code
    path on one flat batch of prefill chunks and decodes."""
    from metroserve.worker.model_loader import load_model

    model = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    assert all(layer.kernels is kernels for layer in model.layers)
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    bs, num_blocks = 16, 64
    query_lens, context_lens = [40, 1, 1, 25], [40, 70, 9, 50]
    layout = random_layout(gen, num_blocks, bs, query_lens, context_lens)
    ids = torch.randint(0, cfg.vocab_size, (sum(query_lens),), generator=gen)
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
    attention = TorchAttention(bs)
    outputs = []
    for use_kernels in (True, False):
        for module in model.modules():
            if hasattr(module, "kernels"):
                setattr(module, "kernels", kernels if use_kernels else None)  # noqa: B010 (an nn.Module attribute)
        cache = KVCache(cfg.num_layers, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                        torch.device("cpu"))
        with torch.inference_mode():
            hidden = model(ids, positions, attention, cache, model.prepare_attention(attention, layout))
            outputs.append(model.compute_logits(hidden))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)


# The engine's build targets this machine (-march=native: AVX-512 here); these take the kernels'
# AVX2 paths (vec.h's 8-lane tiles) and their portable loops. Attention and the quantized GEMM only
# (tests/test_quant_linear.py tests the latter), built once per machine and source change (about
# 30 s each on 2 cores) into the kernel cache.
ISA_MARCH = {"avx2": "-march=x86-64-v3", "portable": "-march=x86-64"}
# Builds for the int8-activation GEMM's other paths (tests/test_quant_linear.py), each run where the
# CPU can: AVX-VNNI dot products on an AVX2 machine, and AVX-512 without VNNI (byte products in
# 16 lanes). The builds above have no VNNI; this machine's own build may have the 16-lane VNNI path.
EXTRA_ISA_MARCH = {"avx2-vnni": "-march=x86-64-v3 -mavxvnni", "avx512": "-march=x86-64-v4"}
EXTRA_ISA_NEEDS = {"avx2-vnni": "avx_vnni", "avx512": "avx512bw"}  # /proc/cpuinfo's flag
ISA_SOURCES = ("paged_decode_attention.cpp", "paged_prefill_attention.cpp", "quant_linear.cpp", "quant_linear_int8.cpp",
               "kv_store.cpp", "bindings.cpp")


def build_for_instruction_set(isa: str) -> ModuleType:
    """The kernels built for `isa` (a key of ISA_MARCH or EXTRA_ISA_MARCH); skips where this machine
    cannot build or run them."""
    if platform.machine() != "x86_64" or load_cpu_kernels() is None:
        pytest.skip("the instruction-set builds are x86-64 builds of the CPU kernels")
    if isa in EXTRA_ISA_NEEDS and EXTRA_ISA_NEEDS[isa] not in cpu_flags():
        pytest.skip(f"this CPU cannot run the {isa} build (no {EXTRA_ISA_NEEDS[isa]})")
    march = {**ISA_MARCH, **EXTRA_ISA_MARCH}[isa]
    cflags = tuple(flag for f in CFLAGS for flag in (march.split() if f == "-march=native" else [f]))
    build = kernel_build(tuple(CSRC / name for name in ISA_SOURCES), (*cflags, "-DMETROSERVE_ISA_TEST_BUILD"),
                         name=f"metroserve_isa_{isa.replace('-', '_')}")
    defines = subprocess.run([get_cxx_compiler(), *cflags, "-dM", "-E", "-x", "c++", "/dev/null"],
                             capture_output=True, text=True, check=True).stdout
    assert ("__AVX512BW__" in defines, "__AVX2__" in defines) == (isa == "avx512", isa != "portable")
    assert ("__AVXVNNI__" in defines, "__AVX512VNNI__" in defines) == (isa == "avx2-vnni", False)
    module = load_or_build(build).module
    assert not hasattr(module, "rms_norm")  # this build, not the engine's module of the same functions
    return module


# Attention's paths: AVX2, portable, and AVX-512 (16-lane decode products) where the CPU runs it.
ATTENTION_ISAS = [*sorted(ISA_MARCH), "avx512"]


@pytest.fixture(scope="module", params=ATTENTION_ISAS)
def isa_kernels(request):
    return build_for_instruction_set(request.param)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("scale, softcap", SCALES_AND_CAPS)
def test_attention_kernels_for_each_instruction_set(isa_kernels, window, scale, softcap):
    backend = CpuAttention(16)
    backend.kernels = isa_kernels
    got, expected = windowed_case(backend, window, scale, softcap)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
