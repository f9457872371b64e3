"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass

from metroserve.worker.sequence import Request, RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per token: {token id: logprob} (chosen + top-N)
    finish_reason: str | None  # None while running, then "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics
    # With params.prompt_logprobs: per prompt token {token id: logprob}, the first None. In delta
    # mode only in the first output after the prefill, else None.
    prompt_logprobs: list[dict[int, float] | None] | None = None


def make_request_output(request: Request, delta: bool = False) -> RequestOutput:
    """Snapshot of a request. delta=True: only tokens and text not handed out before (for streaming)."""
    completions = []
    for seq in request.seqs:
        finished = seq.finished
        tokens = seq.token_ids
        text = seq.detokenizer.text[: seq.detokenizer.emittable(finished)] if seq.detokenizer else ""
        logprobs = seq.logprobs
        if delta:
            new_tokens = tokens[seq.num_prompt_tokens + seq.num_emitted_tokens :]
            if logprobs is not None:
                logprobs = logprobs[seq.num_emitted_tokens :]
            seq.num_emitted_tokens = seq.num_output_tokens
            tokens = new_tokens
            new_text = text[seq.num_emitted_chars :]
            seq.num_emitted_chars = len(text)
            text = new_text
        else:
            tokens = tokens[seq.num_prompt_tokens :]
            logprobs = list(logprobs) if logprobs is not None else None
        completions.append(CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=tokens,
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        ))
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is not None and (request.needs_prompt_logprobs or delta and request.prompt_logprobs_emitted):
        prompt_logprobs = None
    elif prompt_logprobs is not None and delta:
        request.prompt_logprobs_emitted = True
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=completions,
        finished=request.finished,
        num_cached_tokens=request.num_cached_tokens,
        metrics=request.metrics,
        prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
    )
