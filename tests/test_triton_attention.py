"""The Triton kernels against the torch backend on randomized mixed batches, and the engine on them.

Without a GPU they run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1);
on a GPU the same cases run compiled, in float32 on CUDA (bf16 and captured graphs: tests/test_gpu.py).
"""

import dataclasses

import pytest
import torch

from metroserve import LLM, SamplingParams
from metroserve.worker.attention import TorchAttention
from metroserve.worker.kv_cache import KVCache
from tests.test_attention import random_layout, windowed_case
from tests.test_greedy_vs_hf import check_all, run, tiny_prompts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(layout, device=DEVICE):
    return dataclasses.replace(layout, block_table_tensor=layout.block_table_tensor.to(device),
                               slot_mapping=layout.slot_mapping.to(device))


def random_batch(rng: torch.Generator, bs: int, decode_only: bool = False) -> tuple[list[int], list[int]]:
    """Decodes and prefill chunks of 1 to 64 tokens, with and without earlier context, in random order."""
    query_lens, context_lens = [], []
    for _ in range(int(torch.randint(3, 7, (1,), generator=rng))):
        kind = 0 if decode_only else int(torch.randint(0, 3, (1,), generator=rng))
        q_len = 1 if kind == 0 else int(torch.randint(1, 65, (1,), generator=rng))
        earlier = 0 if kind == 2 else int(torch.randint(0, 6 * bs, (1,), generator=rng))
        query_lens.append(q_len)
        context_lens.append(earlier + q_len)
    return query_lens, context_lens


def run_both(layout, num_heads, num_kv_heads, head_dim, bs, num_blocks, dtype, device, rng, split_kv=False):
    from metroserve.worker.attention.triton import TritonAttention

    layout = on_device(layout, device)
    torch_cache = KVCache(1, num_blocks, bs, num_kv_heads, head_dim, dtype, device)
    torch_cache.k.copy_(torch.randn(torch_cache.k.shape, generator=rng).to(dtype))
    torch_cache.v.copy_(torch.randn(torch_cache.v.shape, generator=rng).to(dtype))
    triton_cache = KVCache(1, num_blocks, bs, num_kv_heads, head_dim, dtype, device)
    triton_cache.k.copy_(torch_cache.k)
    triton_cache.v.copy_(torch_cache.v)
    t = sum(layout.query_lens)
    q = torch.randn(t, num_heads, head_dim, generator=rng).to(dtype).to(device)
    # K and V as the model passes them: strided views into one fused projection output.
    kv = torch.randn(t, 2 * num_kv_heads, head_dim, generator=rng).to(dtype).to(device)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]

    expected = TorchAttention(bs).forward(0, q, k, v, torch_cache, TorchAttention(bs).prepare(layout))
    backend = TritonAttention(bs, num_heads, num_kv_heads, head_dim, dtype, split_kv=split_kv)
    got = backend.forward(0, q, k, v, triton_cache, backend.prepare(layout))
    return expected, got, torch_cache, triton_cache


def _naming(query_lens: list[int], context_lens: list[int]):
    """assert_close's message callback: the batch's shape, then the mismatch."""
    return lambda message: f"query_lens={query_lens} context_lens={context_lens}: {message}"


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("split_kv", [False, True])
def test_triton_matches_torch_backend(group, head_dim, split_kv):
    """Two mixed batches and one of decodes only (the one split-KV splits)."""
    rng = torch.Generator().manual_seed(100 * group + head_dim)
    bs, num_blocks, num_kv_heads = 16, 96, 2
    for decode_only in (False, False, True):
        query_lens, context_lens = random_batch(rng, bs, decode_only)
        layout = random_layout(rng, num_blocks, bs, query_lens, context_lens)
        expected, got, torch_cache, triton_cache = run_both(
            layout, group * num_kv_heads, num_kv_heads, head_dim, bs, num_blocks, torch.float32, DEVICE, rng,
            split_kv)
        assert torch.equal(triton_cache.k, torch_cache.k) and torch.equal(triton_cache.v, torch_cache.v)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=_naming(query_lens, context_lens))


@pytest.mark.parametrize("bs", [8, 32, 128])  # smaller than, equal to and larger than a key tile
def test_triton_other_block_sizes_and_block_edges(bs):
    """Contexts that end exactly on, just before and just after a block edge; key tiles span several blocks."""
    rng = torch.Generator().manual_seed(bs)
    layout = random_layout(rng, 128, bs, [1, 1, 1, bs, 2 * bs, bs + 1], [bs, bs - 1, bs + 1, 2 * bs, 3 * bs, bs + 1])
    expected, got, _, _ = run_both(layout, 6, 2, 64, bs, 128, torch.float32, DEVICE, rng)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_padded_rows_write_and_compute_nothing():
    """A CUDA-graph batch pads with slot -1 and query length 0: the pool and other rows stay as they were."""
    from metroserve.worker.attention.triton import TritonAttention

    rng = torch.Generator().manual_seed(3)
    bs, num_kv_heads, head_dim = 16, 2, 64
    layout = on_device(random_layout(rng, 32, bs, [1, 1], [5, 20]))
    cache = KVCache(1, 32, bs, num_kv_heads, head_dim, torch.float32, DEVICE)
    backend = TritonAttention(bs, 4, num_kv_heads, head_dim, torch.float32)
    meta = backend.prepare(layout)
    q = torch.randn(2, 4, head_dim, generator=rng).to(DEVICE)
    k = torch.randn(2, num_kv_heads, head_dim, generator=rng).to(DEVICE)
    reference = backend.forward(0, q, k, k.clone(), cache, meta)
    before = cache.k.clone()

    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    padded = dataclasses.replace(
        meta, slot_mapping=torch.cat([layout.slot_mapping, torch.tensor([-1, -1], device=DEVICE)]),
        seq_lens=torch.cat([meta.seq_lens, int32([0, 0])]), query_start=torch.cat([meta.query_start, int32([2, 2])]),
        block_tables=torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables)]),
        tile_seq=int32([0, 1, 2, 3]), tile_start=int32([0, 0, 0, 0]))
    q4 = torch.cat([q, torch.randn(2, 4, head_dim, generator=rng).to(DEVICE)])
    k4 = torch.cat([k, torch.randn(2, num_kv_heads, head_dim, generator=rng).to(DEVICE)])
    out = backend.forward(0, q4, k4, k4.clone(), cache, padded)
    assert torch.equal(cache.k, before)
    torch.testing.assert_close(out[:2], reference)



# Decodes and a 4-token verification (the most a decode-only tile of this GQA group holds), split-KV.
DECODE_QUERY_LENS, DECODE_CONTEXT_LENS = [1, 1, 1, 1, 1, 4], [1, 16, 17, 300, 45, 70]


@pytest.mark.parametrize("window", [None, 3, 16, 40])
@pytest.mark.parametrize("scale, softcap", [(None, None), (0.3, None), (0.2, 3.0)])
@pytest.mark.parametrize("batch", ["mixed", "decodes"])
def test_triton_matches_dense_reference(window, scale, softcap, batch):
    """Sliding windows under, at and over a block, soft-capping and a custom scale (see windowed_case)."""
    from metroserve.worker.attention.triton import TritonAttention

    backend = TritonAttention(16, 6, 2, 32, torch.float32, split_kv=batch == "decodes")
    lens = {} if batch == "mixed" else dict(query_lens=DECODE_QUERY_LENS, context_lens=DECODE_CONTEXT_LENS)
    got, expected = windowed_case(backend, window, scale, softcap, device=DEVICE.type, **lens)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("split_kv", [False, True])
def test_window_is_a_kernel_argument(split_kv):
    """What the CUDA-graph runner does: the window set on metadata prepared without one."""
    from metroserve.worker.attention.triton import TritonAttention

    rng = torch.Generator().manual_seed(5)
    backend = TritonAttention(16, 4, 2, 32, torch.float32, split_kv=split_kv)
    layout = on_device(random_layout(rng, 32, 16, [1, 1, 1], [5, 100, 40]))
    cache = KVCache(1, 32, 16, 2, 32, torch.float32, DEVICE)
    # Drawn on the CPU, where the generator lives, then copied: a CUDA pool takes no CPU generator.
    cache.k.copy_(torch.randn(cache.k.shape, generator=rng))
    cache.v.copy_(torch.randn(cache.v.shape, generator=rng))
    q = torch.randn(3, 4, 32, generator=rng).to(DEVICE)
    k, v = (torch.randn(3, 2, 32, generator=rng).to(DEVICE) for _ in range(2))
    replaced = dataclasses.replace(backend.prepare(layout), sliding_window=20)
    prepared = backend.prepare(layout, sliding_window=20)
    assert replaced.num_segments == prepared.num_segments and replaced.sliding_window == 20
    got = backend.forward(0, q, k, v, cache, replaced)
    torch.testing.assert_close(got, backend.forward(0, q, k, v, cache, prepared), atol=0, rtol=0)
    assert not torch.allclose(got, backend.forward(0, q, k, v, cache, backend.prepare(layout)))


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    from transformers import AutoTokenizer

    return tiny_prompts(AutoTokenizer.from_pretrained(str(tiny_model_dir)))


def test_engine_with_triton_backend_gives_the_torch_backends_greedy_tokens(tiny_model_dir, tiny_ref, prompts):
    """Mixed batch, chunked prefill (16-token budget) and prefix-cache hits, the whole engine on the kernels."""
    second_wave = [prompts[4][:40] + p for p in prompts[:3]]
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_model_dir), attention_backend=backend, max_num_batched_tokens=16, device=DEVICE.type,
                  dtype="float32", enforce_eager=True)
        outputs[backend] = run(llm, prompts) + run(llm, second_wave)
        assert llm.engine.stats().prefix_cache_hits >= 3 * 32  # the shared 40 tokens hold two full blocks
    assert outputs["triton"] == outputs["torch"]
    check_all(tiny_ref, prompts + second_wave, outputs["triton"])


def test_padded_decode_steps_give_the_same_tokens(tiny_model_dir, prompts, monkeypatch):
    """The CUDA-graph path without a GPU: decode steps padded to the captured sizes, run eagerly."""
    from metroserve.worker.cuda_graphs import CudaGraphRunner

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 12, 7, 2)]
    engine_args = dict(attention_backend="triton", device=DEVICE.type, dtype="float32", enforce_eager=True)
    expected = run(LLM(str(tiny_model_dir), **engine_args), prompts, params)
    llm = LLM(str(tiny_model_dir), max_num_seqs=8, **engine_args)
    engine = llm.engine
    graphs = CudaGraphRunner(engine.model, engine.kv_cache, engine.attention, 8,
                             -(-engine.max_model_len // 16), engine.device)
    padded_sizes = []
    replay = graphs.run

    def counting_run(input_ids, positions, layout):
        padded_sizes.append(next(s for s in graphs.sizes if s >= len(layout.query_lens)))
        return replay(input_ids, positions, layout)

    monkeypatch.setattr(graphs, "run", counting_run)
    engine.runner.graphs = graphs
    assert run(llm, prompts, params) == expected
    # Six decodes padded to 8, then fewer as requests finish: 5 and 3 are padded too.
    assert {8, 4} <= set(padded_sizes) and len(padded_sizes) >= 10


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    from metroserve.worker.attention import make_attention_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_attention_backend("triton", 16, torch.device("cpu"), torch.float32, 4, 2, 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine compiles the kernels in the other tests")
def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter does not check what the GPU compiler does (dot shapes, types): compile for sm_90."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "tests.compile_for_gpu", "90"], capture_output=True, text=True,
                            env=env, cwd=root, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled 40 kernel variants for sm_90" in result.stdout


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_profile_batch_runs_through_the_model(tiny_model_dir, backend):
    """The step that sizes the KV pool on CUDA: 40 tokens as prompts of at most 16, each in its own blocks."""
    from metroserve.worker.gpu_memory import profile_batch

    llm = LLM(str(tiny_model_dir), attention_backend=backend, device=DEVICE.type, dtype="float32", enforce_eager=True)
    engine = llm.engine
    input_ids, positions, layout, num_blocks = profile_batch(40, 16, 16, DEVICE)
    assert layout.query_lens == [16, 16, 8] and num_blocks == 3
    assert positions.tolist() == list(range(16)) * 2 + list(range(8))
    assert sorted(layout.slot_mapping.tolist()) == list(range(40))  # every token its own slot
    with torch.inference_mode():
        hidden = engine.model(input_ids, positions, engine.attention, engine.kv_cache,
                              engine.model.prepare_attention(engine.attention, layout))
    assert hidden.shape == (40, engine.model_config.hidden_size) and torch.isfinite(hidden).all()
