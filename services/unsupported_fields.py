"""Request fields of OpenAI's or vLLM's API that metroserve does not implement: one table.

A field here is refused with a 400 naming it when it is present with a value that would change
the result; its inert values (false, the default, an empty list) pass, because clients often send
defaults explicitly. Fields no known client sends stay ignored, as OpenAI does; fields that are
informational by definition (``user``, ``metadata``) are accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Unsupported:
    reason: str
    inert: Callable[[object], bool] = lambda v: v in (False, [], {}, "")
    endpoints: tuple[str, ...] = ("chat", "completion")


def _equals(*values: object) -> Callable[[object], bool]:
    return lambda v: any(v == x and type(v) is type(x) for x in values)


_TOOLS = "the deprecated functions API is not supported; use tools and tool_choice"

UNSUPPORTED: dict[str, Unsupported] = {
    "use_beam_search": Unsupported("beam search is not implemented"),
    "best_of": Unsupported("best_of > 1 needs beam search or reranking, which are not implemented",
                           _equals(1)),
    "length_penalty": Unsupported("length_penalty only applies to beam search", _equals(1, 1.0)),
    "early_stopping": Unsupported("early_stopping only applies to beam search"),
    "logits_processors": Unsupported("custom logits processors are not supported"),
    "spaces_between_special_tokens": Unsupported("special tokens are always detokenized with spaces",
                                                 _equals(True)),
    "guided_whitespace_pattern": Unsupported("a custom whitespace pattern is not supported; "
                                             "structured_outputs.disable_any_whitespace chooses compact or free"),
    "functions": Unsupported(_TOOLS, endpoints=("chat",)),
    "function_call": Unsupported(_TOOLS, _equals("none"), endpoints=("chat",)),
    "echo": Unsupported("echo on chat completions is not supported (it is on /v1/completions)",
                        endpoints=("chat",)),
    "documents": Unsupported("retrieval documents in the chat template are not supported", endpoints=("chat",)),
    "mm_processor_kwargs": Unsupported("this server serves text-only models"),
    "prompt_embeds": Unsupported("prompt embeddings as input are not supported", endpoints=("completion",)),
    "kv_transfer_params": Unsupported("disaggregated prefill (KV transfer) is not supported"),
    "vllm_xargs": Unsupported("vLLM extension arguments are not supported"),
    "prediction": Unsupported("predicted outputs are not supported", endpoints=("chat",)),
    "audio": Unsupported("audio output is not supported", endpoints=("chat",)),
    "modalities": Unsupported("only text output is supported", lambda v: v in ([], ["text"]), endpoints=("chat",)),
    "web_search_options": Unsupported("web search is not supported", lambda v: False, endpoints=("chat",)),
    "reasoning_effort": Unsupported("this server runs no reasoning parser", endpoints=("chat",)),
    "store": Unsupported("stored completions are not supported", endpoints=("chat",)),
    "service_tier": Unsupported("there is one service tier", _equals("auto", "default")),
}


def unsupported_field(body: dict, endpoint: str) -> tuple[str, str] | None:
    """(field, why) for the first field of body this server would have to ignore, or None. O(fields)."""
    for name, rule in UNSUPPORTED.items():
        if endpoint in rule.endpoints and body.get(name) is not None and not rule.inert(body[name]):
            return name, rule.reason
    return None
