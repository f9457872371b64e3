"""Invariant 3: bad input is refused with a clear error naming the problem; other requests carry on."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from metroserve import LLM, AsyncEngine, ModelLoadError, SamplingParams
from metroserve.common.structured_outputs import StructuredOutputsParams
from tests.conftest import assert_all_blocks_free


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0, "n": 2}, "n must be 1"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words_token_ids": [[]]}, "bad words"),
    ({"min_tokens": 2, "structured_outputs": StructuredOutputsParams(choice=("a",))}, "min_tokens cannot"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n must be"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
])
def test_sampling_params_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), max_model_len=64)


def test_prompt_errors_name_the_problem(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.generate([[5] * 100], use_tqdm=False)
    with pytest.raises(ValueError, match="exceeds the maximum context length"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=40), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5] * 4], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 1: prompt token ids must be integers in \[0, 512\)"):
        llm.generate([[5, 6], [5, 99999]], use_tqdm=False)
    # Nothing was half-added: the engine still serves.
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_all_blocks_free(llm)


def test_request_too_big_for_pool(tiny_model_dir):
    small = LLM(str(tiny_model_dir), block_size=4, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="KV blocks but the pool has 4"):
        small.generate([[5] * 10], SamplingParams(max_tokens=10), use_tqdm=False)


def test_unknown_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        LLM(str(missing))


def test_corrupt_and_truncated_model_files(tiny_model_dir, tmp_path):
    broken = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="truncated|cannot read weights"):
        LLM(str(broken))
    garbage = tmp_path / "garbage"
    shutil.copytree(tiny_model_dir, garbage)
    (garbage / "model.safetensors").write_bytes(b"\x00\xff" * 1000)
    with pytest.raises(ModelLoadError, match="garbage"):
        LLM(str(garbage))
    bad_gguf = tmp_path / "model.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x01" * 100)
    with pytest.raises(ModelLoadError, match="model.gguf"):
        LLM(str(bad_gguf), )


def test_bad_requests_do_not_disturb_a_running_one(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    solo = LLM(str(tiny_model_dir)).generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids

    async def main():
        engine = AsyncEngine(model=str(tiny_model_dir))
        tokens: list[int] = []

        async def good():
            async for out in engine.generate([5, 6, 7, 8], params):
                tokens.extend(out.outputs[0].token_ids)

        task = asyncio.create_task(good())
        errors = []
        for prompt, p in [([], params), ([1] * 5000, params), ([5], SamplingParams(max_tokens=4000))]:
            try:
                async for _ in engine.generate(prompt, p):
                    pass
            except ValueError as e:
                errors.append(str(e))
        await task
        await engine.shutdown()
        assert_all_blocks_free(engine.engine)
        return tokens, errors

    tokens, errors = asyncio.run(main())
    assert len(errors) == 3 and "prompt is empty" in errors[0]
    assert tokens == solo
