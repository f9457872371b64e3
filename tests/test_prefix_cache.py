"""A shared 512-token system prompt is computed once; later requests reuse its full blocks."""

from metroserve import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_tiny_shared_512_token_system_prompt(tiny_model_dir, tiny_ref):
    system = [(7 * i + 3) % 500 + 3 for i in range(512)]  # 32 full blocks of 16
    users = [[11, 12, 13], [40, 41, 42, 43, 44], [300]]
    llm = LLM(str(tiny_model_dir), block_size=16)
    outs = [llm.generate([system + u], GREEDY, use_tqdm=False)[0] for u in users]
    assert outs[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in outs[1:]] == [512, 512]
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == 1024
    assert_all_blocks_free(llm)

    uncached = LLM(str(tiny_model_dir), block_size=16, enable_prefix_caching=False)
    for u, o in zip(users, outs):
        assert uncached.generate([system + u], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == o.outputs[0].token_ids
        tiny_ref.assert_matches(system + u, o.outputs[0].token_ids, 12, stop_at_eos=False)


def test_smollm2_shared_system_prompt(smollm2_dir):
    llm = LLM(str(smollm2_dir), kv_cache_memory="256MiB")
    tok = llm.get_tokenizer()
    system = " ".join(f"Rule {i}: answer politely and briefly." for i in range(60))
    params = SamplingParams(temperature=0, max_tokens=8)
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("What is 2+2?", "Name a color.")]
    prompts = [llm.apply_chat_template(c) for c in convs]
    common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert common >= 512
    first, second = (llm.generate([p], params, use_tqdm=False)[0] for p in prompts)
    assert second.num_cached_tokens == common // 16 * 16
    uncached = LLM(str(smollm2_dir), enable_prefix_caching=False, kv_cache_memory="256MiB")
    fresh = uncached.generate([prompts[1]], params, use_tqdm=False)[0]
    assert fresh.outputs[0].token_ids == second.outputs[0].token_ids
    assert tok.decode(second.outputs[0].token_ids)
    assert_all_blocks_free(llm)
