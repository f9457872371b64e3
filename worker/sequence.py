"""Request and Sequence: the engine's per-request state.

A Request is what a client asked for; it owns one Sequence per sample (n > 1 forks the prompt's
sequence after prefill). A Sequence is a token list plus how much of it has KV in the pool.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from metroserve.common.block_hash import BlockHash, extra_keys_for
from metroserve.common.detokenizer import IncrementalDetokenizer
from metroserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    from xgrammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0  # output generated here (resumed tokens not counted), once finished
    num_preemptions: int = 0


_seq_ids = itertools.count()


class Sequence:
    def __init__(self, request: Request, index: int, token_ids: list[int], num_prompt_tokens: int):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index  # which of the request's n samples
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0  # tokens whose K/V are in the pool
        self.block_table: list[int] = []
        self.block_hashes: list[BlockHash] = []  # chained hashes of the full blocks of token_ids
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.num_released_blocks = 0  # leading blocks behind every layer's sliding window, given back
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if request.params.logprobs is not None else None
        self.generator: torch.Generator | None = None  # created by the sampler for seeded requests
        self.detokenizer: IncrementalDetokenizer | None = None  # set by the engine when it returns text
        self.num_emitted_tokens = 0  # tokens already handed to a streaming consumer
        self.num_emitted_chars = 0
        self.last_token_time: float | None = None  # for the inter-token latency metric
        # Speculative decoding (worker.spec_decode): this step's drafts, which are not in token_ids
        # until verified; the number of positions scheduled for them; the draft model's
        # distributions for sampled rows; recent acceptance and a pause after poor acceptance.
        self.spec_token_ids: list[int] = []
        self.num_lookahead_tokens = 0
        self.draft_probs: torch.Tensor | None = None  # [len(spec_token_ids), vocab]
        self.spec_acceptance = 0.5
        self.spec_pause = 0
        # Structured outputs (worker.structured_output): an xgrammar GrammarMatcher that has accepted
        # this sequence's output so far; None when the request puts no constraint on its output.
        self.grammar: GrammarMatcher | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """More than the last token lacks K/V: a prompt (or a resumed output) is still being computed.
        Between steps a decoding sequence has exactly its last, just-sampled token to compute."""
        return self.num_computed_tokens + 1 < self.num_tokens

    def keep_output(self, num_tokens: int) -> None:
        """Drop output past num_tokens: what a finished sequence generated after its client's stream
        had already ended."""
        del self.token_ids[self.num_prompt_tokens + num_tokens:]
        if self.logprobs is not None:
            del self.logprobs[num_tokens:]
        self.num_emitted_tokens = min(self.num_emitted_tokens, num_tokens)

    def clear_spec(self) -> None:
        self.spec_token_ids = []
        self.num_lookahead_tokens = 0
        self.draft_probs = None

    def truncate_spec(self, num_tokens: int) -> None:
        """Keep only the first num_tokens lookahead positions (the step's token budget ran short)."""
        self.num_lookahead_tokens = min(self.num_lookahead_tokens, num_tokens)
        del self.spec_token_ids[num_tokens:]
        if self.draft_probs is not None:
            self.draft_probs = self.draft_probs[:num_tokens]

    def fork(self, index: int) -> Sequence:
        """A sibling sample sharing this sequence's tokens; its blocks are shared by the block manager."""
        child = Sequence(self.request, index, list(self.token_ids), self.num_prompt_tokens)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_cached_blocks = self.num_cached_blocks
        child.status = self.status
        return child


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first scheduling
    num_resumed_tokens: int = 0  # output produced on another worker before a migration
    aborted: bool = False
    metrics: RequestMetrics = field(init=False)
    # With params.prompt_logprobs: per prompt token, {token id: logprob} (the token itself and the
    # top-N); the first token's is None. Filled as prefill chunks run.
    prompt_logprobs: list[dict[int, float] | None] | None = field(init=False)
    prompt_logprobs_emitted: bool = False  # handed to a streaming consumer

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.seqs = [Sequence(self, 0, list(self.prompt_token_ids), len(self.prompt_token_ids))]
        self.prompt_logprobs = [None] if self.params.prompt_logprobs is not None else None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked and not all computed yet: its prompt must run through the model
        from the first token, so it takes nothing from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def extra_keys(self) -> tuple[str, ...]:
        return extra_keys_for(self.cache_salt)

    @property
    def finished(self) -> bool:
        # Before the fork (n > 1) only the first sequence exists; it finishing alone ends the
        # request only when it was aborted.
        return all(s.finished for s in self.seqs) and (self.aborted or len(self.seqs) == self.params.n)

    @property
    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)
