"""The engine's metrics: what a step and a finished request add, and their Prometheus view.

Names and semantics follow vLLM's, under the prefix `metroserve:` (so dashboards carry over by
replacing `vllm:`). Counters that the block manager, batcher and speculator already keep (prefix
cache queries / hits in tokens, preemptions, speculative drafts) are read from them at scrape time;
this module keeps only what nothing else counts: prompt and generation tokens, finished requests
by reason, and the latency histograms.

The hot path pays one list append per sampled sequence (its inter-token gap) and one numpy
bucketing call per step; everything per request happens once, when it finishes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from metroserve.worker.batcher import Batcher, ScheduledBatch
    from metroserve.worker.sequence import Request
    from metroserve.worker.spec_decode.speculator import SpecDecodeStats

PREFIX = "metroserve:"

# Bucket bounds as in vLLM, so dashboards keep their resolution.
_LATENCY_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
              20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000]


class Histogram:
    """Cumulative-bucket histogram that takes a step's observations in one numpy call."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)  # the last bucket is +Inf
        self.sum = 0.0

    def observe(self, values: list[float]) -> None:
        if not values:
            return
        # side="left": a value equal to a bound belongs to that bound's `le` bucket.
        index = np.searchsorted(self.bounds, values, side="left")
        self.counts += np.bincount(index, minlength=len(self.counts))
        self.sum += float(np.sum(values))

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def family(self, name: str, doc: str, labels: dict[str, str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(PREFIX + name, doc, labels=list(labels))
        cumulative = np.cumsum(self.counts)
        buckets = [(repr(float(b)), int(c)) for b, c in zip(self.bounds, cumulative)]
        buckets.append(("+Inf", int(cumulative[-1])))
        family.add_metric(list(labels.values()), buckets, self.sum)
        return family


class EngineMetrics:
    """Counters and histograms the engine records; read by EngineCollector at scrape time."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter = Counter()  # finish reason -> completions (a request with n=2 counts 2)
        self.ttft = Histogram(_LATENCY_S)
        self.itl = Histogram(_ITL_S)
        self.e2e = Histogram(_LATENCY_S)
        self.queue_time = Histogram(_LATENCY_S)
        self.prefill_time = Histogram(_LATENCY_S)
        self.decode_time = Histogram(_LATENCY_S)
        self.iteration_tokens = Histogram(_TOKENS)
        self.request_prompt_tokens = Histogram(_TOKENS)
        self.request_generation_tokens = Histogram(_TOKENS)

    def record_step(self, num_scheduled_tokens: int, num_generated: int, num_first_tokens_prompt: int,
                    first_token_latencies: list[float], token_gaps: list[float]) -> None:
        self.iteration_tokens.observe([num_scheduled_tokens])
        self.generation_tokens += num_generated
        self.prompt_tokens += num_first_tokens_prompt
        self.ttft.observe(first_token_latencies)
        self.itl.observe(token_gaps)

    def record_finished(self, request: Request, now: float) -> None:
        """Once per finished or aborted request."""
        m = request.metrics
        for seq in request.seqs:
            self.finished[seq.finish_reason or "abort"] += 1
        self.e2e.observe([now - m.arrival_time])
        self.request_prompt_tokens.observe([len(request.prompt_token_ids)])
        self.request_generation_tokens.observe([m.num_generation_tokens])
        if m.first_scheduled_time is not None:
            self.queue_time.observe([m.first_scheduled_time - m.arrival_time])
            if m.first_token_time is not None:
                self.prefill_time.observe([m.first_token_time - m.first_scheduled_time])
                self.decode_time.observe([now - m.first_token_time])


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_evictions: int
    num_preemptions: int
    peak_used_blocks: int
    kv_efficiency_at_peak: float  # tokens stored / (allocated blocks x block size) at peak use
    spec_decode: SpecDecodeStats | None = None  # None without --speculative-config

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks


class KVPeak:
    """The KV pool's peak use in blocks, and at that peak the share of their slots holding tokens
    (shared full blocks count once; only a sequence's tail block can hold empty slots). Observed
    after each step's schedule; it costs a pass over the running sequences only at a new peak."""

    def __init__(self) -> None:
        self.used_blocks = 0
        self.efficiency = 1.0

    def observe(self, batcher: Batcher, batch: ScheduledBatch) -> None:
        used = batcher.block_manager.num_used_blocks
        if used <= self.used_blocks:
            return
        bs = batcher.block_manager.block_size
        scheduled = dict(zip(map(id, batch.seqs), batch.num_new_tokens))
        empty = sum(len(s.block_table) * bs - s.num_computed_tokens - scheduled.get(id(s), 0) for s in batcher.running)
        self.used_blocks = used
        self.efficiency = 1.0 - empty / (used * bs)


def engine_stats(batcher: Batcher, peak: KVPeak, spec_decode: SpecDecodeStats | None = None) -> EngineStats:
    """An engine's stats from its batcher (and block manager): the real engine's and the mock's."""
    bm = batcher.block_manager
    return EngineStats(
        num_running=len(batcher.running), num_waiting=len(batcher.waiting), num_free_blocks=bm.num_free_blocks,
        num_total_blocks=bm.num_blocks, prefix_cache_queries=bm.stats.queries, prefix_cache_hits=bm.stats.hits,
        prefix_cache_evictions=bm.stats.evictions, num_preemptions=batcher.num_preemptions,
        peak_used_blocks=peak.used_blocks, kv_efficiency_at_peak=peak.efficiency, spec_decode=spec_decode)


class StatsSource(Protocol):
    """What the collector reads: an LLMEngine."""

    metrics: EngineMetrics | None

    def stats(self) -> EngineStats: ...


class EngineCollector:
    """A prometheus_client collector over one engine: scraping reads the engine, it never writes."""

    def __init__(self, engine: StatsSource, labels: dict[str, str]):
        self.engine = engine
        self.labels = labels

    def _one(self, family_type, name: str, doc: str, value: float, extra: dict[str, str] | None = None):
        labels = {**self.labels, **(extra or {})}
        family = family_type(PREFIX + name, doc, labels=list(labels))
        family.add_metric(list(labels.values()), value)
        return family

    def collect(self):
        engine, m = self.engine, self.engine.metrics
        s = engine.stats()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._one(gauge, "num_requests_running", "Sequences in the running batch.", s.num_running)
        yield self._one(gauge, "num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield self._one(gauge, "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                        s.kv_cache_usage)
        yield self._one(gauge, "num_kv_blocks_total", "KV cache blocks in the pool.", s.num_total_blocks)
        yield self._one(gauge, "num_kv_blocks_free", "KV cache blocks free (cached-but-unused included).",
                        s.num_free_blocks)
        yield self._one(counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                        s.prefix_cache_queries)
        yield self._one(counter, "prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                        s.prefix_cache_hits)
        yield self._one(counter, "prefix_cache_evictions", "Cached blocks overwritten by new content.",
                        s.prefix_cache_evictions)
        yield self._one(counter, "num_preemptions", "Sequences preempted (recomputed later).", s.num_preemptions)
        if m is None:
            return
        yield self._one(counter, "prompt_tokens", "Prompt tokens of requests that produced a first token.",
                        m.prompt_tokens)
        yield self._one(counter, "generation_tokens", "Tokens generated.", m.generation_tokens)
        success = CounterMetricFamily(PREFIX + "request_success", "Finished completions by finish reason.",
                                      labels=[*self.labels, "finished_reason"])
        for reason in ("stop", "length", "abort", *sorted(set(m.finished) - {"stop", "length", "abort"})):
            success.add_metric([*self.labels.values(), reason], m.finished.get(reason, 0))
        yield success
        if s.spec_decode is not None:
            sd = s.spec_decode
            yield self._one(counter, "spec_decode_num_drafts", "Verification rounds with drafts.", sd.num_drafts)
            yield self._one(counter, "spec_decode_num_draft_tokens", "Draft tokens proposed.", sd.num_draft_tokens)
            yield self._one(counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            sd.num_accepted_tokens)
        for hist, name, doc in (
                (m.ttft, "time_to_first_token_seconds", "Arrival at the worker to the first token."),
                (m.itl, "inter_token_latency_seconds", "Gap between a sequence's successive token outputs."),
                (m.e2e, "e2e_request_latency_seconds", "Arrival at the worker to finish."),
                (m.queue_time, "request_queue_time_seconds", "Arrival to first scheduled."),
                (m.prefill_time, "request_prefill_time_seconds", "First scheduled to first token."),
                (m.decode_time, "request_decode_time_seconds", "First token to finish."),
                (m.iteration_tokens, "iteration_tokens_total", "Tokens scheduled per engine step."),
                (m.request_prompt_tokens, "request_prompt_tokens", "Prompt length of finished requests."),
                (m.request_generation_tokens, "request_generation_tokens", "Tokens generated per finished request.")):
            yield hist.family(name, doc, self.labels)
