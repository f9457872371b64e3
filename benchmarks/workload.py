"""Deterministic, offline chat workloads for the benchmarks.

Prompts ask about passages of Python standard-library module docstrings. The docstrings are read
with ``ast`` from the stdlib source files, so no module is imported (``antigravity`` and ``this``
have side effects) and the text depends only on the installed Python.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import random
import sys
from typing import Any

# Asked after the passage, rotated by request; the passage comes first so that prompts share no
# prefix beyond the chat template's own system prompt.
TASKS = (
    "Summarise this documentation in a few sentences.",
    "What are the main classes or functions described above? Answer briefly.",
    "Explain to a beginner what this module is for, based only on the text above.",
    "List three facts stated in the passage above.",
    "Which parts of the passage above would a new user find most confusing, and why?",
    "Write one question a reader could answer from the passage above, then answer it.",
)
_MIN_DOC_CHARS = 200
_MIN_PASSAGE_TOKENS = 8


def stdlib_docstrings() -> list[tuple[str, str]]:
    """(module name, docstring) for public pure-Python stdlib modules with a substantial docstring, sorted."""
    docs = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_"):
            continue
        try:
            spec = importlib.util.find_spec(name)  # locates a top-level module without running it
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read()))
        if doc and len(doc) >= _MIN_DOC_CHARS:
            docs.append((name, doc))
    return docs


def target_lengths(num_requests: int, min_len: int, max_len: int, rng: random.Random) -> list[int]:
    """Prompt lengths spread log-uniformly over [min_len, max_len] (one per stratum), shuffled."""
    span = math.log(max_len / min_len)
    lengths = [round(min_len * math.exp(span * (i + rng.random()) / num_requests)) for i in range(num_requests)]
    rng.shuffle(lengths)
    return lengths


def _render(tokenizer: Any, content: str) -> list[int]:
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def build_chat_workload(tokenizer: Any, num_requests: int = 64, seed: int = 0, min_len: int = 64,
                        max_len: int = 1000) -> list[list[int]]:
    """Token ids of `num_requests` chat prompts with lengths from about `min_len` to `max_len` tokens.

    Request i asks a rotating task about a passage that starts at a seeded-random stdlib module's
    docstring (continuing into the following modules' when one is too short), cut to the tokens
    its target length leaves after the template. Same tokenizer and seed: same prompts.
    """
    if not 0 < min_len <= max_len:
        raise ValueError(f"need 0 < min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    docs = stdlib_docstrings()
    doc_ids = [tokenizer.encode(doc, add_special_tokens=False) for _, doc in docs]
    starts = rng.sample(range(len(docs)), len(docs))
    prompts = []
    for i, target in enumerate(target_lengths(num_requests, min_len, max_len, rng)):
        start = starts[i % len(starts)]
        name, task = docs[start][0], TASKS[i % len(TASKS)]
        header = f"{name} module (Python standard library) documentation:\n\n"
        budget = max(_MIN_PASSAGE_TOKENS, target - len(_render(tokenizer, f"{header}\n\n{task}")))
        passage: list[int] = []
        for j in range(len(docs)):
            passage += doc_ids[(start + j) % len(docs)] + tokenizer.encode("\n\n", add_special_tokens=False)
            if len(passage) >= budget:
                break
        text = tokenizer.decode(passage[:budget]).strip()
        prompts.append(_render(tokenizer, f"{header}{text}\n\n{task}"))
    return prompts
