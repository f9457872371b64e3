"""--kv-cache-dtype bfloat16: the CPU kernels read a bfloat16 pool as the float32 kernels read a
float32 pool holding the same rounded values (bitwise, on every instruction-set build), so the
engine's greedy output equals a float32 engine whose K/V are rounded to bfloat16 as they are
stored; the pool holds twice the blocks in the same memory; backends that cannot widen refuse it."""

from __future__ import annotations

import pytest
import torch

from metroserve import LLM, SamplingParams
from metroserve.worker.cpu_kernels import load_cpu_kernels
from tests.conftest import assert_all_blocks_free
from tests.test_cpu_kernels import ATTENTION_ISAS, build_for_instruction_set
from tests.test_greedy_vs_hf import tiny_prompts


@pytest.fixture(scope="module", params=["native", *ATTENTION_ISAS])
def kernels(request):
    if request.param == "native":
        k = load_cpu_kernels()
        if k is None:
            pytest.skip("no C++ toolchain for the CPU kernels")
        return k
    return build_for_instruction_set(request.param)


def rounded_pools(gen: torch.Generator, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    """(bfloat16 K, V pools; the same values as float32)."""
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).bfloat16()
    return k, v, k.float(), v.float()


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (20, 0.0), (0, 2.5)])
def test_decode_over_bfloat16_pool_is_float32_over_rounded_pool(kernels, head_dim, window, softcap):
    gen = torch.Generator().manual_seed(head_dim + window)
    k, v, kf, vf = rounded_pools(gen, 48, 16, 2, head_dim)
    for batch in (1, 6):  # per-(sequence, KV head) tasks and per-sequence tasks
        lens = torch.tensor([3, 17, 64, 100, 127, 9][:batch])
        tables = torch.randperm(48, generator=gen)[:batch * 8].view(batch, 8)
        q = 3 * torch.randn(batch, 6, head_dim, generator=gen)
        got = kernels.paged_decode_attention(q, k, v, tables, lens, 0.2, window, softcap)
        expected = kernels.paged_decode_attention(q, kf, vf, tables, lens, 0.2, window, softcap)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("window, softcap", [(0, 0.0), (24, 0.0), (0, 2.5)])
def test_prefill_over_bfloat16_pool_is_float32_over_rounded_pool(kernels, window, softcap):
    gen = torch.Generator().manual_seed(window + 1)
    k, v, kf, vf = rounded_pools(gen, 48, 16, 2, 64)
    # Two chunks: 70 rows after 30 cached tokens, and a whole 45-token prompt.
    starts, qlens, lens = torch.tensor([0, 70]), torch.tensor([70, 45]), torch.tensor([100, 45])
    tables = torch.randperm(48, generator=gen)[:16].view(2, 8)
    q = 3 * torch.randn(115, 6, 64, generator=gen)
    got, expected = torch.empty_like(q), torch.empty_like(q)
    kernels.paged_prefill_attention(q, k, v, tables, starts, qlens, lens, 0.125, window, softcap, got)
    kernels.paged_prefill_attention(q, kf, vf, tables, starts, qlens, lens, 0.125, window, softcap, expected)
    assert torch.equal(got, expected)


def test_engine_equals_float32_engine_with_rounded_kv(tiny_model_dir, monkeypatch):
    """Reference: the float32 pool, K/V rounded to bfloat16 before they are stored, the layers in
    Python (the fused decode stack stores what it computes). Chunked prefill, prefix caching and a
    decode batch all read the rounded pool."""
    if load_cpu_kernels() is None:
        pytest.skip("no C++ toolchain for the CPU kernels")
    options = dict(kv_cache_memory="64MiB", max_num_batched_tokens=48, enable_prefix_caching=True)
    from transformers import AutoTokenizer

    prompts = tiny_prompts(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    prompts += [prompts[4] + prompts[3][:20]]  # reuses the longest prompt's cached blocks
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    llm = LLM(str(tiny_model_dir), kv_cache_dtype="bfloat16", **options)
    pool = llm.engine.kv_cache
    assert pool.k.dtype == pool.v.dtype == torch.bfloat16
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_all_blocks_free(llm)

    reference = LLM(str(tiny_model_dir), **options)
    assert reference.engine.kv_cache.k.dtype == torch.float32
    assert reference.engine.kv_cache.num_blocks * 2 == pool.num_blocks  # same memory, half the bytes a block
    reference.engine.model.fused_decode = None
    kernels = reference.engine.runner.attention.kernels

    class RoundingStore:  # the kernels, with K and V rounded to bfloat16 on their way into the float32 pool
        def __getattr__(self, name):
            return getattr(kernels, name)

        def store_kv(self, k, v, *pools_and_slots):
            kernels.store_kv(k.bfloat16().float(), v.bfloat16().float(), *pools_and_slots)

    monkeypatch.setattr(reference.engine.runner.attention, "kernels", RoundingStore())
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_backends_that_attend_in_the_pool_dtype_refuse_it(tiny_model_dir):
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 .* compiled CPU attention kernels"):
        LLM(str(tiny_model_dir), kv_cache_dtype="bfloat16", attention_backend="torch", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16"):
        LLM(str(tiny_model_dir), kv_cache_dtype="fp8")
