"""What one engine accepts, and the check of a request against it: one implementation.

Torch-free: the engine runs it before queueing a request, and the scheduler runs the same check
against the limits each worker registered with, so a bad request is refused at admission
(INVALID_ARGUMENT / HTTP 400) instead of failing later on a worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from metroserve.common.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_blocks: int


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Raise ValueError naming the problem; nothing about a bad request reaches a batch."""
    n = len(prompt_token_ids)
    vocab = limits.vocab_size
    if n == 0:
        raise ValueError("prompt is empty")
    if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    if n >= limits.max_model_len:
        raise ValueError(f"prompt has {n} tokens but the maximum context length is {limits.max_model_len} "
                         "(prompt plus at least one generated token)")
    if params.max_tokens is not None and n + params.max_tokens > limits.max_model_len:
        raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum "
                         f"context length {limits.max_model_len}")
    bad_ids = [t for t in list(params.stop_token_ids) + list(params.logit_bias) if t >= vocab]
    if bad_ids:
        raise ValueError(f"token ids {bad_ids[:5]} in stop_token_ids/logit_bias are outside the vocabulary (size {vocab})")
    if params.n > limits.max_num_seqs:
        raise ValueError(f"n={params.n} exceeds max_num_seqs={limits.max_num_seqs}")
    longest = n + (params.max_tokens if params.max_tokens is not None else limits.max_model_len - n)
    blocks = -(-longest // limits.block_size)
    if blocks > limits.num_blocks:
        raise ValueError(f"a sequence of up to {longest} tokens needs {blocks} KV blocks but the pool has "
                         f"{limits.num_blocks}; lower max_tokens or raise --kv-cache-memory")
