"""What the scheduler knows about one request and where its sequences run.

A request's n sequences are placed together as one Placement. If its worker is lost, each
unfinished sequence becomes its own Placement on another worker, carrying the tokens it already
produced (resume tokens), so the client's stream goes on from where it was: no token is lost and
none is sent twice, because the scheduler forwards only tokens it has not forwarded before.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from metroserve.common.request_limits import max_token_id
from metroserve.common.sampling_params import SamplingParams
from metroserve.rpc import generation_pb2

_placement_ids = itertools.count()


@dataclass
class Placement:
    request: RequestState
    base_index: int  # the request's sequence index of this placement's sequence 0
    num_seqs: int
    resume_token_ids: list[int]
    block_hashes: list[bytes]  # of prompt + resume tokens, for prefix-aware placement
    placement_id: str = field(init=False)
    worker_id: str | None = None
    prefill_tokens: int = 0  # tokens the worker must compute before the first output
    started: bool = False  # the worker has sent output for it
    queued_wall_time: float = field(default_factory=time.time)  # for its queueing span

    def __post_init__(self) -> None:
        self.placement_id = f"{self.request.request_id}/{next(_placement_ids)}"

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.resume_token_ids)

    @property
    def sort_key(self) -> tuple[int, float]:
        return self.request.priority, self.request.arrival_time


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    params_proto: generation_pb2.SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    outputs: list[list[int]] = field(init=False)  # per sequence: tokens forwarded so far
    finish_reasons: list[str | None] = field(init=False)
    largest_token_id: int = field(init=False)  # for placement's fits(): the vocabulary it needs
    num_cached_tokens: int = 0
    placements: dict[str, Placement] = field(default_factory=dict)  # live ones
    # What the Generate stream sends: GenerateResponse messages, or a core.RequestError to end with.
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False
    # Telemetry (scheduler/telemetry.py): monotonic times, workers placed on, the trace span.
    arrival_wall_time: float = field(default_factory=time.time)
    placed_time: float | None = None
    first_token_time: float | None = None
    workers: list[str] = field(default_factory=list)
    num_migrations: int = 0
    span: Any = None

    def __post_init__(self) -> None:
        self.largest_token_id = max_token_id(self.prompt_token_ids, self.params)
        self.outputs = [[] for _ in range(self.params.n)]
        self.finish_reasons = [None] * self.params.n

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.finish_reasons)

    def usage(self) -> generation_pb2.Usage:
        return generation_pb2.Usage(prompt_tokens=len(self.prompt_token_ids),
                                    completion_tokens=sum(map(len, self.outputs)),
                                    cached_tokens=self.num_cached_tokens)
