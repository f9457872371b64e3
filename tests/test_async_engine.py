"""AsyncEngine: streamed deltas add up to the offline result; aborts free blocks at once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from metroserve import LLM, AsyncEngine, SamplingParams
from metroserve.worker.step_sink import EngineDeadError
from tests.conftest import assert_all_blocks_free

PARAMS = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)


def test_stream_deltas_equal_offline_output(tiny_model_dir):
    prompts = [[5, 6, 7, 8], [100, 101, 102] * 10, [42]]
    offline = LLM(str(tiny_model_dir)).generate(prompts, PARAMS, use_tqdm=False)

    async def main():
        engine = AsyncEngine(model=str(tiny_model_dir))

        async def one(prompt):
            tokens, text, finals = [], "", []
            async for out in engine.generate(prompt, PARAMS):
                tokens += out.outputs[0].token_ids
                text += out.outputs[0].text
                finals.append(out.finished)
            return tokens, text, finals, out

        results = await asyncio.gather(*(one(p) for p in prompts))
        await engine.shutdown()
        return results

    for (tokens, text, finals, last), ref in zip(asyncio.run(main()), offline):
        assert tokens == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text
        assert finals[-1] and not any(finals[:-1])
        m = last.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert last.outputs[0].finish_reason == "length"


def test_abort_frees_blocks_and_others_finish(tiny_model_dir):
    async def main():
        engine = AsyncEngine(model=str(tiny_model_dir))
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

        async def leave_early():
            seen = 0
            async for out in engine.generate([9] * 40, long):
                seen += len(out.outputs[0].token_ids)
                if seen >= 3:
                    break  # the client is gone: closing the iterator aborts the request
            return seen

        async def finish():
            return [o async for o in engine.generate([5, 6, 7], PARAMS, delta=False)][-1]

        seen, done = await asyncio.gather(leave_early(), finish())
        assert seen >= 3
        assert done.finished and done.outputs[0].finish_reason == "length"
        deadline = time.monotonic() + 10
        bm = engine.engine.block_manager
        while bm.num_free_blocks != bm.num_blocks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert_all_blocks_free(engine.engine)
        assert not engine.engine.has_unfinished_requests()

        # An explicit abort by id (the Abort RPC) ends the stream with finish_reason "abort".
        gen = engine.generate([9] * 10, long, request_id="to-abort")
        first = await gen.__anext__()
        assert not first.finished
        engine.abort("to-abort")
        rest = [o async for o in gen]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert_all_blocks_free(engine.engine)
        assert not engine.engine.has_unfinished_requests()

        # Shutting down ends open streams with an error instead of leaving them hanging.
        gen = engine.generate([9] * 10, long)
        await gen.__anext__()
        await engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in gen:
                pass

    asyncio.run(main())


class _SlowFlushSink:
    """A StepSink whose flush of a step's output takes a while, as a worker's does while its token
    stream sends: the engine loop awaits it, and requests can arrive meanwhile."""

    def __init__(self):
        self.finished: dict[str, str] = {}
        self.flushing_abort = asyncio.Event()

    def step_done(self, result):
        aborted = False
        for out in result.outputs:
            if out.finished:
                self.finished[out.request_id] = out.outputs[0].finish_reason
                aborted |= out.outputs[0].finish_reason == "abort"
        if not aborted:
            return None

        async def flush():
            self.flushing_abort.set()
            await asyncio.sleep(0.2)

        return flush()

    def rejected(self, request_id, error):
        raise AssertionError(f"{request_id} rejected: {error}")

    def failed(self, error):
        raise AssertionError(f"engine failed: {error}")


def test_request_submitted_while_an_abort_flushes_is_served(tiny_model_dir):
    """Regression: the step loop awaited the flush of an aborted request, then found no request
    running (the new one was still queued as a command) and slept on a wakeup already spent: the
    new request waited for the next one to arrive (a 1-token request hung 120 s in CI)."""

    async def main():
        sink = _SlowFlushSink()
        engine = AsyncEngine(model=str(tiny_model_dir), sink=sink, step_inline=True)
        engine.submit([9] * 40, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True), "long")
        deadline = time.monotonic() + 60
        while engine.engine.stats().num_running == 0:
            assert time.monotonic() < deadline, "the long request never started"
            await asyncio.sleep(0.01)
        engine.abort("long")
        await asyncio.wait_for(sink.flushing_abort.wait(), 60)
        engine.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=1), "short")
        deadline = time.monotonic() + 30
        while "short" not in sink.finished:
            assert time.monotonic() < deadline, "the request submitted during the flush never ran"
            await asyncio.sleep(0.01)
        await engine.shutdown()
        return sink.finished

    assert asyncio.run(main()) == {"long": "abort", "short": "length"}


class _RecordingSink:
    def __init__(self):
        self.finished = asyncio.Event()

    def step_done(self, result):
        if any(out.finished for out in result.outputs):
            self.finished.set()

    def rejected(self, request_id, error):
        raise AssertionError(f"{request_id} rejected: {error}")

    def failed(self, error):
        raise AssertionError(f"engine failed: {error}")


def test_inline_steps_compute_prompts_off_the_event_loop(tiny_model_dir):
    """The worker's inline mode: a step that computes prompt tokens can take seconds on a CPU, and
    the worker's heartbeats leave from the event loop, so such a step runs in the step thread
    (inline, a 2,048-token chunk outlasted a 3 s heartbeat timeout and a healthy worker was
    declared lost). Decode steps stay on the loop's thread. A 40-token prompt in chunks of 16: three
    prefill steps, then one decode step per further token."""

    async def main():
        sink = _RecordingSink()
        engine = AsyncEngine(model=str(tiny_model_dir), sink=sink, step_inline=True,
                             max_num_batched_tokens=16, max_num_seqs=4)
        loop_thread = threading.get_ident()
        on_loop: list[bool] = []
        step = engine.engine.step

        def recording_step():
            on_loop.append(threading.get_ident() == loop_thread)
            return step()

        engine.engine.step = recording_step
        engine.submit(list(range(3, 43)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                         speculative=False), "r")
        await asyncio.wait_for(sink.finished.wait(), 60)
        await engine.shutdown()
        return on_loop

    assert asyncio.run(main()) == [False] * 3 + [True] * 4
