"""Request sets for `metroserve bench serve`: random-token prompts, shared prefixes, chat JSONL.

Random and shared-prefix prompts are text decoded from random token ids of a tokenizer, so their
lengths are set in tokens while the server still receives text (as a real client sends it). Decoding
and re-encoding can merge or split tokens, so each text is re-encoded and adjusted until it has the
asked length (or close to it after a few tries); the length reached is kept with the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_ADJUST_TRIES = 10


@dataclass
class BenchRequest:
    """One request of a run: text for /v1/completions or messages for /v1/chat/completions."""

    prompt: str | list[dict[str, Any]]
    max_tokens: int
    prompt_len: int | None = None  # tokens by the bench's tokenizer; None when not tokenized here

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)


def usable_token_ids(tokenizer: Any) -> np.ndarray:
    """Every id of the vocabulary except special and added tokens, which a real text never spells."""
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return np.array([i for i in range(len(tokenizer)) if i not in excluded], dtype=np.int64)


def sample_lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """n integer lengths uniform in [mean*(1-r), mean*(1+r)], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if mean < 1:
        raise ValueError(f"lengths must be at least 1, got {mean}")
    low, high = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def text_of_length(tokenizer: Any, num_tokens: int, vocab: np.ndarray, rng: np.random.Generator) -> tuple[str, int]:
    """Text that re-encodes to `num_tokens` tokens (usually exactly) and its actual token count."""
    ids = [int(i) for i in rng.choice(vocab, size=num_tokens)]
    for _ in range(_ADJUST_TRIES):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text, add_special_tokens=False)
        if len(again) == num_tokens:
            break
        # Too long: cut; too short: pad with fresh random ids; then decode and check again.
        ids = again[:num_tokens] + [int(i) for i in rng.choice(vocab, size=max(0, num_tokens - len(again)))]
    return text, len(again)


def random_requests(tokenizer: Any, num_requests: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[BenchRequest]:
    """Prompts of random tokens; input and output lengths uniform within +-range_ratio of the given ones."""
    rng = np.random.default_rng(seed)
    vocab = usable_token_ids(tokenizer)
    inputs = sample_lengths(input_len, range_ratio, num_requests, rng)
    outputs = sample_lengths(output_len, range_ratio, num_requests, rng)
    requests = []
    for n_in, n_out in zip(inputs, outputs):
        text, actual = text_of_length(tokenizer, n_in, vocab, rng)
        requests.append(BenchRequest(text, n_out, actual))
    return requests


def shared_prefix_requests(tokenizer: Any, num_prefixes: int, suffixes_per_prefix: int, prefix_len: int,
                           suffix_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """num_prefixes x suffixes_per_prefix prompts, prefix_i + suffix_ij, in seeded-shuffled order.

    Shuffled so that requests of one prefix arrive among other prefixes' requests, as when many
    users share a few system prompts; grouped order would make the cache's job trivial.
    """
    if num_prefixes < 1 or suffixes_per_prefix < 1:
        raise ValueError("--num-prefixes and --suffixes-per-prefix must be at least 1")
    rng = np.random.default_rng(seed)
    vocab = usable_token_ids(tokenizer)
    requests = []
    for _ in range(num_prefixes):
        prefix, _ = text_of_length(tokenizer, prefix_len, vocab, rng)
        for _ in range(suffixes_per_prefix):
            suffix, _ = text_of_length(tokenizer, suffix_len, vocab, rng)
            prompt = prefix + suffix
            requests.append(BenchRequest(prompt, output_len, len(tokenizer.encode(prompt, add_special_tokens=False))))
    return [requests[i] for i in rng.permutation(len(requests))]


def chat_jsonl_requests(path: Path, num_requests: int | None, output_len: int) -> list[BenchRequest]:
    """The first num_requests lines of a JSONL file: {"messages": [...]} or {"prompt": "..."}, optional "max_tokens"."""
    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if num_requests is not None and len(requests) >= num_requests:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON: {e}") from None
            if isinstance(row.get("messages"), list):
                messages = row["messages"]
            elif isinstance(row.get("prompt"), str):
                messages = [{"role": "user", "content": row["prompt"]}]
            else:
                raise ValueError(f'{path}:{line_no}: expected "messages" (a list) or "prompt" (a string)')
            requests.append(BenchRequest(messages, int(row.get("max_tokens", output_len))))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests
