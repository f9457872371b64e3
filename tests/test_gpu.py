"""The CUDA path: bf16 kernels, captured CUDA graphs, --device cuda defaults. Skipped without a GPU;
scripts/gpu_check.sh runs these (with tests/test_triton_attention.py, compiled) on a GPU machine."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

from metroserve import LLM, SamplingParams  # noqa: E402
from tests.test_attention import random_layout  # noqa: E402
from tests.test_greedy_vs_hf import run, tiny_prompts  # noqa: E402
from tests.test_triton_attention import random_batch, run_both  # noqa: E402

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    from transformers import AutoTokenizer

    return tiny_prompts(AutoTokenizer.from_pretrained(str(tiny_model_dir)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (3, 128), (8, 64), (8, 128)])
def test_half_precision_kernels_match_the_torch_backend(dtype, group, head_dim):
    rng = torch.Generator().manual_seed(group * head_dim)
    bs, num_blocks, num_kv_heads = 16, 256, 2
    for _ in range(3):
        query_lens, context_lens = random_batch(rng, bs)
        layout = random_layout(rng, num_blocks, bs, query_lens, context_lens)
        expected, got, torch_cache, triton_cache = run_both(
            layout, group * num_kv_heads, num_kv_heads, head_dim, bs, num_blocks, dtype, CUDA, rng)
        assert torch.equal(triton_cache.k, torch_cache.k) and torch.equal(triton_cache.v, torch_cache.v)
        # Each rounds to half precision in its own order: equal within a few half-precision ulps.
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_long_context_decode_and_large_blocks():
    """4k-token contexts, block size 64, a 64-token chunk over a long prefix."""
    rng = torch.Generator().manual_seed(5)
    layout = random_layout(rng, 512, 64, [1, 1, 64, 1], [4096, 3001, 4000, 65])
    expected, got, _, _ = run_both(layout, 32, 8, 128, 64, 512, torch.float32, CUDA, rng)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_cuda_graphs_give_the_eager_tokens(tiny_model_dir, prompts, monkeypatch):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 12, 7, 2)]
    eager = LLM(str(tiny_model_dir), dtype="float32", enforce_eager=True)
    graphs = LLM(str(tiny_model_dir), dtype="float32", max_num_seqs=32)
    assert eager.engine.runner.graphs is None and graphs.engine.runner.graphs.graphs  # captured
    replays = []
    runner_graphs = graphs.engine.runner.graphs
    replay = runner_graphs.run

    def counting_run(*args):
        replays.append(1)
        return replay(*args)

    monkeypatch.setattr(runner_graphs, "run", counting_run)
    assert run(graphs, prompts, params) == run(eager, prompts, params)
    assert len(replays) >= 10


def test_device_cuda_defaults(tiny_model_dir, prompts):
    """bf16, the Triton backend, graphs captured, weights on the device, a pool sized from the profiled step."""
    from metroserve.worker.attention.triton import TritonAttention

    llm = LLM(str(tiny_model_dir), device="cuda", gpu_memory_utilization=0.3)
    engine = llm.engine
    assert engine.dtype == torch.bfloat16 and isinstance(engine.attention, TritonAttention)
    assert engine.runner.graphs is not None and engine.model.embed_tokens.weight.is_cuda
    free, total = torch.cuda.mem_get_info()
    pool_bytes = 2 * engine.kv_cache.k.numel() * engine.kv_cache.k.element_size()
    assert pool_bytes <= 0.3 * total and engine.kv_cache.num_blocks > 1000
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_seeded_sampling_on_the_device_ignores_the_batch(tiny_model_dir, prompts):
    """float32, so that a different batch (other GEMM shapes) cannot flip a draw by a last-bit difference."""
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32")
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    busy = llm.generate(prompts, [seeded] + [SamplingParams(temperature=1.0, max_tokens=16)] * 5,
                        use_tqdm=False)[0].outputs[0].token_ids
    assert alone == busy
