"""SpeculativeConfig: what ``--speculative-config`` accepts, checked in one place."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Field names follow vLLM's speculative config where one exists.

    The fallback thresholds keep speculation from costing time where it cannot pay: with more
    running sequences than ``disable_by_batch_size`` a step is no longer bound by reading the
    weights (on a 2-core CPU the matmuls are compute-bound from about 30 tokens a step), so extra
    draft tokens cost nearly their full price; and a sequence whose recent acceptance rate falls
    below ``min_acceptance_rate`` stops drafting for ``pause_steps`` steps, then tries again.
    """

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram to look up
    prompt_lookup_min: int = 2  # ngram: shortest
    model: str | None = None  # draft_model: HF-format directory or .gguf, same tokenizer as the target
    draft_dtype: str | None = None  # draft_model: its weights' and KV pool's dtype (default: the target's)
    disable_by_batch_size: int = 4
    min_acceptance_rate: float = 0.2
    pause_steps: int = 16

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"speculative config: {msg}")

        if self.method not in METHODS:
            fail(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.pause_steps, int) or self.pause_steps < 0:
            fail(f"pause_steps must be an integer >= 0, got {self.pause_steps!r}")
        if self.num_speculative_tokens > 16:
            fail(f"num_speculative_tokens must be at most 16, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            fail(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                 f"({self.prompt_lookup_max})")
        if not isinstance(self.min_acceptance_rate, (int, float)) or not 0 <= self.min_acceptance_rate <= 1:
            fail(f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate!r}")
        if self.method == "draft_model" and not self.model:
            fail('method "draft_model" needs "model": the draft model\'s directory or .gguf file')
        if self.method == "ngram" and (self.model or self.draft_dtype):
            fail('"model" and "draft_dtype" are only used by method "draft_model"')
        if self.draft_dtype not in (None, "float32", "bfloat16", "float16"):
            fail(f"draft_dtype must be float32, bfloat16 or float16, got {self.draft_dtype!r}")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the CLI's JSON string, a dict, or an existing config; None or "" means off."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if "method" not in value:
            raise ValueError(f'speculative config needs "method" ({" or ".join(METHODS)})')
        return cls(**value)
