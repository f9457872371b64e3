"""What the service path costs: REST -> gateway -> scheduler -> worker vs the offline engine.

The same requests (the chat workload's prompts as token ids, greedy, ignore_eos so both sides
produce exactly --max-tokens per request) run through the offline LLM.generate and through a
`metroserve serve` stack driven by --concurrency streaming clients. The engine gets
the same --max-num-seqs and KV pool on both sides, prefix caching off by default (see
--enable-prefix-caching). Rounds alternate offline and served runs, and which goes first, because
this machine is noisy; the report gives each run, the medians and their ratio.

The client runs on the same machine and takes CPU from the engine, which the service path is not
to blame for; the report gives its CPU seconds per served run. --client aiohttp (the default) reads
the SSE stream with aiohttp and json.loads per chunk, as vLLM's serving benchmark does; --client
openai uses the official package, whose per-chunk parsing costs about five times as much CPU
(measured on a 2-core Zen 4: 1.8-1.9 s vs 0.35-0.40 s per 8,192-token run, ~4% of the machine).

    metroserve bench overhead --num-requests 64 --max-tokens 64 --concurrency 32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from metroserve.benchmarks.workload import build_chat_workload

ROOT = Path(__file__).resolve().parents[1]


def add_workload_arguments(parser: argparse.ArgumentParser, rounds: int, rounds_help: str) -> None:
    """The flags of a served chat workload, shared with `bench observability`."""
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    parser.add_argument("--concurrency", type=int, default=32, help="client streams; also the engine's max_num_seqs")
    parser.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    parser.add_argument("--client", choices=("aiohttp", "openai"), default="aiohttp",
                        help="the streaming client: aiohttp with json.loads per chunk (vLLM's serving benchmark "
                             "reads streams this way; least CPU taken from the engine) or the openai package")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, 3, "offline/served pairs, interleaved")
    parser.add_argument("--port", type=int, default=18400, help="first of three loopback ports for the stack")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                        help="off by default: with it on, each run's hits depend on what earlier runs left in "
                             "the pool, which differs between the two sides and is not what is measured here")
    parser.add_argument("--json-out", type=Path, default=None)


def run_offline(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from metroserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


async def _stream_openai(client: Any, model: str, prompt: list[int], max_tokens: int) -> int:
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    tokens = 0
    async for chunk in stream:
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return tokens


async def _stream_aiohttp(session: Any, base_url: str, model: str, prompt: list[int], max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    tokens = 0
    async with session.post(base_url + "/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def run_served(base_url: str, model: str, prompts: list[list[int]], max_tokens: int,
                     concurrency: int, client: str = "aiohttp") -> tuple[float, int]:
    """Stream every prompt at `concurrency` at a time; (seconds, output tokens from the usage chunks)."""
    import aiohttp
    import openai

    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), desc="Served", unit="req")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as session, \
            openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as openai_client:
        async def one(prompt: list[int]) -> int:
            async with gate:
                if client == "openai":
                    tokens = await _stream_openai(openai_client, model, prompt, max_tokens)
                else:
                    tokens = await _stream_aiohttp(session, base_url, model, prompt, max_tokens)
                bar.update(1)
                return tokens

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
    bar.close()
    return seconds, sum(counts)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError("serve did not become ready")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from metroserve import LLM, SamplingParams
    from metroserve.worker.model_files import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    engine_args = dict(max_num_seqs=args.concurrency, kv_cache_memory=args.kv_cache_memory,
                       enable_prefix_caching=args.enable_prefix_caching)
    llm = LLM(model=str(model_dir), **engine_args)
    prompts = build_chat_workload(llm.get_tokenizer(), num_requests=args.num_requests)
    # Warm-up on both sides: a CPU engine's first steps at new batch shapes are much slower.
    warmup = prompts[: args.concurrency // 2]
    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)

    port, grpc_port, scheduler_port = args.port, args.port + 1, args.port + 2
    serve = subprocess.Popen(
        [sys.executable, "-m", "metroserve.services.cli", "serve", "--model", str(model_dir),
         "--served-model-name", "bench", "--port", str(port), "--grpc-port", str(grpc_port),
         "--scheduler-port", str(scheduler_port),
         "--max-num-seqs", str(args.concurrency), "--kv-cache-memory", args.kv_cache_memory,
         "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}/v1"
    runs: list[dict[str, Any]] = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", serve)
        asyncio.run(run_served(base_url, "bench", warmup, 16, args.concurrency, args.client))
        for round_index in range(args.rounds):
            # Alternate which side goes first, so a drift in machine speed favours neither.
            for mode in ("offline", "served") if round_index % 2 == 0 else ("served", "offline"):
                cpu_before = _cpu_seconds()
                if mode == "offline":
                    seconds, tokens = run_offline(llm, prompts, args.max_tokens)
                else:
                    seconds, tokens = asyncio.run(run_served(base_url, "bench", prompts, args.max_tokens,
                                                             args.concurrency, args.client))
                if tokens != len(prompts) * args.max_tokens:  # ignore_eos: every request gives max_tokens
                    raise RuntimeError(f"{mode} run gave {tokens} output tokens, not {len(prompts) * args.max_tokens}")
                run = {"round": round_index, "mode": mode, "seconds": seconds, "output_tokens": tokens,
                       "tokens_per_s": tokens / seconds}
                if mode == "served":  # this process runs only the client then (the offline engine idles)
                    run["client_cpu_s"] = _cpu_seconds() - cpu_before
                runs.append(run)
                print(f"round {round_index} {mode:8s} {tokens} tokens in {seconds:.2f}s = "
                      f"{tokens / seconds:.1f} tok/s" + (f" (client CPU {run['client_cpu_s']:.2f} s)"
                                                         if mode == "served" else ""), flush=True)
    finally:
        serve.terminate()
        serve.wait(timeout=120)

    med = {mode: statistics.median(r["tokens_per_s"] for r in runs if r["mode"] == mode)
           for mode in ("offline", "served")}
    report = {"model_dir": str(model_dir), "num_requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
              "max_tokens": args.max_tokens, "concurrency": args.concurrency, "rounds": args.rounds,
              "client": args.client, "runs": runs,
              "median_tokens_per_s": med, "served_over_offline": med["served"] / med["offline"]}
    print(f"\nmedian tok/s: offline {med['offline']:.1f}, served {med['served']:.1f}; "
          f"served/offline = {report['served_over_offline']:.3f}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return report
