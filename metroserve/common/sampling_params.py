"""SamplingParams: what a request asks of the sampler, validated in one place.

Torch-free on purpose: the gateway imports it to reject bad requests at the edge with the same
rules the engine applies. Field names and defaults follow vLLM's ``SamplingParams`` so users'
code carries over. Checks that need the model (vocabulary size, context length) live in
``metroserve.common.request_limits.check_request``. Both raise ParamError naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NoReturn, TypeGuard

from metroserve.common.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 16
# Every stop string is searched for after every token (common/detokenizer.py), so their number and
# length bound a request's per-token cost. OpenAI allows 4; these leave room for vLLM users' lists.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it samples greedily
# The gateway's default bound on one request's sequences (prompts x n), --max-sequences-per-request:
# a batch is admitted or refused as a whole, so one the cluster could never hold is refused up front.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 1024
# Token ids and counts travel as int32 on the wire, seeds as int64.
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1


class ParamError(ValueError):
    """A request parameter is invalid; ``param`` names the field (OpenAI error bodies carry it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N alternatives per generated token, besides the chosen one
    # Logprobs of the prompt's own tokens (and top-N alternatives), from the prefill's logits; the
    # first prompt token has none. Such a prompt is computed in full, never read from the prefix cache.
    prompt_logprobs: int | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Token sequences never to generate (vLLM's bad_words, tokenized by the caller): a one-token
    # word is banned outright, a longer one's last token is banned right after the rest of it.
    bad_words_token_ids: list[list[int]] | None = None
    # The output must match this (JSON schema, regex, choice, grammar): a token mask at every step.
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    # False: never speculate for this request (when the engine runs with --speculative-config).
    speculative: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check()
        if isinstance(self.stop, str):
            self.stop_strings = (self.stop,)
        else:
            self.stop_strings = tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids or ()]

    @property
    def greedy(self) -> bool:
        """Temperatures below SAMPLING_EPS are greedy, as in vLLM: dividing logits by a tiny one
        overflows them to infinities, and their softmax is NaN (1e-300 picked token 0)."""
        return self.temperature < SAMPLING_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def _check(self) -> None:
        def fail(param: str, msg: str) -> NoReturn:
            raise ParamError(param, msg)

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            fail("n", f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            fail("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT32:
            fail("top_k", f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                fail(name, f"{name} must be in [-2, 2], got {value!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -MAX_INT64 - 1 <= self.seed <= MAX_INT64):
            fail("seed", f"seed must be a 64-bit integer, got {self.seed!r}")
        # max_tokens 0: the prompt alone is scored (prompt_logprobs), nothing is generated.
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 0 <= self.max_tokens <= MAX_INT32):
            fail("max_tokens", f"max_tokens must be at least 0, got {self.max_tokens!r}")
        if self.max_tokens == 0 and self.n != 1:
            fail("n", "n must be 1 when max_tokens is 0 (every sample would be the same empty output)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_INT32:
            fail("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            fail("prompt_logprobs",
                 f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
            or not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.allowed_token_ids)
        ):
            fail("allowed_token_ids",
                 f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
        if self.bad_words_token_ids is not None and (
            not isinstance(self.bad_words_token_ids, (list, tuple))
            or not all(isinstance(w, (list, tuple)) and w and all(_is_int(t) and 0 <= t <= MAX_INT32 for t in w)
                       for w in self.bad_words_token_ids)
        ):
            fail("bad_words", "bad words must be non-empty token id lists")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                fail("structured_outputs", "structured_outputs must be a StructuredOutputsParams")
            # These ban tokens the grammar may need (its end, or its only continuation).
            for name, param in (("min_tokens", "min_tokens"), ("allowed_token_ids", "allowed_token_ids"),
                                ("bad_words_token_ids", "bad_words")):
                if getattr(self, name):
                    fail(param, f"{param} cannot be combined with structured outputs: the grammar decides which "
                         "tokens may come next")
        if not isinstance(self.speculative, bool):
            fail("speculative", f"speculative must be true or false, got {self.speculative!r}")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None:
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
                fail("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
            if any(s == "" for s in stops):
                fail("stop", "stop strings must not be empty")
            if len(stops) > MAX_STOP_STRINGS:
                fail("stop", f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
            if max(map(len, stops), default=0) > MAX_STOP_STRING_CHARS:
                fail("stop", f"a stop string may be at most {MAX_STOP_STRING_CHARS} characters long")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, (list, tuple))
            or not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids)
        ):
            fail("stop_token_ids",
                 f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                token_id = _as_int(token)
                if not _is_int(token_id) or not 0 <= token_id <= MAX_INT32 or not _is_number(bias):
                    fail("logit_bias", f"logit_bias entries must be token id -> number, got {token!r}: {bias!r}")
                if not -100 <= bias <= 100:
                    fail("logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[float]:
    """A finite int or float (JSON parsers accept NaN and Infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _as_int(token: object) -> object:
    """JSON object keys arrive as strings; accept "123" as token 123."""
    if isinstance(token, str) and token.isascii() and token.isdigit():  # not "²", which int() refuses
        return int(token)
    return token
