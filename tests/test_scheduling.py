"""Batcher policies and engine options: priority order."""


from metroserve import LLM, LLMEngine, SamplingParams
from tests.conftest import assert_all_blocks_free

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def finish_order(engine: LLMEngine, priorities: list[int]) -> list[str]:
    for i, prio in enumerate(priorities):
        engine.add_request([5 + i, 6, 7], PARAMS, request_id=f"r{i}", priority=prio)
    order = []
    while engine.has_unfinished_requests():
        order += [r.request_id for r in engine.step() if r.finished]
    assert_all_blocks_free(engine)
    return order


def test_fcfs_and_priority_order(tiny_model_dir):
    fcfs = LLMEngine(model=str(tiny_model_dir), max_num_seqs=1)
    assert finish_order(fcfs, [3, 1, 2]) == ["r0", "r1", "r2"]
    prio = LLMEngine(model=str(tiny_model_dir), max_num_seqs=1, scheduling_policy="priority")
    assert finish_order(prio, [3, 1, 2]) == ["r1", "r2", "r0"]


def test_max_num_seqs_caps_running(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir), max_num_seqs=2)
    for i in range(5):
        engine.add_request([5, 6, 7 + i], PARAMS)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 3)
    assert stats.kv_cache_usage == (stats.num_total_blocks - stats.num_free_blocks) / stats.num_total_blocks > 0


def test_forks_count_against_max_num_seqs(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir), max_num_seqs=3)
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    for i in range(3):
        engine.add_request([5, 6, 7 + i], params)
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.batcher.running) <= 3
    assert_all_blocks_free(engine)


def test_preempted_request_rejoins_queue_in_priority_order(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir), block_size=4, num_gpu_blocks_override=10,
                       scheduling_policy="priority")
    long = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine.add_request([5] * 15, long, request_id="high1", priority=0)
    engine.add_request([6] * 15, long, request_id="low", priority=5)
    engine.step()
    engine.add_request([7] * 15, long, request_id="high2", priority=0)
    while engine.has_unfinished_requests():
        engine.step()
        waiting = [s.request.request_id for s in engine.batcher.waiting]
        if "low" in waiting and "high2" in waiting:
            assert waiting.index("high2") < waiting.index("low")
    assert engine.requests == {} and engine.stats().num_preemptions > 0
    assert_all_blocks_free(engine)


def test_priority_list_must_match_prompts(tiny_model_dir):
    import pytest

    llm = LLM(str(tiny_model_dir))
    with pytest.raises(ValueError, match="1 priorities for 3 prompts"):
        llm.generate([[5], [6], [7]], priority=[1], use_tqdm=False)
