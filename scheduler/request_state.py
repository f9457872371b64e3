"""What the scheduler knows about one request and where its sequences run.

The scheduler never sees a request's tokens: the gateway that owns the request receives them from
the worker. It sees the request at admission, placement, completion (the worker's finish report,
or the gateway's Abort) and migration. A request's n sequences are placed together as one
Placement. When its worker is lost, the placement's owning gateway is asked for the tokens it
delivered (a ResumeQuery); each unfinished sequence then becomes its own Placement carrying those
tokens as resume tokens, so the client's stream goes on from exactly where it was.
"""

from __future__ import annotations

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
    placement_id: str = ""  # "": a new one, "<request id>/<counter>"
    worker_id: str | None = None
    prefill_tokens: int = 0  # tokens the worker must compute before the first output
    reports_since_placed: int = 0  # worker load reports since: after two, its prefill counts as done
    queued_wall_time: float = field(default_factory=time.time)  # for its queueing span

    def __post_init__(self) -> None:
        if not self.placement_id:
            self.placement_id = f"{self.request.request_id}/{next(_placement_ids)}"

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.resume_token_ids)

    @property
    def indices(self) -> range:
        return range(self.base_index, self.base_index + self.num_seqs)

    @property
    def sort_key(self) -> tuple[int, float]:
        return self.request.priority, self.request.arrival_time


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    params_proto: generation_pb2.SamplingParams
    gateway_id: str  # the gateway that owns it: its client, its tokens, its Abort
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    finish_reasons: list[str | None] = field(init=False)
    num_tokens: list[int] = field(init=False)  # per sequence: output tokens, known once it finished
    largest_token_id: int = field(init=False)  # for placement's fits(): the vocabulary it needs
    num_cached_tokens: int = 0
    placements: dict[str, Placement] = field(default_factory=dict)  # live ones
    # Rebuilt from its gateway's report after a scheduler restart: the placements workers report
    # are adopted until the recovery window closes; what none reports is then migrated.
    recovering: bool = False
    done: bool = False
    # Telemetry (scheduler/telemetry.py): monotonic times, workers placed on, the trace span.
    arrival_wall_time: float = field(default_factory=time.time)
    placed_time: float | None = None
    end_time: float | None = None  # when its gateway saw it end, if it says; else when the scheduler did
    workers: list[str] = field(default_factory=list)
    num_migrations: int = 0
    num_workers_lost: int = 0  # workers that were lost while running one of its placements
    span: Any = None

    def __post_init__(self) -> None:
        self.largest_token_id = max_token_id(self.prompt_token_ids, self.params)
        self.finish_reasons = [None] * self.params.n
        self.num_tokens = [0] * self.params.n

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.finish_reasons)

    def usage(self) -> generation_pb2.Usage:
        return generation_pb2.Usage(prompt_tokens=len(self.prompt_token_ids), completion_tokens=sum(self.num_tokens),
                                    cached_tokens=self.num_cached_tokens)
