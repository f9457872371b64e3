"""The cluster under load, as real processes: prefix-aware placement, client disconnects, a worker
killed mid-stream, and Redis restarted mid-run. Tiny random Llama, 2 workers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.redis_server import RedisServer
from tests.stack import ROOT, ServeStack, stream_completions, wait_for

pytestmark = pytest.mark.service

SYSTEM = ("You are a careful assistant for a library. Answer questions about the catalogue, opening hours, "
          "loans and fines. Keep answers short and polite, and never invent a book that is not listed. ") * 6


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    with ServeStack(tiny_model_dir, workers=2, extra_args=["--served-model-name", "tiny"],
                    log_path=tmp_path_factory.mktemp("serve") / "serve.log") as s:
        yield s


def _placements(stack) -> Counter:
    return Counter(dict(stack.cluster_status().placements_by_worker))


async def _run_all(jobs, limit: int):
    gate = asyncio.Semaphore(limit)

    async def bounded(job):
        async with gate:
            return await job

    return await asyncio.gather(*(bounded(j) for j in jobs))


def _chats(stack, conversations: list[tuple[str | None, str]], limit: int):
    async def run():
        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused")

        async def chat(system: str | None, question: str):
            messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": question})
            return await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)

        return await _run_all([chat(*c) for c in conversations], limit)

    return asyncio.run(run())


def test_prefix_aware_placement(stack):
    before = _placements(stack)
    _chats(stack, [(SYSTEM, "Are you open on Sunday?")], 1)
    warm = _placements(stack) - before
    (holder,) = warm.keys()

    before = _placements(stack)
    replies = _chats(stack, [(SYSTEM, f"Question number {i}: can I renew a loan?") for i in range(20)], 4)
    shared = _placements(stack) - before
    assert sum(shared.values()) == 20
    assert shared[holder] >= 18, f"only {shared[holder]}/20 shared-prefix requests went to {holder}: {shared}"
    assert all(r.usage.prompt_tokens_details.cached_tokens >= 128 for r in replies if shared[holder] == 20)

    before = _placements(stack)
    unrelated = [f"{i} " + " ".join(f"w{(i * 7919 + k) % 997}" for k in range(40)) for i in range(20)]
    replies = _chats(stack, [(None, u) for u in unrelated], 4)
    spread = _placements(stack) - before
    assert sum(spread.values()) == 20
    if not (len(spread) == 2 and min(spread.values()) >= 5):
        ids = {r.id for r in replies}
        lines = [line for line in stack.log_tail(10**7).splitlines() if any(i in line for i in ids)]
        raise AssertionError(f"unrelated prompts did not spread: {spread}; their request log lines (workers, "
                             f"timings):\n" + "\n".join(lines))
    stack.wait_idle()


def test_tokens_stream_one_step_at_a_time(stack):
    """Each engine step's token leaves the worker before the next step: no bursts in the stream."""
    import grpc

    from metroserve.rpc import generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        request = generation_pb2.GenerateRequest(text="Once upon a time", params=generation_pb2.SamplingParams(
            temperature=0.0, max_tokens=64, ignore_eos=True))
        messages = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
    per_message = [len(d.token_ids) for m in messages for d in m.outputs]
    assert sum(per_message) == 64
    assert max(per_message) == 1, f"tokens arrived in bursts: {per_message}"


def test_disconnects_free_every_block(stack):
    """200 streaming requests; 40 clients hang up after two chunks. Nothing stays allocated."""
    async def one(client, i: int):
        prompt = f"Request {i}: tell me about " + "books " * (i % 30)
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        chunks, last = 0, None
        async for chunk in stream:
            chunks, last = chunks + 1, chunk
            if i % 5 == 0 and chunks == 2:
                await stream.close()  # the client goes away mid-stream
                return "disconnected"
        assert last is not None, "the stream ended without a chunk"
        return last.choices[0].finish_reason if last.choices else "no-finish"

    async def run():
        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        return await _run_all([one(client, i) for i in range(200)], 64)

    results = asyncio.run(run())
    assert results.count("disconnected") == 40
    assert results.count("length") == 160
    status = stack.wait_idle()
    assert all(w.load.num_total_blocks > 0 for w in status.workers)


def _long_streams(stack, prompts: list[str], max_tokens: int, on_progress=None):
    return stream_completions(stack.base_url, "tiny", prompts, max_tokens, on_progress, started_at=10)


def test_sigterm_drain_hands_back_unfinished_work(stack, tiny_model_dir, tmp_path):
    """A worker started alone with a short drain timeout joins; SIGTERM mid-stream makes it hand its
    sequences back. The streams finish elsewhere with the text of an undisturbed run."""
    prompts = [f"Drain {i}: " + "the catalogue lists " * (1 + i % 3) for i in range(8)]
    undisturbed = _long_streams(stack, prompts, 1200)
    with open(tmp_path / "worker.log", "wb") as log:  # the worker writes through its own descriptor
        extra = subprocess.Popen([sys.executable, "-m", "metroserve.services.cli", "worker",
                                  "--scheduler", stack.scheduler_address, "--worker-id", "standalone",
                                  "--model", str(tiny_model_dir), "--served-model-name", "tiny",
                                  "--kv-cache-memory", "64MiB", "--drain-timeout", "0.5"], cwd=ROOT, stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(stack.cluster_status().workers) == 3, 120, "the standalone worker to register")
        handed_back = {}

        async def terminate_standalone(progress):
            status = stack.cluster_status()  # on the loop's thread: see kill_busiest_worker
            (standalone,) = [w for w in status.workers if w.worker_id == "standalone"]
            handed_back["placed"] = standalone.num_placed
            handed_back["migrations"] = status.num_migrations
            extra.send_signal(signal.SIGTERM)

        disturbed = _long_streams(stack, prompts, 1200, terminate_standalone)
        assert extra.wait(timeout=60) == 0
    finally:
        if extra.poll() is None:
            extra.kill()
    assert handed_back["placed"] > 0, "nothing ran on the standalone worker"
    assert disturbed == undisturbed
    assert stack.cluster_status().num_migrations >= handed_back["migrations"] + 1
    stack.wait_idle()


def test_worker_killed_mid_stream_loses_nothing(stack):
    """SIGKILL one of 2 workers during 16 streaming greedy requests: every stream completes with the
    same text as an undisturbed run (the scheduler re-places the sequences with their tokens)."""
    prompts = [f"Story {i}: " + "the library opened its doors and " * (1 + i % 4) for i in range(16)]
    undisturbed = _long_streams(stack, prompts, 1500)
    assert all(finish == "length" and tokens == 1500 for _, finish, tokens in undisturbed)
    stack.wait_idle()
    migrations_before = stack.cluster_status().num_migrations
    killed = {}

    async def kill_busiest_worker(progress):
        # Read on the loop's own thread, blocking it for a moment: from a helper thread the call
        # competed for the GIL with this loop parsing thousands of SSE chunks a second, and on a busy
        # 2-core machine the kill landed after the victim's streams had finished.
        status = stack.cluster_status()
        victim = max(status.workers, key=lambda w: w.num_placed)
        assert victim.num_placed > 0
        os.kill(victim.pid, signal.SIGKILL)
        killed["worker"] = victim.worker_id

    disturbed = _long_streams(stack, prompts, 1500, kill_busiest_worker)
    for i, (before, after) in enumerate(zip(undisturbed, disturbed)):
        assert after == before, f"request {i} changed after {killed['worker']} was killed"
    assert stack.cluster_status().num_migrations > migrations_before
    wait_for(lambda: len(stack.cluster_status().workers) == 2, 120, "serve to restart the killed worker")
    stack.wait_idle()


def test_constrained_streams_survive_a_killed_worker(stack):
    """Structured outputs across a migration: the new worker replays each sequence's output into a fresh
    grammar matcher and goes on under the same grammar, so the text equals an undisturbed run's."""
    import json

    import jsonschema

    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 500}
    fields = {"structured_outputs": {"json": schema}}
    prompts = [f"Numbers {i}: " + "seven, eleven, " * (1 + i % 3) for i in range(8)]
    undisturbed = stream_completions(stack.base_url, "tiny", prompts, 600, started_at=10, extra_body=fields)
    stack.wait_idle()
    migrations_before = stack.cluster_status().num_migrations

    async def kill_busiest_worker(progress):
        status = stack.cluster_status()
        victim = max(status.workers, key=lambda w: w.num_placed)
        assert victim.num_placed > 0
        os.kill(victim.pid, signal.SIGKILL)

    disturbed = stream_completions(stack.base_url, "tiny", prompts, 600, kill_busiest_worker, started_at=10,
                                   extra_body=fields)
    assert disturbed == undisturbed
    assert stack.cluster_status().num_migrations > migrations_before
    for text, finish, tokens in disturbed:  # cut at max_tokens inside the array: a prefix of a valid one
        assert finish == "length" and tokens == 600
        closed = (text if text.endswith(",") else text + ",") + "0]"
        jsonschema.validate(json.loads(closed), {**schema, "minItems": 1})
    wait_for(lambda: len(stack.cluster_status().workers) == 2, 120, "serve to restart the killed worker")
    stack.wait_idle()


def test_scheduler_killed_mid_stream_loses_nothing(stack):
    """SIGKILL the scheduler during 16 streaming greedy requests: no token passes through it, so every
    stream completes with the same text as an undisturbed run and no error; serve restarts it, the new
    one rebuilds its view from the gateway's and the workers' reports, and a request sent during the
    outage succeeds once it is back. Afterwards every block is free."""
    prompts = [f"Story {i}: " + "the library opened its doors and " * (1 + i % 4) for i in range(16)]
    undisturbed = _long_streams(stack, prompts, 1500)
    stack.wait_idle()
    killed: dict = {}

    async def kill_scheduler(progress):
        (pid,) = stack.child_pids("scheduler")
        assert stack.cluster_status().num_active_requests == len(prompts)
        os.kill(pid, signal.SIGKILL)
        killed["pid"] = pid
        # openai's 5 s connect timeout is the client's, not the gateway's: this loop also runs the 16
        # streams while the workers hold both cores, and in two of four full-suite runs on a 2-core
        # machine the connect had not completed in 5 s. What is tested is that the gateway holds the
        # request through the outage (its own bound: --scheduler-wait, 30 s) and then serves it.
        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
        # Sent while no scheduler answers: it waits at the gateway, then runs on the new scheduler
        # (the 16 streams go on meanwhile, as tasks of this loop).
        killed["during"] = await client.completions.create(model="tiny", prompt="Sent during the outage: ",
                                                           max_tokens=5, temperature=0)

    disturbed = _long_streams(stack, prompts, 1500, kill_scheduler)
    for i, (before, after) in enumerate(zip(undisturbed, disturbed)):
        assert after == before, f"request {i} changed after the scheduler was killed"
    during = killed["during"]
    assert during.choices[0].finish_reason == "length" and during.usage.completion_tokens == 5
    (new_pid,) = wait_for(lambda: stack.child_pids("scheduler"), 30, "serve to restart the scheduler")
    assert new_pid != killed["pid"]
    wait_for(lambda: len(stack.cluster_status().workers) == 2, 60, "both workers to register again")
    stack.wait_idle()


def test_redis_restart_mid_run(tiny_model_dir, tmp_path):
    """With --kvstore redis: Redis restarted mid-run; serving continues and the index is rebuilt in it."""
    import redis

    with RedisServer() as server, ServeStack(tiny_model_dir, workers=1,
                                             extra_args=["--kvstore", server.url, "--served-model-name", "tiny"],
                                             log_path=tmp_path / "serve.log") as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        r = redis.Redis.from_url(server.url)

        def ask(i: int):
            reply = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}])
            assert reply.choices[0].finish_reason in ("length", "stop")
            return reply

        def index_in_redis():
            status = stack.cluster_status()
            (worker,) = status.workers
            held = r.scard(f"metroserve:wblk:{worker.worker_id}")
            return held if held and held == worker.num_index_blocks else None

        ask(0)
        before = wait_for(index_in_redis, 30, "the prefix index in Redis")
        server.restart()
        assert r.dbsize() == 0  # a restarted Redis has nothing
        for i in range(1, 5):  # serving goes on while Redis is empty or reconnecting
            ask(i)
        after = wait_for(index_in_redis, 30, "the prefix index to be rebuilt in Redis")
        assert after >= before
        stack.wait_idle()
