"""MockEngine: deterministic tokens that survive migration, the real KV bookkeeping (prefix hits, block
events, preemption, every block back in the pool), aborts, the step time model, torch-free import."""

from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable

import pytest

from metroserve.common.block_hash import hash_prompt_blocks
from metroserve.common.sampling_params import SamplingParams
from metroserve.worker.config import EngineConfig
from metroserve.worker.mock_engine import MockEngine, MockEngineOptions, add_mock_engine_args, mock_options_from_args
from metroserve.worker.outputs import RequestOutput
from metroserve.worker.step_sink import EngineDeadError, ServingEngine, StepResult

GREEDY = SamplingParams(temperature=0, max_tokens=20)
TIMEOUT_S = 10


class RecordingSink:
    """Collects every StepResult and each request's tokens per sequence index."""

    def __init__(self) -> None:
        self.results: list[StepResult] = []
        self.tokens: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        self.finished: dict[str, RequestOutput] = {}
        self.failures: list[EngineDeadError] = []
        self._changed = asyncio.Event()

    def step_done(self, result: StepResult) -> None:
        self.results.append(result)
        for out in result.outputs:
            for c in out.outputs:
                self.tokens[out.request_id][c.index] += c.token_ids
            if out.finished:
                assert out.request_id not in self.finished, "a request finishes once"
                self.finished[out.request_id] = out
        self._changed.set()

    def rejected(self, request_id: str, error: Exception) -> None:
        raise AssertionError(f"unexpected rejection of {request_id}: {error}")

    def failed(self, error: EngineDeadError) -> None:
        self.failures.append(error)
        self._changed.set()

    async def until(self, condition: Callable[[], bool]) -> None:
        async def wait() -> None:
            while not condition():
                assert not self.failures, self.failures
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), TIMEOUT_S)

    async def done(self, *request_ids: str) -> list[RequestOutput]:
        await self.until(lambda: all(r in self.finished for r in request_ids))
        return [self.finished[r] for r in request_ids]


def options(**overrides) -> MockEngineOptions:
    """A small pool and no simulated time: tests run as fast as the bookkeeping."""
    fields: dict = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                        vocab_size=1000, step_fixed_s=0.0, prefill_token_s=0.0, decode_seq_s=0.0)
    return MockEngineOptions(**{**fields, **overrides})


def assert_pool_free(engine: MockEngine) -> None:
    s = engine.stats()
    assert s.num_free_blocks == s.num_total_blocks, f"{s.num_total_blocks - s.num_free_blocks} blocks leaked"
    assert s.num_running == s.num_waiting == 0


async def generate(opts: MockEngineOptions, requests: dict[str, tuple[list[int], SamplingParams]],
                   resume: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Run requests (id -> (prompt, params)) to the end on a fresh engine; id -> sequence 0's tokens."""
    sink = RecordingSink()
    engine = MockEngine(opts, sink)
    for rid, (prompt, params) in requests.items():
        engine.submit(prompt, params, rid, resume_token_ids=(resume or {}).get(rid, ()))
    await sink.done(*requests)
    assert_pool_free(engine)
    await engine.shutdown()
    return {rid: sink.tokens[rid][0] for rid in requests}


def test_greedy_tokens_are_a_function_of_the_history():
    prompts = {"a": ([1, 2, 3, 4, 5], GREEDY), "b": ([9, 8, 7], GREEDY)}
    first = asyncio.run(generate(options(), prompts))
    again = asyncio.run(generate(options(seed=5, num_blocks=200), prompts))  # seed and pool don't matter
    assert first == again
    assert all(len(t) == 20 and all(0 <= x < 1000 for x in t) for t in first.values())
    assert first["a"] != first["b"]
    assert len(set(first["a"])) > 10  # not a constant or a short cycle


def test_resume_on_another_engine_continues_identically():
    prompt = [11, 12, 13, 14, 15, 16]
    for params in (SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=1.0, seed=7,
                                                                                 max_tokens=24)):
        full = asyncio.run(generate(options(), {"r": (prompt, params)}))["r"]
        assert len(full) == 24

        async def resume(params=params, full=full):
            sink = RecordingSink()
            engine = MockEngine(options(), sink)
            engine.submit(prompt, params, "moved", resume_token_ids=full[:10])
            (out,) = await sink.done("moved")
            assert_pool_free(engine)
            await engine.shutdown()
            return sink.tokens["moved"][0], out

        rest, out = asyncio.run(resume())
        assert rest == full[10:], f"temperature {params.temperature}"
        assert out.outputs[0].finish_reason == "length"  # max_tokens counts the resumed output
        assert out.metrics.num_generation_tokens == 14  # generated here

    unseeded = SamplingParams(temperature=1.0, max_tokens=24)
    tokens = asyncio.run(generate(options(), {"x": (prompt, unseeded), "y": (prompt, unseeded)}))
    assert tokens["x"] != tokens["y"]  # seeded from the engine seed and the request id


def test_prefix_cache_hits_and_block_events():
    prompt = list(range(100, 118))  # 4 full blocks of 4 and 2 tokens

    async def main():
        sink = RecordingSink()
        engine = MockEngine(options(), sink)
        params = SamplingParams(temperature=0, max_tokens=2)
        engine.submit(prompt, params, "first")
        (first,) = await sink.done("first")
        stored = [h for r in sink.results for h in r.blocks_stored]
        blocks = hash_prompt_blocks(prompt, 4)
        assert stored[:4] == blocks  # the prompt's full blocks, in chain order
        assert set(blocks) <= set(engine.cached_block_hashes())
        assert first.num_cached_tokens == 0

        engine.submit(prompt, params, "second")
        engine.submit(prompt, params, "salted", cache_salt="tenant-b")  # another cache namespace
        second, salted = await sink.done("second", "salted")
        assert second.num_cached_tokens == 16
        assert salted.num_cached_tokens == 0
        assert sink.tokens["second"][0] == sink.tokens["first"][0]
        s = engine.stats()
        assert (s.prefix_cache_queries, s.prefix_cache_hits) == (3 * 18, 16)
        assert_pool_free(engine)  # cached blocks sit in the free queue, reusable
        await engine.shutdown()

    asyncio.run(main())


def test_preemption_by_recompute_completes_with_the_same_tokens():
    requests = {f"r{i}": ([i * 10 + j for j in range(8)], SamplingParams(temperature=0, max_tokens=20))
                for i in range(4)}
    reference = asyncio.run(generate(options(), requests))

    async def main():
        sink = RecordingSink()
        # 12 blocks of 4: each request grows to 28 tokens (7 blocks), four of them cannot all fit.
        engine = MockEngine(options(num_blocks=12), sink)
        for rid, (prompt, params) in requests.items():
            engine.submit(prompt, params, rid)
        outs = await sink.done(*requests)
        assert engine.stats().num_preemptions > 0
        assert sum(o.metrics.num_preemptions for o in outs) == engine.stats().num_preemptions
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert_pool_free(engine)
        await engine.shutdown()
        return {rid: sink.tokens[rid][0] for rid in requests}

    assert asyncio.run(main()) == reference


def test_abort_cuts_output_frees_blocks_and_reports_before_the_next_step():
    sleeps: list[float] = []

    async def recording_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        await asyncio.sleep(0)

    async def main():
        sink = RecordingSink()
        engine = MockEngine(options(), sink, sleep=recording_sleep)
        engine.submit([5] * 10, SamplingParams(temperature=0, max_tokens=200), "long")
        await sink.until(lambda: len(sink.tokens["long"][0]) >= 5)
        steps_at_abort = len(sleeps)
        engine.abort("long", ["stop"], [3])
        (out,) = await sink.done("long")
        assert len(sleeps) == steps_at_abort  # no simulated forward ran before the report
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].token_ids == []  # nothing new: the client already has (more than) 3
        assert out.metrics.num_generation_tokens == 3
        assert_pool_free(engine)

        # Aborted while waiting, never scheduled; unknown and repeated aborts are ignored.
        engine.submit([1, 2, 3], GREEDY, "queued")
        engine.abort("queued")
        engine.abort("queued")
        engine.abort("nobody")
        (queued,) = await sink.done("queued")
        assert queued.outputs[0].finish_reason == "abort" and queued.outputs[0].token_ids == []
        assert_pool_free(engine)

        engine.submit([1, 2, 3], GREEDY, "after")  # the engine goes on serving
        (after,) = await sink.done("after")
        assert after.outputs[0].finish_reason == "length"
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            engine.submit([1], GREEDY, "too-late")

    asyncio.run(main())


def test_step_time_model_and_idle_engine_does_not_step():
    sleeps: list[float] = []

    async def recording_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        await asyncio.sleep(0)

    fixed, per_token, per_seq = 0.001, 0.0001, 0.01
    opts = options(step_fixed_s=fixed, prefill_token_s=per_token, decode_seq_s=per_seq, max_num_batched_tokens=16)

    async def main():
        sink = RecordingSink()
        engine = MockEngine(opts, sink, sleep=recording_sleep)
        engine.submit(list(range(40)), SamplingParams(temperature=0, max_tokens=3), "chunked")
        await sink.done("chunked")
        # Three prefill chunks (16, 16, 8; the last gives the first token), then two decodes.
        assert sleeps == pytest.approx([fixed + 16 * per_token] * 2 + [fixed + 8 * per_token]
                                       + [fixed + per_seq] * 2)
        assert len(sink.results) == len(sleeps)  # one StepResult per step

        sleeps.clear()
        engine.submit([7, 7, 7, 7], SamplingParams(temperature=0, max_tokens=2), "x")
        engine.submit([8, 8, 8, 8], SamplingParams(temperature=0, max_tokens=2), "y")
        await sink.done("x", "y")
        assert sleeps == pytest.approx([fixed + 8 * per_token, fixed + 2 * per_seq])

        for _ in range(50):  # idle: the loop waits for work instead of stepping
            await asyncio.sleep(0)
        assert len(sleeps) == 2
        await engine.shutdown()

    asyncio.run(main())


def test_n_samples_fork_after_prefill():
    async def main():
        sink = RecordingSink()
        engine = MockEngine(options(), sink)
        engine.submit(list(range(30)), SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10), "n3")
        (out,) = await sink.done("n3")
        samples = sink.tokens["n3"]
        assert sorted(samples) == [0, 1, 2]
        assert all(len(t) == 10 for t in samples.values())
        assert len({tuple(t) for t in samples.values()}) == 3
        assert sorted(c.finish_reason or "" for c in out.outputs) == ["length"] * 3
        assert out.metrics.num_generation_tokens == 30
        assert_pool_free(engine)
        await engine.shutdown()

    asyncio.run(main())


def test_finish_rules_are_the_engines():
    eos = 3
    opts = options(vocab_size=8, eos_token_id=eos, max_model_len=32)

    async def main():
        sink = RecordingSink()
        engine = MockEngine(opts, sink)
        engine.submit([1, 2], SamplingParams(temperature=1.0, seed=0, max_tokens=25, min_tokens=5), "eos")
        engine.submit([1, 2], SamplingParams(temperature=1.0, seed=0, max_tokens=25, ignore_eos=True), "ignore")
        engine.submit([1, 2], SamplingParams(temperature=1.0, seed=2, max_tokens=25, ignore_eos=True,
                                             stop_token_ids=[5]), "stop-id")
        engine.submit([1] * 10, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), "context")
        outs = dict(zip(["eos", "ignore", "stop-id", "context"], await sink.done("eos", "ignore", "stop-id",
                                                                                 "context")))
        tokens = {rid: sink.tokens[rid][0] for rid in outs}
        assert outs["eos"].outputs[0].finish_reason == "stop"
        assert tokens["eos"][-1] == eos and len(tokens["eos"]) >= 5 and eos not in tokens["eos"][4:-1]
        assert eos in tokens["eos"][:4]  # drawn before min_tokens: not a stop (this seed draws it first)
        assert outs["ignore"].outputs[0].finish_reason == "length" and len(tokens["ignore"]) == 25
        assert eos in tokens["ignore"]  # drawn, but not a stop
        assert outs["stop-id"].outputs[0].finish_reason == "stop"
        assert outs["stop-id"].outputs[0].stop_reason == 5 and tokens["stop-id"][-1] == 5
        assert outs["context"].outputs[0].finish_reason == "length" and len(tokens["context"]) == 32 - 10
        assert_pool_free(engine)
        await engine.shutdown()

    asyncio.run(main())


def test_logprobs_are_a_plausible_top_n():
    async def main():
        sink = RecordingSink()
        engine = MockEngine(options(), sink)
        engine.submit([4, 5, 6], SamplingParams(temperature=0, max_tokens=6, logprobs=3), "lp")
        engine.submit([4, 5, 6], SamplingParams(temperature=0, max_tokens=6), "plain")
        lp, plain = await sink.done("lp", "plain")
        await engine.shutdown()
        return lp, plain, sink.tokens["lp"][0], sink.results

    last, plain, tokens, results = asyncio.run(main())
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    per_token = [d for r in results for o in r.outputs if o.request_id == "lp" for d in o.outputs[0].logprobs or []]
    assert len(per_token) == len(tokens) == 6
    for token, lps in zip(tokens, per_token):
        assert len(lps) == 3 and max(lps, key=lambda t: lps[t]) == token
        assert all(v < 0 for v in lps.values()) and sum(math.exp(v) for v in lps.values()) < 1
    assert last.outputs[0].cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(tokens, per_token)))


def test_command_line_flags():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    add_mock_engine_args(parser)
    assert "--mock-step-fixed-ms" in parser.format_help()
    assert mock_options_from_args(parser.parse_args([])) == MockEngineOptions()
    opts = mock_options_from_args(parser.parse_args([
        "--mock-num-blocks", "512", "--block-size", "32", "--max-num-seqs", "16", "--max-model-len", "4096",
        "--mock-vocab-size", "512", "--mock-eos-token-id", "2", "--mock-step-fixed-ms", "2.5",
        "--mock-prefill-token-us", "20", "--mock-decode-seq-us", "100", "--no-enable-prefix-caching", "--seed", "9"]))
    assert (opts.num_blocks, opts.block_size, opts.max_num_seqs, opts.max_model_len) == (512, 32, 16, 4096)
    assert (opts.vocab_size, opts.eos_token_id, opts.enable_prefix_caching, opts.seed) == (512, 2, False, 9)
    assert opts.step_time(10, 2) == pytest.approx(2.5e-3 + 10 * 20e-6 + 2 * 100e-6)
    engine: ServingEngine = MockEngine(opts, RecordingSink())  # what the worker service drives (mypy checks)
    limits = engine.limits
    assert engine.metrics_collector({"model_name": "m"}) is None
    assert (limits.vocab_size, limits.max_model_len, limits.num_blocks, limits.block_size) == (512, 4096, 512, 32)
    with pytest.raises(ValueError, match="eos_token_id"):
        MockEngineOptions(vocab_size=10, eos_token_id=10)


def test_import_is_torch_free():
    code = "import sys, metroserve.worker.mock_engine; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
