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
    # C-level passes (map, set, min, max): this runs for every request the scheduler admits.
    if set(map(type, prompt_token_ids)) != {int} or min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise ParamError("prompt", f"prompt token ids must be integers in [0, {vocab})")
    if n >= limits.max_model_len:
        raise ParamError("prompt", f"prompt has {n} tokens but the maximum context length is "
                         f"{limits.max_model_len} (prompt plus at least one generated token)")
    if params.max_tokens is not None and n + params.max_tokens > limits.max_model_len:
        raise ParamError("max_tokens", f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum "
                         f"context length {limits.max_model_len}")
    bad_ids = [t for t in _param_token_ids(params) if t >= vocab]
    if bad_ids:
        field = next(name for name, ids in _named_token_ids(params) if any(t >= vocab for t in ids))
        raise ParamError(field, f"token ids {bad_ids[:5]} in {field} are outside the vocabulary (size {vocab})")
    if params.n > limits.max_num_seqs:
        raise ParamError("n", f"n={params.n} exceeds max_num_seqs={limits.max_num_seqs}")
    longest, blocks = _kv_need(n, params, limits)
    if blocks > limits.num_blocks:
        raise ParamError("max_tokens", f"a sequence of up to {longest} tokens needs {blocks} KV blocks but the pool "
                         f"has {limits.num_blocks}; lower max_tokens or raise --kv-cache-memory")


def max_token_id(prompt_token_ids: list[int], params: SamplingParams) -> int:
    """The largest token id a request names (prompt, and the token-id fields): what fits() needs
    of the vocabulary, computed once at admission."""
    return max([*prompt_token_ids, *_param_token_ids(params)], default=0)


def fits(limits: RequestLimits, num_prompt_tokens: int, largest_token_id: int, params: SamplingParams) -> bool:
    """Whether a request that check_request admitted somewhere fits an engine with these limits,
    with no per-token work, so placement can run it for every candidate worker. A worker trusts
    what it is assigned, so this covers everything check_request does but the sequence count,
    which the caller checks against free slots."""
    longest, blocks = _kv_need(num_prompt_tokens, params, limits)
    return (largest_token_id < limits.vocab_size and num_prompt_tokens < limits.max_model_len
            and longest <= limits.max_model_len and blocks <= limits.num_blocks)


def _named_token_ids(params: SamplingParams) -> list[tuple[str, list[int]]]:
    """(request field, the token ids it names); SamplingParams normalises None to empty."""
    return [("stop_token_ids", list(params.stop_token_ids or ())), ("logit_bias", list(params.logit_bias or {})),
            ("allowed_token_ids", list(params.allowed_token_ids or ())),
            ("bad_words", [t for word in params.bad_words_token_ids or () for t in word])]


def _param_token_ids(params: SamplingParams) -> list[int]:
    return [t for _, ids in _named_token_ids(params) for t in ids]


def _kv_need(num_prompt_tokens: int, params: SamplingParams, limits: RequestLimits) -> tuple[int, int]:
    """(the longest the sequence may grow, the KV blocks that takes): up to max_tokens, or the context."""
    longest = limits.max_model_len if params.max_tokens is None else num_prompt_tokens + params.max_tokens
    return longest, -(-longest // limits.block_size)
