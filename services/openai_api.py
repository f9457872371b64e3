"""OpenAI request bodies -> validated engine inputs, and engine outputs -> OpenAI response bodies.

vLLM's extra fields are accepted too: sampling (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens, allowed_token_ids,
bad_words), prompt handling (truncate_prompt_tokens, add_special_tokens, prompt_logprobs; on chat
add_generation_prompt, continue_final_message, chat_template_kwargs), output (return_token_ids,
return_tokens_as_token_ids, stream_options.continuous_usage_stats), priority, cache_salt, and
``speculative: false`` switches speculative decoding off for one request. /v1/completions
implements ``echo`` (the prompt's text and, with logprobs, its tokens' logprobs, the first null)
and ``max_tokens: 0`` (score the prompt, generate nothing). Fields the server cannot honour are
refused (services/unsupported_fields.py); unknown ones are ignored, as OpenAI's API does. Every
problem raises BadRequest, which the REST layer turns into a 400 with an OpenAI-style error body.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from metroserve.common.sampling_params import MAX_INT32, ParamError, SamplingParams
from metroserve.common.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from metroserve.rpc import generation_pb2
from metroserve.services.text_stream import TextDelta, Usage
from metroserve.services.tool_calls import ToolRequest, ToolRequestError, parse_tool_request
from metroserve.services.unsupported_fields import unsupported_field

# Body field -> SamplingParams field, where they differ only in presence, not meaning.
_PASSTHROUGH = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "min_tokens", "ignore_eos", "stop", "stop_token_ids",
                "include_stop_str_in_output", "skip_special_tokens", "speculative", "allowed_token_ids",
                "prompt_logprobs")


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class OutputOptions:
    """How the response renders what the engine produced (none of it changes generation)."""

    chat: bool
    logprobs: bool  # return logprobs (chat: logprobs=true; completions: logprobs=N)
    top_logprobs: int = 0
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    prompt_logprobs: bool = False  # vLLM's per-choice prompt_logprobs list
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (return_tokens_as_token_ids)
    continuous_usage: bool = False  # every streamed chunk carries usage so far
    tools: ToolRequest | None = None  # chat: the output may be tool calls (services/tool_calls.py)


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
    output: OutputOptions
    prompt_texts: list[str] = field(default_factory=list)  # what echo returns, per prompt
    constraint_field: str | None = None  # the body field that gave params.structured_outputs

    @property
    def chat(self) -> bool:
        return self.output.chat


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


def _refuse_unsupported(body: dict, endpoint: str) -> None:
    found = unsupported_field(body, endpoint)
    if found is not None:
        name, reason = found
        raise BadRequest(f"'{name}' is not supported by this server: {reason}", param=name, code="unsupported_field")


def _bad_words(body: dict, tokenizer) -> list[list[int]] | None:
    """vLLM's bad_words: each word as written and, unless it starts with a space, with one before it
    (the form it takes mid-sentence), as token sequences."""
    words = _get(body, "bad_words", list)
    if words is None:
        return None
    if not all(isinstance(w, str) and w.strip() for w in words):
        raise BadRequest("'bad_words' must be a list of non-empty strings", param="bad_words")
    sequences = []
    for word in words:
        for form in (word,) if word.startswith(" ") else (word, " " + word):
            ids = tokenizer.encode(form, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                    "disable_additional_properties")


def _schema_text(schema: object) -> str:
    """A JSON schema given as an object or as JSON text -> JSON text; StructuredOutputsParams checks
    the text (valid JSON, an object, within the nesting bounds) for this edge and gRPC's alike."""
    return schema if isinstance(schema, str) else json.dumps(schema)


def _from_response_format(fmt: object) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                         param="response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise BadRequest("'response_format.json_schema' must be an object with a 'schema'", param="response_format")
    return StructuredOutputsParams(json=_schema_text(spec["schema"]),
                                   strict=bool(spec.get("strict", True)))


def _from_structured_outputs(spec: object) -> StructuredOutputsParams:
    if not isinstance(spec, dict) or set(spec) - set(_STRUCTURED_KEYS):
        raise BadRequest(f"'structured_outputs' must be an object with keys among {', '.join(_STRUCTURED_KEYS)}",
                         param="structured_outputs")
    kwargs: dict = {k: spec[k] for k in ("regex", "grammar") if spec.get(k) is not None}
    if spec.get("json") is not None:
        kwargs["json"] = _schema_text(spec["json"])
    if spec.get("choice") is not None:
        if not isinstance(spec["choice"], list):
            raise BadRequest("'structured_outputs.choice' must be a list of strings", param="structured_outputs")
        kwargs["choice"] = tuple(spec["choice"])
    if spec.get("disable_any_whitespace") is not None:
        kwargs["any_whitespace"] = not spec["disable_any_whitespace"]
    return StructuredOutputsParams(json_object=bool(spec.get("json_object")),
                                   strict=spec.get("disable_additional_properties", True) is not False, **kwargs)


def structured_outputs(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the field that gave it) from response_format, structured_outputs or vLLM's
    older guided_* fields; at most one of them."""
    given = [name for name in ("response_format", "structured_outputs", *_GUIDED) if body.get(name) is not None]
    if not given:
        return None, None
    if len(given) > 1:
        raise BadRequest(f"give one of {', '.join(given)}, not several", param=given[1])
    name = given[0]
    backend = body.get("guided_decoding_backend")
    if backend not in (None, "auto", "xgrammar"):
        raise BadRequest("this server's only guided decoding backend is xgrammar", param="guided_decoding_backend")
    try:
        if name == "response_format":
            return _from_response_format(body[name]), name
        if name == "structured_outputs":
            return _from_structured_outputs(body[name]), name
        value = body[name]
        if name == "guided_json":
            value = _schema_text(value)
        elif name == "guided_choice":
            if not isinstance(value, list):
                raise BadRequest("'guided_choice' must be a list of strings", param=name)
            value = tuple(value)
        return StructuredOutputsParams(**{_GUIDED[name]: value}), name
    except StructuredOutputsError as e:
        raise BadRequest(f"'{name}': {e}", param=name) from None


def _sampling_params(body: dict, tokenizer, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None, constraint: StructuredOutputsParams | None) -> SamplingParams:
    kwargs = {name: body[name] for name in _PASSTHROUGH if body.get(name) is not None}
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    if "logit_bias" in body and body["logit_bias"] is not None:
        kwargs["logit_bias"] = body["logit_bias"]
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, bad_words_token_ids=_bad_words(body, tokenizer),
                              structured_outputs=constraint, **kwargs)
    except ParamError as e:
        raise BadRequest(str(e), param=e.param) from None


def _priority(body: dict) -> int:
    priority = _get(body, "priority", int, 0)
    if not -2**31 <= priority < 2**31:
        raise BadRequest("priority must be a 32-bit integer", param="priority")
    return priority


def _stream_options(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats); stream_options without stream is an error, as
    in OpenAI's API."""
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict)
    if options is not None and not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    options = options or {}
    return (stream, _get(options, "include_usage", bool, False),
            _get(options, "continuous_usage_stats", bool, False))


def _truncate(prompt: list[int], body: dict, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: the context length)."""
    k = _get(body, "truncate_prompt_tokens", int)
    if k is None:
        return prompt
    if k == -1:
        k = max_model_len
    if k < 1:
        raise BadRequest("'truncate_prompt_tokens' must be -1 or at least 1", param="truncate_prompt_tokens")
    return prompt[-k:]


def check_batch_size(body: dict, max_sequences: int) -> None:
    """Refuse a request of more than `max_sequences` sequences (prompts x n) with a 400 naming the
    field, before anything walks its prompts (the schema check alone takes seconds on 100,000).
    O(1): it reads the prompt list's length, not its items."""
    prompt = body.get("prompt")
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    if num_prompts > max_sequences:
        raise BadRequest(f"'prompt' holds {num_prompts} prompts; a request may hold at most {max_sequences} "
                         f"(--max-sequences-per-request)", param="prompt", code="too_many_prompts")
    n = body.get("n", 1)
    if isinstance(n, int) and not isinstance(n, bool) and num_prompts * n > max_sequences:
        raise BadRequest(f"{num_prompts} prompt(s) x n={n} asks for {num_prompts * n} sequences; a request may ask "
                         f"for at most {max_sequences} (--max-sequences-per-request)", param="n",
                         code="too_many_sequences")


def _completion_prompts(body: dict) -> list:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of those",
                     param="prompt")


def _output_options(body: dict, chat: bool, logprobs: bool, top: int) -> OutputOptions:
    _, _, continuous = _stream_options(body)
    return OutputOptions(chat=chat, logprobs=logprobs, top_logprobs=top,
                         prompt_logprobs=_get(body, "prompt_logprobs", int) is not None,
                         return_token_ids=_get(body, "return_token_ids", bool, False),
                         tokens_as_ids=_get(body, "return_tokens_as_token_ids", bool, False),
                         continuous_usage=continuous)


def parse_completion(body: dict, tokenizer, max_model_len: int) -> GenerationRequest:
    _refuse_unsupported(body, "completion")
    add_special = _get(body, "add_special_tokens", bool, True)
    token_prompts = []
    for p in _completion_prompts(body):
        if isinstance(p, str):
            token_prompts.append(tokenizer.encode(p, add_special_tokens=add_special))
        elif all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32 for t in p):
            token_prompts.append(list(p))  # the model's vocabulary bound is checked at admission
        else:
            raise BadRequest("token id prompts must be lists of non-negative 32-bit integers", param="prompt")
    token_prompts = [_truncate(p, body, max_model_len) for p in token_prompts]
    if body.get("suffix"):
        raise BadRequest("suffix is not supported", param="suffix")
    echo = _get(body, "echo", bool, False)
    logprobs = _get(body, "logprobs", int)
    prompt_logprobs = _get(body, "prompt_logprobs", int)
    if echo and logprobs is not None:  # the echoed prompt's tokens come with their logprobs
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    max_tokens = _get(body, "max_tokens", int, 16)
    stream, include_usage, _ = _stream_options(body)
    output = _output_options(body, False, logprobs is not None, logprobs or 0)
    output.echo = echo
    constraint, constraint_field = structured_outputs(body)
    return GenerationRequest(
        model=_get(body, "model", str, ""), prompts=token_prompts,
        params=_sampling_params(body, tokenizer, max_tokens, logprobs, prompt_logprobs, constraint),
        constraint_field=constraint_field,
        stream=stream, include_usage=include_usage, priority=_priority(body),
        cache_salt=_get(body, "cache_salt", str), output=output,
        prompt_texts=[tokenizer.decode(p) for p in token_prompts] if echo else [])


# Message fields the chat template sees besides role and content (tool calls and their results).
_MESSAGE_EXTRAS = ("name", "tool_calls", "tool_call_id")


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
        message = {"role": m["role"], "content": content}
        message.update({k: m[k] for k in _MESSAGE_EXTRAS if m.get(k) is not None})
        parsed.append(message)
    return parsed


def parse_chat(body: dict, tokenizer, max_model_len: int, tool_call_parser: str | None = None) -> GenerationRequest:
    from metroserve.common.chat import ChatTemplateOptions, chat_prompt_ids

    _refuse_unsupported(body, "chat")
    messages = parse_messages(body)
    try:
        tools = parse_tool_request(body, tool_call_parser)
    except ToolRequestError as e:
        raise BadRequest(str(e), param=e.param) from None
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    options = ChatTemplateOptions(
        add_generation_prompt=_get(body, "add_generation_prompt", bool, True),
        continue_final_message=_get(body, "continue_final_message", bool, False),
        add_special_tokens=_get(body, "add_special_tokens", bool, False),
        chat_template=_get(body, "chat_template", str), template_kwargs=kwargs,
        tools=tools.template_tools if tools is not None else None)
    if options.add_generation_prompt and options.continue_final_message:
        raise BadRequest("'continue_final_message' needs 'add_generation_prompt': false",
                         param="continue_final_message")
    try:
        prompt = chat_prompt_ids(tokenizer, messages, options)
    except ValueError as e:
        raise BadRequest(str(e), param="messages") from None
    except Exception as e:  # the template itself raised (e.g. a role it does not allow)
        raise BadRequest(f"the chat template rejected these messages: {e}", param="messages") from None
    prompt = _truncate(prompt, body, max_model_len)
    want_logprobs = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int)
    if top is not None and not want_logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    stream, include_usage, _ = _stream_options(body)
    constraint, constraint_field = structured_outputs(body)
    if tools is not None and (forced := tools.constraint()) is not None:
        if constraint is not None:
            raise BadRequest(f"tool_choice '{tools.mode}' constrains the output itself: drop '{constraint_field}'",
                             param=constraint_field)
        constraint, constraint_field = forced, "tools"
    output = _output_options(body, True, want_logprobs, top or 0)
    output.tools = tools
    return GenerationRequest(
        model=_get(body, "model", str, ""), prompts=[prompt],
        params=_sampling_params(body, tokenizer, max_tokens, (top or 0) if want_logprobs else None,
                                _get(body, "prompt_logprobs", int), constraint),
        constraint_field=constraint_field,
        stream=stream, include_usage=include_usage, priority=_priority(body),
        cache_salt=_get(body, "cache_salt", str), output=output)


# -- responses ---------------------------------------------------------------------------------


def usage_body(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


# What a token the sampler could not pick (masked by a grammar, allowed_token_ids or bad_words)
# shows as: JSON has no -Infinity, and vLLM writes -9999.0.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


@dataclass
class LogprobsRenderer:
    """TokenLogprobs entries (chosen token first, then alternatives) -> OpenAI's logprobs shapes,
    every logprob at least MIN_LOGPROB."""

    tokenizer: object
    top_n: int
    tokens_as_ids: bool

    def text(self, token: int) -> str:
        return f"token_id:{token}" if self.tokens_as_ids else self.tokenizer.decode([token])  # type: ignore[attr-defined]

    def _top(self, entry: generation_pb2.TokenLogprobs, include_chosen: bool) -> list[tuple[int, float]]:
        """The top_n most likely tokens, plus the chosen one on completions (as OpenAI and vLLM do)."""
        ranked = sorted(zip(entry.token_ids, entry.logprobs), key=lambda x: -x[1])[: self.top_n]
        chosen = (entry.token_ids[0], entry.logprobs[0])
        return ranked + [chosen] if include_chosen and chosen not in ranked else ranked

    def chat(self, entries: list[generation_pb2.TokenLogprobs]) -> dict:
        content = []
        for e in entries:
            tops = [{"token": (text := self.text(t)), "logprob": _finite(lp), "bytes": list(text.encode())}
                    for t, lp in self._top(e, include_chosen=False)]
            chosen = self.text(e.token_ids[0])
            content.append({"token": chosen, "logprob": _finite(e.logprobs[0]), "bytes": list(chosen.encode()),
                            "top_logprobs": tops})
        return {"content": content}

    def completion(self, entries: list[generation_pb2.TokenLogprobs], offset: int = 0) -> dict:
        """offset: where the first token's text starts in the choice's text."""
        tokens = [self.text(e.token_ids[0]) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        body: dict = {"tokens": tokens, "token_logprobs": [_finite(e.logprobs[0]) for e in entries],
                      "top_logprobs": [{self.text(t): _finite(lp) for t, lp in self._top(e, include_chosen=True)}
                                       for e in entries],
                      "text_offset": offsets}
        return body

    def prompt_logprobs(self, entries: list[generation_pb2.TokenLogprobs]) -> list:
        """vLLM's prompt_logprobs: per prompt token {token id: {logprob, decoded_token}}, the first null."""
        return [None] + [{str(t): {"logprob": _finite(lp), "decoded_token": self.text(t)}
                          for t, lp in zip(e.token_ids, e.logprobs)}
                         for e in entries]


def _tool_finish(finish: str | None) -> str | None:
    """An output that ended on its own and holds calls finishes as "tool_calls", as in OpenAI's API."""
    return "tool_calls" if finish == "stop" else finish


def _merge_completion_logprobs(prompt: dict, output: dict) -> dict:
    return {key: prompt[key] + output[key] for key in prompt}


@dataclass
class ResponseBuilder:
    """Turns per-choice text deltas into OpenAI chunks (streaming) or one body (not streaming).
    Choice i belongs to prompt i // n."""

    request_id: str
    model: str
    options: OutputOptions
    tokenizer: object
    prompts: list[list[int]]
    n: int = 1
    prompt_texts: list[str] = field(default_factory=list)
    created: int = 0
    # prompt index -> its tokens' logprobs (tokens 1..), as they arrive
    prompt_logprobs: dict[int, list[generation_pb2.TokenLogprobs]] = field(default_factory=dict)
    num_streamed_tokens: int = 0
    # With tools, per streamed choice: its text so far and how much of it went out as content
    tool_text: dict[int, str] = field(default_factory=dict)
    tool_sent: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self.render = LogprobsRenderer(self.tokenizer, self.options.top_logprobs, self.options.tokens_as_ids)

    @property
    def chat(self) -> bool:
        return self.options.chat

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _echo_logprobs(self, prompt_index: int) -> dict:
        """The echoed prompt's tokens; the first has no logprob (null, as OpenAI)."""
        prompt = self.prompts[prompt_index]
        entries = self.prompt_logprobs.get(prompt_index, [])
        first = generation_pb2.TokenLogprobs(token_ids=[prompt[0]], logprobs=[0.0])
        body = self.render.completion([first, *entries])
        body["token_logprobs"][0] = body["top_logprobs"][0] = None
        return body

    def _logprobs(self, prompt_index: int, entries: list[generation_pb2.TokenLogprobs], echo: bool) -> dict | None:
        if not self.options.logprobs:
            return None
        if self.chat:
            return self.render.chat(entries)
        if not echo:
            return self.render.completion(entries)
        prompt = self._echo_logprobs(prompt_index)
        offset = len(self.prompt_texts[prompt_index])
        return _merge_completion_logprobs(prompt, self.render.completion(entries, offset))

    def _extras(self, choice: dict, prompt_index: int, token_ids: list[int], first: bool) -> None:
        if self.options.return_token_ids:
            choice["token_ids"] = token_ids
            if first and not self.chat:
                choice["prompt_token_ids"] = self.prompts[prompt_index]
        if self.options.prompt_logprobs and first and not self.chat:
            choice["prompt_logprobs"] = self.render.prompt_logprobs(self.prompt_logprobs.get(prompt_index, []))

    def _top_level(self, body: dict, first: bool) -> dict:
        """Chat puts the prompt's extras beside the choices (one prompt), as vLLM does."""
        if self.chat and first:
            if self.options.return_token_ids:
                body["prompt_token_ids"] = self.prompts[0]
            if self.options.prompt_logprobs:
                body["prompt_logprobs"] = self.render.prompt_logprobs(self.prompt_logprobs.get(0, []))
        return body

    def chunk(self, choice_index: int, delta: TextDelta, first: bool) -> dict:
        prompt_index = choice_index // self.n
        echo = self.options.echo and first
        choice: dict = {"index": choice_index, "finish_reason": delta.finish_reason,
                        "logprobs": self._logprobs(prompt_index, delta.logprobs, echo)
                        if delta.logprobs or echo else None}
        if self.chat:
            choice["delta"] = self._chat_delta(choice_index, delta, choice)
            if first:
                choice["delta"] = {"role": "assistant", **choice["delta"]}
        else:
            choice["text"] = (self.prompt_texts[prompt_index] if echo else "") + delta.text
        if delta.stop_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        self._extras(choice, prompt_index, delta.token_ids, first)
        body = self._top_level({**self._envelope(chunk=True), "choices": [choice]}, first and choice_index == 0)
        self.num_streamed_tokens += len(delta.token_ids)
        if self.options.continuous_usage:
            body["usage"] = usage_body(Usage(sum(map(len, self.prompts)), self.num_streamed_tokens))
        return body

    def _chat_delta(self, choice_index: int, delta: TextDelta, choice: dict) -> dict:
        """The chat delta: plain content, or with tools, the content that cannot be part of a call
        yet, and the calls themselves once the output ends."""
        tools = self.options.tools
        if tools is None:
            return {"content": delta.text}
        text = self.tool_text[choice_index] = self.tool_text.get(choice_index, "") + delta.text
        sent = self.tool_sent.get(choice_index, 0)
        if delta.finish_reason is None:
            end = max(sent, tools.may_start_call(text))
            self.tool_sent[choice_index] = end
            return {"content": text[sent:end]}
        content, calls = tools.parse(text)
        out: dict = {"content": (content or "")[sent:] or None}
        if calls:
            out["tool_calls"] = [c.body(i) for i, c in enumerate(calls)]
            choice["finish_reason"] = _tool_finish(delta.finish_reason)
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._envelope(chunk=True), "choices": [], "usage": usage_body(usage)}

    def full(self, choices: dict[int, list[TextDelta]], usage: Usage) -> dict:
        out = []
        for index in sorted(choices):
            prompt_index = index // self.n
            deltas = choices[index]
            text = "".join(d.text for d in deltas)
            finish = next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None)
            stop_reason = next((d.stop_reason for d in reversed(deltas) if d.stop_reason is not None), None)
            entries = [e for d in deltas for e in d.logprobs]
            choice: dict = {"index": index, "finish_reason": finish, "stop_reason": stop_reason,
                            "logprobs": self._logprobs(prompt_index, entries, self.options.echo)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
                if self.options.tools is not None:
                    content, calls = self.options.tools.parse(text)
                    if calls:
                        choice["message"] = {"role": "assistant", "content": content,
                                             "tool_calls": [c.body() for c in calls]}
                        choice["finish_reason"] = _tool_finish(finish)
            else:
                choice["text"] = (self.prompt_texts[prompt_index] if self.options.echo else "") + text
            self._extras(choice, prompt_index, [t for d in deltas for t in d.token_ids], first=True)
            out.append(choice)
        return self._top_level({**self._envelope(chunk=False), "choices": out, "usage": usage_body(usage)}, True)
