"""Load generator for any OpenAI-compatible server: latency, throughput, goodput and cache hits.

Requests stream over SSE (aiohttp, one session). Per request it measures TTFT (to the first chunk
with text), ITL (gaps between later text chunks), TPOT ((e2e - TTFT) / (output tokens - 1), output
tokens from the usage chunk) and end-to-end latency. Arrivals follow --request-rate (gamma gaps of
shape --burstiness; 1 is Poisson) and/or --max-concurrency; either flag takes a comma list, which
runs the same requests once per value (a sweep). Server-side counters (prefix-cache hits,
speculative acceptance) are read as deltas of the Prometheus text at --metrics-url around each run,
by name suffix, so `metroserve:` and `vllm:` servers both work.

Runs of a sweep share the server: a later run finds the prefixes an earlier one left cached.
Restart the server, or use one command per value, where that matters.

    metroserve bench serve --dataset shared-prefix --num-prefixes 8 --suffixes-per-prefix 16 \\
        --prefix-len 512 --suffix-len 64 --output-len 64 --max-concurrency 1,4,16 \\
        --goodput ttft:500 tpot:100 --label cache-on --result-json on.json --plot-dir plots
    metroserve bench serve --compare on.json off.json --plot-dir plots
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from metroserve.benchmarks.serving_client import (
    BenchError,
    RequestRecord,
    Target,
    counter_deltas,
    scrape,
    served_models,
)
from metroserve.benchmarks.serving_datasets import (
    BenchRequest,
    chat_jsonl_requests,
    random_requests,
    shared_prefix_requests,
)
from metroserve.benchmarks.serving_report import compare_reports, format_table, write_plots

MAX_ERRORS_KEPT = 5
WARMUP_MAX_TOKENS = 4


# -- records and summaries -----------------------------------------------------------------------


@dataclass
class LatencyStats:
    """Mean and percentiles in milliseconds; all None when nothing was measured."""

    mean: float | None = None
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        if not seconds:
            return cls()
        ms = np.asarray(seconds, dtype=np.float64) * 1000
        return cls(float(ms.mean()), *(float(np.percentile(ms, q)) for q in (50, 95, 99)))


@dataclass
class SLOs:
    """Per-request limits in ms; goodput counts the requests within all the given ones."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str] | None) -> SLOs | None:
        """From ["ttft:500", "tpot:50", "e2el:2000"] (any subset); None when there are none."""
        if not items:
            return None
        slos = cls()
        for item in items:
            name, _, value = item.partition(":")
            try:
                limit = float(value)
            except ValueError:
                limit = -1.0
            if name not in ("ttft", "tpot", "e2el") or not limit > 0:
                raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS with MS > 0, got {item!r}")
            setattr(slos, f"{name}_ms", limit)
        return slos

    def met(self, record: RequestRecord) -> bool:
        """A failed request never counts; a metric the request lacks (TPOT of one token) is not held against it."""
        if not record.success:
            return False
        pairs = ((self.ttft_ms, record.ttft_s), (self.tpot_ms, record.tpot_s), (self.e2el_ms, record.e2e_s))
        return all(limit is None or value is None or value * 1000 <= limit for limit, value in pairs)


@dataclass
class RunSetting:
    """How one run sends its requests."""

    max_concurrency: int | None
    request_rate: float  # requests/s; inf sends all at once
    burstiness: float

    @property
    def name(self) -> str:
        parts = [f"c={self.max_concurrency}"] if self.max_concurrency is not None else []
        if not math.isinf(self.request_rate):
            parts.append(f"rate={self.request_rate:g}")
        return " ".join(parts) or "all at once"


@dataclass
class RunSummary:
    """One run's results; request_rate None means all at once, max_concurrency None unlimited."""

    name: str
    max_concurrency: int | None
    request_rate: float | None
    burstiness: float
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    goodput: float | None  # requests/s within every SLO; None without --goodput
    server: dict[str, float | None]  # counter deltas and rates from --metrics-url; None = unknown
    errors: list[str]


def summarize(setting: RunSetting, records: list[RequestRecord], duration_s: float, slos: SLOs | None,
              server: dict[str, float | None]) -> RunSummary:
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.completion_tokens for r in done)
    return RunSummary(
        name=setting.name, max_concurrency=setting.max_concurrency,
        request_rate=None if math.isinf(setting.request_rate) else setting.request_rate,
        burstiness=setting.burstiness, completed=len(done), failed=len(records) - len(done),
        duration_s=duration_s, total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s, output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        ttft_ms=LatencyStats.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=LatencyStats.of([r.tpot_s for r in done if r.tpot_s is not None]),
        itl_ms=LatencyStats.of([gap for r in done for gap in r.itl_s]),
        e2el_ms=LatencyStats.of([r.e2e_s for r in done if r.e2e_s is not None]),  # set on every success
        goodput=None if slos is None else sum(slos.met(r) for r in records) / duration_s,
        server=server, errors=[r.error for r in records if r.error][:MAX_ERRORS_KEPT])


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Send times in seconds from the run's start: gamma gaps of shape B and mean 1/rate; all 0 at inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:n]


async def run_requests(target: Target, requests: list[BenchRequest], setting: RunSetting,
                       seed: int) -> tuple[list[RequestRecord], float]:
    """Send every request on the run's schedule; the records (in request order) and the run's seconds."""
    offsets = arrival_offsets(len(requests), setting.request_rate, setting.burstiness, np.random.default_rng(seed))
    gate = asyncio.Semaphore(setting.max_concurrency) if setting.max_concurrency else nullcontext()
    bar = tqdm(total=len(requests), desc=setting.name, unit="req")
    start = time.perf_counter()

    async def one(request: BenchRequest, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with gate:
            record = await target.send(request)
        bar.update(1)
        return record

    records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
    duration = time.perf_counter() - start
    bar.close()
    return list(records), duration


async def warm_up(target: Target, count: int, chat: bool) -> None:
    """Short requests unrelated to the dataset, so they leave none of its prefixes in the cache."""
    for i in range(count):
        prompt = f"Warm-up request {i}: say hello."
        request = BenchRequest([{"role": "user", "content": prompt}] if chat else prompt, WARMUP_MAX_TOKENS)
        record = await target.send(request)
        if not record.success:
            target.note(f"warm-up request failed: {record.error}")


# -- settings, datasets, report ------------------------------------------------------------------


def _parse_list(text: str, parse_one, flag: str) -> list:
    try:
        values = [parse_one(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values:
        raise ValueError(f"{flag}: expected a value or a comma list of values, got {text!r}")
    return values


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise ValueError(text)
        return value
    return parse


def sweep_settings(args: argparse.Namespace) -> tuple[list[RunSetting], str | None]:
    """One setting per swept value, and the swept field (None for a single run)."""
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    rates = _parse_list(args.request_rate, _positive(float), "--request-rate")
    limits = [None] if args.max_concurrency is None else _parse_list(args.max_concurrency, _positive(int),
                                                                     "--max-concurrency")
    if len(rates) > 1 and len(limits) > 1:
        raise ValueError("sweep one of --request-rate and --max-concurrency at a time")
    key = "request_rate" if len(rates) > 1 else "max_concurrency" if len(limits) > 1 else None
    return [RunSetting(c, r, args.burstiness) for r in rates for c in limits], key


def load_bench_tokenizer(path: str | None) -> Any:
    """The tokenizer at `path` (a model dir or .gguf), else that of metroserve's default model."""
    from metroserve.common.tokenizer import load_tokenizer
    from metroserve.worker.model_files import resolve_model_dir

    return load_tokenizer(resolve_model_dir(path))


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == "chat-jsonl":
        if args.dataset_path is None:
            raise ValueError("--dataset chat-jsonl needs --dataset-path")
        return chat_jsonl_requests(args.dataset_path, args.num_requests, args.output_len)
    tokenizer = load_bench_tokenizer(args.tokenizer)
    if args.dataset == "random":
        return random_requests(tokenizer, args.num_requests, args.input_len, args.output_len, args.range_ratio,
                               args.seed)
    return shared_prefix_requests(tokenizer, args.num_prefixes, args.suffixes_per_prefix, args.prefix_len,
                                  args.suffix_len, args.output_len, args.seed)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as JSON values (a dispatcher's callable left out)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if not callable(v)}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every run of the sweep against the server; the report that --result-json stores."""
    settings, sweep_key = sweep_settings(args)
    slos = SLOs.parse(args.goodput)
    base_url = re.sub(r"/(v1/?)?$", "", args.base_url.rstrip("/"))
    metrics_urls = args.metrics_url or [base_url + "/metrics"]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap: the sweep decides concurrency
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        models = await served_models(session, base_url)
        model = args.model or (models[0] if models else None)
        if model is None:
            raise BenchError(f"{base_url}/v1/models lists no model; pass --model")
        requests = build_requests(args)
        chat = requests[0].is_chat
        target = Target(session, base_url, model, args.temperature, args.ignore_eos, notes=[])
        runs = []
        for setting in settings:
            await warm_up(target, args.warmup, chat)
            before = await scrape(target, metrics_urls)
            records, duration = await run_requests(target, requests, setting, args.seed)
            after = await scrape(target, metrics_urls)
            summary = summarize(setting, records, duration, slos, counter_deltas(before, after))
            runs.append({"summary": asdict(summary), "requests": [r.as_dict() for r in records]})
    return {"label": args.label, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "base_url": base_url,
            "model": model, "endpoint": target.endpoint(chat), "dataset": args.dataset,
            "num_requests": len(requests), "sweep_key": sweep_key, "slos": None if slos is None else asdict(slos),
            "settings": _settings(args), "notes": target.notes, "runs": runs}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's root URL (a trailing /v1 is accepted)")
    server.add_argument("--model", default=None, help="model id to request (default: the first of GET /v1/models)")
    server.add_argument("--api-key", default=None, help="sent as a Bearer token")
    server.add_argument("--metrics-url", action="append", default=None,
                        help="Prometheus endpoint to scrape before and after each run; repeat for several "
                             "(counters are summed; default: <base-url>/metrics)")
    server.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request fails")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=("random", "shared-prefix", "chat-jsonl"), default="random",
                      help="random token prompts and shared-prefix prompts go to /v1/completions as text; "
                           "chat-jsonl to /v1/chat/completions")
    data.add_argument("--tokenizer", default=None,
                      help="tokenizer for random and shared-prefix prompts: model dir or .gguf "
                           "(default: metroserve's default model)")
    data.add_argument("--num-requests", type=int, default=100, help="requests of random and chat-jsonl")
    data.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    data.add_argument("--output-len", type=int, default=128,
                      help="max_tokens of each request (chat-jsonl lines may set their own max_tokens)")
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="random: input and output lengths uniform in [L*(1-r), L*(1+r)]")
    data.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    data.add_argument("--suffixes-per-prefix", type=int, default=16,
                      help="shared-prefix: requests per prefix (requests = prefixes x suffixes)")
    data.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix tokens")
    data.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: suffix tokens")
    data.add_argument("--dataset-path", type=Path, default=None,
                      help='chat-jsonl: lines of {"messages": [...]} or {"prompt": "..."}, optional "max_tokens"')
    data.add_argument("--seed", type=int, default=0, help="prompts, request order and arrival times")

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", default="inf",
                      help="requests/s, or a comma list to sweep (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival gaps (1: Poisson; < 1 burstier, > 1 more regular)")
    load.add_argument("--max-concurrency", default=None,
                      help="most requests in flight, or a comma list to sweep, e.g. 1,4,16 (default: no limit)")
    load.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each run")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="send ignore_eos (vLLM/metroserve extension) so outputs have the asked length")

    report = parser.add_argument_group("report")
    report.add_argument("--goodput", nargs="+", default=None, metavar="SLO",
                        help="SLOs for goodput, any of ttft:MS tpot:MS e2el:MS")
    report.add_argument("--label", default=None, help="name of this configuration, in the JSON and plot titles")
    report.add_argument("--result-json", type=Path, default=None,
                        help="write settings, per-run summaries and per-request records here")
    report.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    report.add_argument("--compare", nargs="+", type=Path, default=None, metavar="JSON",
                        help="instead of benchmarking: one table (and with --plot-dir a PNG) over these reports")


def main(args: argparse.Namespace) -> int:
    """Run the bench (or --compare); 1 when the server cannot be reached, 2 for bad flags or input."""
    try:
        if args.compare:
            compare_reports(args.compare, args.plot_dir)
            return 0
        report = asyncio.run(bench(args))
    except BenchError as e:
        print(f"metroserve bench serve: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"metroserve bench serve: error: {e}", file=sys.stderr)
        return 2
    print()
    print(format_table([(report["label"], run["summary"]) for run in report["runs"]]))
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot_dir is not None:
        for path in write_plots(report, args.plot_dir):
            print(f"wrote {path}")
    return 0
