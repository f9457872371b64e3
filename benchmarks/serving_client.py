"""The bench's side of the wire: one streamed request measured, and the server's counters read.

A request streams over SSE; TTFT is the time to the first chunk with text, ITL the gaps between
later text chunks, the output token count comes from the usage chunk. Server counters are found in
Prometheus text by the suffix of their names, so `metroserve:` and `vllm:` servers both work.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from metroserve.benchmarks.serving_datasets import BenchRequest

# Server counters by the suffix of their sample names (prometheus_client keeps `_total` on samples).
COUNTER_SUFFIXES = {
    "prefix_cache_queries": "prefix_cache_queries_total",
    "prefix_cache_hits": "prefix_cache_hits_total",
    "spec_draft_tokens": "spec_decode_num_draft_tokens_total",
    "spec_accepted_tokens": "spec_decode_num_accepted_tokens_total",
    "spec_drafts": "spec_decode_num_drafts_total",
}


class BenchError(Exception):
    """Ends the bench with one line: the server cannot be reached or names no model."""


@dataclass
class RequestRecord:
    """What one request measured; times in seconds from when it was sent."""

    success: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; undefined for one-token outputs."""
        if not self.success or self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}



def parse_counters(text: str) -> dict[str, float]:
    """Sums of the known counters over all series in Prometheus text, whatever the metric prefix."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, suffix in COUNTER_SUFFIXES.items():
                if sample.name.endswith(suffix):
                    totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def counter_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """Counter deltas over a run and the rates derived from them; None where a side lacks the counter."""
    deltas: dict[str, float | None] = {
        key: after[key] - before[key] if before and after and key in before and key in after else None
        for key in COUNTER_SUFFIXES}
    per_draft = _ratio(deltas["spec_accepted_tokens"], deltas["spec_drafts"])
    return {**deltas,
            "prefix_cache_hit_rate": _ratio(deltas["prefix_cache_hits"], deltas["prefix_cache_queries"]),
            "spec_acceptance_rate": _ratio(deltas["spec_accepted_tokens"], deltas["spec_draft_tokens"]),
            "spec_mean_acceptance_length": None if per_draft is None else 1 + per_draft}


def _sse_data(line: bytes) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    text = line.decode("utf-8").strip()
    return text[5:].strip() if text.startswith("data:") else None


def _chunk_text(chunk: dict[str, Any]) -> str:
    return "".join(choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                   for choice in chunk.get("choices") or ())


@dataclass
class Target:
    """The server under test and what every request sends besides its prompt."""

    session: aiohttp.ClientSession
    base_url: str
    model: str
    temperature: float
    ignore_eos: bool
    notes: list[str]

    def note(self, message: str) -> None:
        """Print a caveat once and keep it for the report."""
        if message not in self.notes:
            self.notes.append(message)
            print(f"note: {message}", file=sys.stderr, flush=True)

    def endpoint(self, chat: bool) -> str:
        return "/v1/chat/completions" if chat else "/v1/completions"

    async def send(self, request: BenchRequest) -> RequestRecord:
        """Stream one request; any failure is recorded in the record, never raised."""
        body = {"model": self.model, "max_tokens": request.max_tokens, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True},
                "messages" if request.is_chat else "prompt": request.prompt}
        if self.ignore_eos:
            body["ignore_eos"] = True  # only when on: servers without the extension may reject the field
        record = RequestRecord(prompt_tokens=request.prompt_len)
        start = last = time.perf_counter()
        text_chunks, usage_tokens, finished = 0, None, False
        try:
            async with self.session.post(self.base_url + self.endpoint(request.is_chat), json=body) as resp:
                if resp.status != 200:
                    record.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return record
                async for line in resp.content:
                    data = _sse_data(line)
                    if not data:
                        continue
                    if data == "[DONE]":
                        finished = True
                        break
                    chunk = json.loads(data)
                    now = time.perf_counter()
                    if "error" in chunk:
                        record.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                        return record
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                        record.prompt_tokens = chunk["usage"].get("prompt_tokens", record.prompt_tokens)
                    if _chunk_text(chunk):
                        text_chunks += 1
                        if record.ttft_s is None:
                            record.ttft_s = now - start
                        else:
                            record.itl_s.append(now - last)
                        last = now
            if not finished:
                record.error = "the stream ended without [DONE]"
                return record
            record.e2e_s = time.perf_counter() - start
            record.completion_tokens = usage_tokens if usage_tokens is not None else text_chunks
            record.success = True
        except Exception as e:  # a network or protocol failure fails this request, never the run
            record.error = f"{type(e).__name__}: {e}"
        return record


async def served_models(session: aiohttp.ClientSession, base_url: str) -> list[str]:
    """Model ids from GET /v1/models; raises BenchError when the server cannot be reached."""
    try:
        async with session.get(base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                return []
            return [m["id"] for m in (await resp.json()).get("data", [])]
    except aiohttp.ContentTypeError:  # not JSON: a server without /v1/models
        return []
    except (TimeoutError, aiohttp.ClientError) as e:
        raise BenchError(f"cannot reach {base_url}: {str(e) or type(e).__name__}") from None
    except (ValueError, KeyError, TypeError, AttributeError):  # JSON of another shape
        return []


async def scrape(target: Target, urls: list[str]) -> dict[str, float] | None:
    """Known counters summed over every URL; None (with a note) when any URL cannot be read."""
    totals: dict[str, float] = {}
    for url in urls:
        try:
            async with target.session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                resp.raise_for_status()
                text = await resp.text()
            counters = parse_counters(text)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            target.note(f"cannot read metrics at {url} ({type(e).__name__}: {e}); server counters are left null")
            return None
        if not counters:
            target.note(f"{url} exports no prefix-cache or speculative-decoding counters")
        for key, value in counters.items():
            totals[key] = totals.get(key, 0.0) + value
    return totals
