"""Token deltas from the workers -> text deltas for clients, with stop strings applied.

Workers run without detokenization; the gateway turns each sequence's tokens into text with the
same IncrementalDetokenizer the offline engine uses, and applies the same rules as
the engine (metroserve.common.stop_rules). When stop strings found here end the request, the
gateway tells the scheduler how each sequence ended and how many tokens the client got (Abort with
`ended`), so the scheduler's usage, request log and the worker's counters and span say "stop" and
agree with the client. With n > 1 that report goes out when the last sequence ends; a sequence
ended here by a stop string that reaches its own end on the worker before its siblings finish is
recorded with the worker's reason and token count.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from metroserve.common.detokenizer import IncrementalDetokenizer
from metroserve.common.sampling_params import SamplingParams
from metroserve.common.stop_rules import append_token
from metroserve.rpc import generation_pb2
from metroserve.rpc.convert import params_to_proto
from metroserve.services.cluster_client import ClusterClient


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
    # With the first tokens, when prompt_logprobs was asked: prompt tokens 1.. (token 0 has none)
    prompt_logprobs: list[generation_pb2.TokenLogprobs] = field(default_factory=list)


class SequenceText:
    def __init__(self, tokenizer, params: SamplingParams):
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.stop_strings, params.include_stop_str_in_output,
                                                  params.skip_special_tokens)
        self.num_tokens = 0
        self.num_sent_chars = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.ended_here = False  # a stop string found here ended it, not the worker

    def add(self, delta: generation_pb2.SequenceDelta) -> TextDelta | None:
        if self.finish_reason is not None:
            return None  # a stop string ended it here; the worker's later tokens are discarded
        tokens = list(delta.token_ids)
        # The worker ends a sequence on a stop token or EOS with the last token of the delta: that
        # token is the EOS the shared rules need (a stop token they know from the params).
        eos = (tokens[-1],) if delta.finish_reason == "stop" and not delta.HasField("stop_token_id") else ()
        kept = 0
        for token in tokens:
            self.num_tokens += 1
            kept += 1
            finish = append_token(token, self.num_tokens, self.params, self.detokenizer, eos)
            if finish is not None:
                self.finish_reason, self.stop_reason = finish.reason, finish.stop_reason
                break
        if self.finish_reason is None and delta.finish_reason:  # length at the context limit, abort
            self.finish_reason = delta.finish_reason
        self.ended_here = self.finish_reason == "stop" and delta.finish_reason != "stop"
        finished = self.finish_reason is not None
        end = self.detokenizer.emittable(finished)
        text = self.detokenizer.text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        if not text and not kept and not finished:
            return None
        return TextDelta(delta.index, text, tokens[:kept], list(delta.logprobs[:kept]), self.finish_reason,
                         self.stop_reason)


async def stream_text(client: ClusterClient, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                      request_id: str, model: str = "", priority: int = 0,
                      cache_salt: str | None = None) -> AsyncGenerator[StreamUpdate, None]:
    """One request through the cluster. The first update is empty: the request was admitted;
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
            update = StreamUpdate(prompt_logprobs=list(msg.prompt_logprobs))
            for delta in msg.outputs:
                text_delta = seqs[delta.index].add(delta)
                if text_delta is not None:
                    update.deltas.append(text_delta)
            finished = all(s.finish_reason is not None for s in seqs)
            if finished and not msg.HasField("usage"):  # stop strings found here ended the request
                await client.abort(request_id, [generation_pb2.SequenceEnd(
                    index=i, finish_reason="stop", num_tokens=s.num_tokens, stop_reason=str(s.stop_reason))
                    for i, s in enumerate(seqs) if s.ended_here])
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
