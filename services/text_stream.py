"""Token deltas from the scheduler -> text deltas for clients, with stop strings applied.

Workers run without detokenization; the gateway turns each sequence's tokens into text with the
same IncrementalDetokenizer the offline engine uses, and applies the same rules as
LLMEngine._append_token: stop strings count only from min_tokens on, and a stop token or EOS that
ended a sequence adds no text (a stop token does when include_stop_str_in_output). When a stop
string ends every sequence, the upstream call is closed, which aborts the request on its worker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from metroserve.rpc import generation_pb2
from metroserve.rpc.convert import params_to_proto
from metroserve.services.scheduler_client import SchedulerClient
from metroserve.common.detokenizer import IncrementalDetokenizer
from metroserve.common.sampling_params import SamplingParams


@dataclass
class TextDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[generation_pb2.TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class StreamUpdate:
    deltas: list[TextDelta] = field(default_factory=list)
    usage: Usage | None = None  # on the last update


class SequenceText:
    def __init__(self, tokenizer, params: SamplingParams):
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.stop_strings, params.include_stop_str_in_output,
                                                  params.skip_special_tokens)
        self.num_tokens = 0
        self.num_sent_chars = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def add(self, delta: generation_pb2.SequenceDelta) -> TextDelta | None:
        if self.finish_reason is not None:
            return None  # a stop string ended it here; the worker's later tokens are discarded
        p = self.params
        upstream_stop = delta.finish_reason == "stop"
        tokens = list(delta.token_ids)
        kept = 0
        for i, token in enumerate(tokens):
            self.num_tokens += 1
            kept += 1
            if upstream_stop and i == len(tokens) - 1:
                # The worker stops only on a stop token or EOS: their text is not output.
                if delta.HasField("stop_token_id") and p.include_stop_str_in_output:
                    self.detokenizer.add_token(token, check_stop=False)
                break
            hit = self.detokenizer.add_token(token, check_stop=self.num_tokens >= p.min_tokens)
            if hit is not None:
                self.finish_reason, self.stop_reason = "stop", hit
                break
        if self.finish_reason is None and delta.finish_reason:
            self.finish_reason = delta.finish_reason
            if delta.HasField("stop_token_id"):
                self.stop_reason = delta.stop_token_id
        finished = self.finish_reason is not None
        end = self.detokenizer.emittable(finished)
        text = self.detokenizer.text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        if not text and not kept and not finished:
            return None
        return TextDelta(delta.index, text, tokens[:kept], list(delta.logprobs[:kept]), self.finish_reason,
                         self.stop_reason)


async def stream_text(client: SchedulerClient, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                      request_id: str, model: str = "", priority: int = 0,
                      cache_salt: str | None = None) -> AsyncIterator[StreamUpdate]:
    """One request through the scheduler. The first update is empty: the request was admitted;
    a refusal raises UpstreamError instead."""
    request = generation_pb2.GenerateRequest(
        request_id=request_id, model=model, token_ids=generation_pb2.TokenIds(ids=prompt_token_ids),
        params=params_to_proto(params), priority=priority, cache_salt=cache_salt or "")
    seqs = [SequenceText(tokenizer, params) for _ in range(params.n)]
    usage = Usage(prompt_tokens=len(prompt_token_ids))
    upstream = client.generate(request)
    try:
        async for msg in upstream:
            if msg.num_cached_tokens:
                usage.cached_tokens = msg.num_cached_tokens
            update = StreamUpdate()
            for delta in msg.outputs:
                text_delta = seqs[delta.index].add(delta)
                if text_delta is not None:
                    update.deltas.append(text_delta)
            finished = all(s.finish_reason is not None for s in seqs)
            if finished or msg.HasField("usage"):
                if msg.HasField("usage"):
                    usage.cached_tokens = msg.usage.cached_tokens
                for index, seq in enumerate(seqs):
                    if seq.finish_reason is None:  # ended upstream without its own finish: aborted
                        seq.finish_reason = "abort"
                        update.deltas.append(TextDelta(index, "", [], [], "abort"))
                usage.completion_tokens = sum(s.num_tokens for s in seqs)
                update.usage = usage
            yield update  # the first, empty one: admitted
            if update.usage is not None:
                return
    finally:
        await upstream.aclose()  # ends the call: the request is aborted upstream if still running
