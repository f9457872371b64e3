"""What one engine accepts, and the check of a request against it: one implementation.

Torch-free: the engine runs it before queueing a request, and the scheduler runs the same check
against the limits each worker registered with, so a bad request is refused at admission
(INVALID_ARGUMENT / HTTP 400) instead of failing later on a worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from metroserve.common.sampling_params import ParamError, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_blocks: int


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Raise ParamError naming the problem and its field; nothing about a bad request reaches a batch."""
    n = len(prompt_token_ids)
    vocab = limits.vocab_size
    if n == 0:
        raise ParamError("prompt", "prompt is empty")
    if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
        raise ParamError("prompt", f"prompt token ids must be integers in [0, {vocab})")
    if n >= limits.max_model_len:
        raise ParamError("prompt", f"prompt has {n} tokens but the maximum context length is "
                         f"{limits.max_model_len} (prompt plus at least one generated token)")
    if params.max_tokens is not None and n + params.max_tokens > limits.max_model_len:
        raise ParamError("max_tokens", f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum "
                         f"context length {limits.max_model_len}")
    stop_ids = params.stop_token_ids or []  # SamplingParams normalises None to empty
    bad_ids = [t for t in stop_ids + list(params.logit_bias or {}) if t >= vocab]
    if bad_ids:
        field = "stop_token_ids" if any(t >= vocab for t in stop_ids) else "logit_bias"
        raise ParamError(field, f"token ids {bad_ids[:5]} in stop_token_ids/logit_bias are outside the vocabulary "
                         f"(size {vocab})")
    if params.n > limits.max_num_seqs:
        raise ParamError("n", f"n={params.n} exceeds max_num_seqs={limits.max_num_seqs}")
    longest = n + (params.max_tokens if params.max_tokens is not None else limits.max_model_len - n)
    blocks = -(-longest // limits.block_size)
    if blocks > limits.num_blocks:
        raise ParamError("max_tokens", f"a sequence of up to {longest} tokens needs {blocks} KV blocks but the pool "
                         f"has {limits.num_blocks}; lower max_tokens or raise --kv-cache-memory")


def fits(limits: RequestLimits, num_prompt_tokens: int, params: SamplingParams) -> bool:
    """Whether a request that check_request admitted somewhere fits an engine with these limits: the
    size checks only (context length, KV blocks), no per-token work, so placement can run it for
    every candidate worker. The sequence count is the caller's to check against free slots."""
    if num_prompt_tokens >= limits.max_model_len:
        return False
    longest = limits.max_model_len if params.max_tokens is None else num_prompt_tokens + params.max_tokens
    return longest <= limits.max_model_len and -(-longest // limits.block_size) <= limits.num_blocks
