"""OpenAI request bodies -> validated engine inputs, and engine outputs -> OpenAI response bodies.

Unknown fields are ignored, as OpenAI's API does. vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, priority, cache_salt) are accepted too, and ``speculative: false`` switches
speculative decoding off for one request. Every problem raises BadRequest,
which the REST layer turns into a 400 with an OpenAI-style error body.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from metroserve.common.sampling_params import MAX_INT32, ParamError, SamplingParams
from metroserve.rpc import generation_pb2
from metroserve.services.text_stream import TextDelta, Usage

# Body field -> SamplingParams field, where they differ only in presence, not meaning.
_PASSTHROUGH = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "min_tokens", "ignore_eos", "stop", "stop_token_ids",
                "include_stop_str_in_output", "skip_special_tokens", "speculative")


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class GenerationRequest:
    """One REST request, parsed: prompts (token ids), sampling params and streaming options."""

    model: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    cache_salt: str | None
    chat: bool
    logprobs: bool  # return logprobs (chat: logprobs=true; completions: logprobs=N)


def _get(body: dict, name: str, types: type | tuple, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    allowed = types if isinstance(types, tuple) else (types,)
    # bool is an int subclass in Python, but JSON true is not a number.
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        names = " or ".join(t.__name__ for t in allowed)
        raise BadRequest(f"'{name}' must be of type {names}, got {type(value).__name__}", param=name)
    return value


def _sampling_params(body: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    kwargs = {name: body[name] for name in _PASSTHROUGH if body.get(name) is not None}
    if "logit_bias" in body and body["logit_bias"] is not None:
        kwargs["logit_bias"] = body["logit_bias"]
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
    except ParamError as e:
        raise BadRequest(str(e), param=e.param) from None


def _priority(body: dict) -> int:
    priority = _get(body, "priority", int, 0)
    if not -2**31 <= priority < 2**31:
        raise BadRequest("priority must be a 32-bit integer", param="priority")
    return priority


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    include_usage = _get(options, "include_usage", bool, False)
    return stream, include_usage


def parse_completion(body: dict, tokenizer) -> GenerationRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of those",
                         param="prompt")
    token_prompts = []
    for p in prompts:
        if isinstance(p, str):
            token_prompts.append(tokenizer.encode(p))
        elif all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32 for t in p):
            token_prompts.append(list(p))  # the model's vocabulary bound is checked at admission
        else:
            raise BadRequest("token id prompts must be lists of non-negative 32-bit integers", param="prompt")
    if body.get("echo"):
        raise BadRequest("echo is not supported", param="echo")
    if body.get("suffix"):
        raise BadRequest("suffix is not supported", param="suffix")
    logprobs = _get(body, "logprobs", int)
    max_tokens = _get(body, "max_tokens", int, 16)
    stream, include_usage = _stream_options(body)
    return GenerationRequest(
        model=_get(body, "model", str, ""), prompts=token_prompts, params=_sampling_params(body, max_tokens, logprobs),
        stream=stream, include_usage=include_usage, priority=_priority(body),
        cache_salt=_get(body, "cache_salt", str), chat=False, logprobs=logprobs is not None)


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    parsed = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones can be served here
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in content):
                raise BadRequest("only text content parts are supported", param="messages")
            content = "".join(part["text"] for part in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BadRequest("message 'content' must be a string or a list of text parts", param="messages")
        parsed.append({"role": m["role"], "content": content})
    return parsed


def parse_chat(body: dict, tokenizer) -> GenerationRequest:
    from metroserve.common.chat import chat_prompt_ids

    messages = parse_messages(body)
    try:
        prompt = chat_prompt_ids(tokenizer, messages, add_generation_prompt=True)
    except ValueError as e:
        raise BadRequest(str(e), param="messages") from None
    except Exception as e:  # the template itself raised (e.g. a role it does not allow)
        raise BadRequest(f"the chat template rejected these messages: {e}", param="messages") from None
    want_logprobs = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int)
    if top is not None and not want_logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    stream, include_usage = _stream_options(body)
    return GenerationRequest(
        model=_get(body, "model", str, ""), prompts=[prompt],
        params=_sampling_params(body, max_tokens, (top or 0) if want_logprobs else None),
        stream=stream, include_usage=include_usage, priority=_priority(body),
        cache_salt=_get(body, "cache_salt", str), chat=True, logprobs=want_logprobs)


# -- responses ---------------------------------------------------------------------------------


def usage_body(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def _top(entry: generation_pb2.TokenLogprobs, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens (the entry holds the chosen token plus the top n)."""
    return sorted(zip(entry.token_ids, entry.logprobs), key=lambda x: -x[1])[:n]


def logprobs_body(tokenizer, entries: list[generation_pb2.TokenLogprobs], chat: bool, top_n: int) -> dict:
    if chat:
        content = []
        for e in entries:
            tops = [{"token": (text := _token_text(tokenizer, t)), "logprob": lp, "bytes": list(text.encode())}
                    for t, lp in _top(e, top_n)]
            chosen = _token_text(tokenizer, e.token_ids[0])
            content.append({"token": chosen, "logprob": e.logprobs[0], "bytes": list(chosen.encode()),
                            "top_logprobs": tops})
        return {"content": content}
    return {
        "tokens": [_token_text(tokenizer, e.token_ids[0]) for e in entries],
        "token_logprobs": [e.logprobs[0] for e in entries],
        "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in _top(e, top_n)} for e in entries],
    }


@dataclass
class ResponseBuilder:
    """Turns per-choice text deltas into OpenAI chunks (streaming) or one body (not streaming)."""

    request_id: str
    model: str
    chat: bool
    logprobs: bool
    tokenizer: object
    top_logprobs: int = 0
    created: int = 0

    def __post_init__(self) -> None:
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, choice_index: int, delta: TextDelta, first: bool) -> dict:
        choice: dict = {"index": choice_index, "finish_reason": delta.finish_reason,
                        "logprobs": logprobs_body(self.tokenizer, delta.logprobs, self.chat, self.top_logprobs)
                        if self.logprobs and delta.logprobs else None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        else:
            choice["text"] = delta.text
        if delta.stop_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        return {**self._envelope(chunk=True), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._envelope(chunk=True), "choices": [], "usage": usage_body(usage)}

    def full(self, choices: dict[int, list[TextDelta]], usage: Usage) -> dict:
        out = []
        for index in sorted(choices):
            deltas = choices[index]
            text = "".join(d.text for d in deltas)
            finish = next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None)
            stop_reason = next((d.stop_reason for d in reversed(deltas) if d.stop_reason is not None), None)
            entries = [e for d in deltas for e in d.logprobs]
            logprobs = logprobs_body(self.tokenizer, entries, self.chat, self.top_logprobs) if self.logprobs else None
            choice: dict = {"index": index, "finish_reason": finish, "stop_reason": stop_reason, "logprobs": logprobs}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out.append(choice)
        return {**self._envelope(chunk=False), "choices": out, "usage": usage_body(usage)}
