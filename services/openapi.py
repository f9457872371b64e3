"""The REST API's contract: JSON Schemas of the request and response bodies, the validation of every
request body against them, and the OpenAPI 3.1 document (GET /openapi.json) and its HTML page
(GET /docs) built from the same schemas, so what is published is what is enforced.

Design:

- One JSON Schema (draft 2020-12, OpenAPI 3.1's dialect) per request body: POST /v1/completions,
  /v1/chat/completions, /tokenize and /detokenize (REQUEST_SCHEMAS). Each covers every field the
  parsers in openai_api.py read, vLLM's extras included, with its type and the static ranges
  SamplingParams enforces (n <= MAX_N, logprobs <= MAX_LOGPROBS, token ids as int32, ...). Every
  optional field may be null (the parsers read null as "not given"). Unknown properties stay
  allowed (``additionalProperties`` is left open) because OpenAI's API ignores unknown fields; the
  fields this server refuses (services/unsupported_fields.py) are listed with their reason and no
  type, since the refusal, not the schema, answers them (a 400 ``unsupported_field``).
- The REST layer validates every JSON body of those routes against these schemas (validate_body,
  called from RestAPI._json_body) before the procedural parsing, and a violation becomes the
  usual 400 OpenAI error body whose ``param`` names the offending top-level field. The procedural
  checks in openai_api.py stay: they hold the value rules a schema does not express (min_tokens <=
  max_tokens, top_logprobs needs logprobs, token ids below the vocabulary, the chat template...).
  A POST route that reads a JSON body without a schema here fails loudly (KeyError), and
  tests/test_openapi.py checks that the document lists exactly the routes the app registers.
- Validators are built once, at import, with jsonschema's Draft202012Validator (after check_schema),
  extended with a fast path for the standard ``items`` keyword on arrays of bounded integers or of
  strings (same semantics: a failing array goes through the standard implementation for its
  error). Measured with timeit on the 2-core CI machine, one validation of: a chat request of 2
  messages with model, max_tokens, temperature, stream and stream_options ~170 us; a completion
  with a text prompt and 4 fields ~95 us; a completion of 30 token ids ~95 us; of 8192 token ids
  ~1.7 ms (without the fast path: 570 us and 110 ms). Only the first violation is looked for, so
  an invalid body is not walked past it.
- Responses are documented with schemas of the bodies ResponseBuilder and rest.py build
  (completion, chat completion, their stream chunks, error, models, model, health, version,
  tokenizer_info, tokenize, detokenize); they require the core fields and leave extra ones open.
  Streams are ``text/event-stream``: each event's ``data`` is a chunk as JSON, an in-band error
  body, or ``[DONE]`` (OpenAPI 3.1: the media type's schema describes one event).
- /openapi.json and /docs are open without the API key, like /health; /docs is one self-contained
  HTML page (no scripts, no CDN: the server may be offline) with every route, its summary and its
  request and response schemas, pretty-printed.
"""

from __future__ import annotations

import copy
import html
import json
from functools import cache
from importlib.metadata import version
from typing import Any

from aiohttp import web
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError

from metroserve.common.sampling_params import MAX_INT32, MAX_INT64, MAX_LOGPROBS, MAX_N
from metroserve.services.openai_api import BadRequest
from metroserve.services.unsupported_fields import UNSUPPORTED

Schema = dict[str, Any]


def _opt(schema: Schema) -> Schema:
    """schema, or null (the parsers read an explicit null as "not given")."""
    schema = dict(schema)
    if "type" in schema and "const" not in schema and "enum" not in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        schema["type"] = [*types, "null"]
        return schema
    if "enum" in schema:
        schema["enum"] = [*schema["enum"], None]
        return schema
    description = schema.pop("description", None)
    out: Schema = {"anyOf": [schema, {"type": "null"}]}
    if description:
        out["description"] = description
    return out


def _d(schema: Schema, description: str) -> Schema:
    return {**schema, "description": description}


_BOOL: Schema = {"type": "boolean"}
_STR: Schema = {"type": "string"}
_NUMBER: Schema = {"type": "number"}
_NONEMPTY: Schema = {"type": "string", "minLength": 1}
_CHOICE: Schema = {"type": "array", "minItems": 1, "items": _NONEMPTY}
_TOKEN_ID: Schema = {"type": "integer", "minimum": 0, "maximum": MAX_INT32}
_TOKEN_IDS: Schema = {"type": "array", "items": _TOKEN_ID}
_COUNT: Schema = {"type": "integer", "minimum": 0, "maximum": MAX_INT32}
_LOGPROBS_N: Schema = {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}
_JSON_SCHEMA_VALUE: Schema = {"type": ["object", "boolean", "string"],
                              "description": "a JSON schema, as an object or as JSON text"}

# -- request bodies --------------------------------------------------------------------------

_SAMPLING: Schema = {
    "n": _opt(_d({"type": "integer", "minimum": 1, "maximum": MAX_N}, "completions per prompt")),
    "temperature": _opt(_d({**_NUMBER, "minimum": 0}, "0: greedy")),
    "top_p": _opt({**_NUMBER, "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _opt(_d({"type": "integer", "minimum": -1, "maximum": MAX_INT32}, "vLLM: 0 or -1 disables it")),
    "min_p": _opt(_d({**_NUMBER, "minimum": 0, "maximum": 1}, "vLLM")),
    "repetition_penalty": _opt(_d({**_NUMBER, "exclusiveMinimum": 0}, "vLLM; 1: none")),
    "presence_penalty": _opt({**_NUMBER, "minimum": -2, "maximum": 2}),
    "frequency_penalty": _opt({**_NUMBER, "minimum": -2, "maximum": 2}),
    "logit_bias": _opt(_d({"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                           "additionalProperties": {**_NUMBER, "minimum": -100, "maximum": 100}},
                          "token id (as a string) -> bias in [-100, 100]")),
    "seed": _opt({"type": "integer", "minimum": -MAX_INT64 - 1, "maximum": MAX_INT64}),
    "max_tokens": _opt(_d(_COUNT, "tokens to generate (completions default 16; chat: up to the context); "
                                  "0 scores the prompt only (with prompt_logprobs)")),
    "min_tokens": _opt(_d(_COUNT, "vLLM: no stop before this many tokens; at most max_tokens")),
    "ignore_eos": _opt(_d(_BOOL, "vLLM")),
    "stop": _opt(_d({"anyOf": [_NONEMPTY, {"type": "array", "items": _NONEMPTY}]}, "stop strings")),
    "stop_token_ids": _opt(_d(_TOKEN_IDS, "vLLM")),
    "include_stop_str_in_output": _opt(_d(_BOOL, "vLLM")),
    "skip_special_tokens": _opt(_d(_BOOL, "vLLM")),
    "allowed_token_ids": _opt(_d({**_TOKEN_IDS, "minItems": 1}, "vLLM: only these tokens may be sampled")),
    "bad_words": _opt(_d({"type": "array", "items": {"type": "string", "minLength": 1}},
                         "vLLM: words never to generate")),
    "prompt_logprobs": _opt(_d(_LOGPROBS_N, "vLLM: logprobs of the prompt's tokens with this many alternatives")),
    "speculative": _opt(_d(_BOOL, "false: no speculative decoding for this request")),
}

_STRUCTURED: Schema = {
    "response_format": _opt(_d({
        "type": "object", "required": ["type"],
        "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                       "json_schema": {"type": "object", "required": ["schema"],
                                       "properties": {"name": _STR, "description": _STR, "schema": _JSON_SCHEMA_VALUE,
                                                      "strict": _opt(_BOOL)}}}},
        "OpenAI's structured outputs; at most one of response_format, structured_outputs, guided_*")),
    "structured_outputs": _opt(_d({
        "type": "object", "additionalProperties": False,
        "properties": {"json": _opt(_JSON_SCHEMA_VALUE), "regex": _opt(_STR),
                       "choice": _opt(_CHOICE), "grammar": _opt(_d(_STR, "EBNF (xgrammar)")),
                       "json_object": _opt(_BOOL), "disable_any_whitespace": _opt(_BOOL),
                       "disable_additional_properties": _opt(_BOOL)}},
        "vLLM: exactly one of json, regex, choice, grammar, json_object")),
    "guided_json": _opt(_d(_JSON_SCHEMA_VALUE, "vLLM (older name of structured_outputs.json)")),
    "guided_regex": _opt(_d(_STR, "vLLM")),
    "guided_choice": _opt(_d(_CHOICE, "vLLM")),
    "guided_grammar": _opt(_d(_STR, "vLLM: EBNF (xgrammar)")),
    "guided_decoding_backend": _opt(_d({"enum": ["auto", "xgrammar"]}, "vLLM; xgrammar is the only backend")),
}

_COMMON: Schema = {
    "model": _opt(_d(_STR, "the served model's id (GET /v1/models); another gets 404 model_not_found")),
    "stream": _opt(_d(_BOOL, "server-sent events, ending in data: [DONE]")),
    "stream_options": _opt(_d({"type": "object",
                               "properties": {"include_usage": _opt(_BOOL),
                                              "continuous_usage_stats": _opt(_d(_BOOL, "vLLM: usage in every chunk"))}},
                              "only with stream: true")),
    "priority": _opt(_d({"type": "integer", "minimum": -2**31, "maximum": 2**31 - 1},
                        "vLLM: lower is served first (with --scheduling-policy priority)")),
    "cache_salt": _opt(_d(_STR, "vLLM: prefix-cache isolation between tenants")),
    "truncate_prompt_tokens": _opt(_d({"type": "integer", "minimum": -1, "maximum": MAX_INT32, "not": {"const": 0}},
                                      "vLLM: keep the prompt's last k tokens (-1: the context length)")),
    "add_special_tokens": _opt(_d(_BOOL, "vLLM: the tokenizer's special tokens around the prompt")),
    "return_token_ids": _opt(_d(_BOOL, "vLLM: token_ids (and prompt_token_ids) in the response")),
    "return_tokens_as_token_ids": _opt(_d(_BOOL, "vLLM: logprobs name tokens token_id:<id>")),
    "user": _opt(_d(_STR, "informational")),
    "metadata": _opt(_d({"type": "object"}, "informational")),
    **_SAMPLING,
    **_STRUCTURED,
}

_TEXT_PART: Schema = {"type": "object", "required": ["type", "text"],
                      "properties": {"type": {"const": "text"}, "text": _STR}}
_TOOL_CALL: Schema = {
    "type": "object", "required": ["function"],
    "properties": {"id": _STR, "type": {"const": "function"},
                   "function": {"type": "object", "required": ["name"],
                                "properties": {"name": _STR, "arguments": {"type": ["string", "object"]}}}}}
_MESSAGE: Schema = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": _d(_STR, "system, user, assistant, tool, ...: what the chat template accepts"),
        "content": _opt(_d({"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
                           "a string or a list of text parts")),
        "name": _opt(_STR),
        "tool_calls": _opt(_d({"type": "array", "items": _TOOL_CALL}, "an assistant's earlier calls")),
        "tool_call_id": _opt(_d(_STR, "a tool message: the call it answers")),
    }}
_MESSAGES: Schema = {"type": "array", "minItems": 1, "items": _MESSAGE}
_TOOL: Schema = {
    "type": "object", "required": ["type", "function"],
    "properties": {"type": {"const": "function"},
                   "function": {"type": "object", "required": ["name"],
                                "properties": {"name": {"type": "string", "minLength": 1},
                                               "description": _opt(_STR),
                                               "parameters": _opt(_d({"type": "object"}, "a JSON schema")),
                                               "strict": _opt(_BOOL)}}}}
_TOOL_CHOICE: Schema = {"anyOf": [{"enum": ["none", "auto", "required"]},
                                  {"type": "object", "required": ["type", "function"],
                                   "properties": {"type": {"const": "function"},
                                                  "function": {"type": "object", "required": ["name"],
                                                               "properties": {"name": _STR}}}}]}

_COMPLETION_ONLY: Schema = {
    "prompt": _d({"anyOf": [_STR, {**_TOKEN_IDS, "minItems": 1},
                            {"type": "array", "minItems": 1, "items": {"anyOf": [_STR, _TOKEN_IDS]}}]},
                 "a string, a list of token ids, or a list of those (one choice set per prompt)"),
    "echo": _opt(_d(_BOOL, "the prompt (and, with logprobs, its tokens' logprobs) before the completion")),
    "logprobs": _opt(_d(_LOGPROBS_N, "logprobs of the chosen tokens and this many alternatives")),
    "suffix": _opt(_d(_STR, "refused unless empty: this server does not insert")),
}

_CHAT_ONLY: Schema = {
    "messages": _MESSAGES,
    "max_completion_tokens": _opt(_d(_COUNT, "OpenAI's newer name of max_tokens (wins over it)")),
    "logprobs": _opt(_d(_BOOL, "logprobs of the chosen tokens")),
    "top_logprobs": _opt(_d(_LOGPROBS_N, "alternatives per token; needs logprobs: true")),
    "add_generation_prompt": _opt(_d(_BOOL, "vLLM (default true)")),
    "continue_final_message": _opt(_d(_BOOL, "vLLM: the last assistant message stays open; "
                                             "needs add_generation_prompt: false")),
    "chat_template": _opt(_d(_STR, "vLLM: a Jinja chat template instead of the tokenizer's")),
    "chat_template_kwargs": _opt(_d({"type": "object"}, "vLLM: extra variables for the chat template")),
    "tools": _opt(_d({"type": "array", "minItems": 1, "items": _TOOL}, "functions the model may call")),
    "tool_choice": _opt(_d(_TOOL_CHOICE, "none, auto (needs --tool-call-parser), required, or a named function")),
    "parallel_tool_calls": _d(_BOOL, "whether several calls may come in one answer (default true)"),
}


def _refused(endpoint: str, properties: Schema) -> Schema:
    """The fields of unsupported_fields.UNSUPPORTED that apply to the endpoint, documented as refused."""
    out = dict(properties)
    for name, rule in UNSUPPORTED.items():
        if endpoint in rule.endpoints and name not in out:
            out[name] = {"description": f"refused (400, code unsupported_field) unless inert: {rule.reason}",
                         "x-refused": True}
    return out


def _body(title: str, properties: Schema, required: list[str], **extra: Any) -> Schema:
    return {"title": title, "type": "object", "required": required, "properties": properties,
            "additionalProperties": True, **extra}


COMPLETION_REQUEST = _body("CompletionRequest", _refused("completion", {**_COMMON, **_COMPLETION_ONLY}), ["prompt"])
CHAT_REQUEST = _body("ChatCompletionRequest", _refused("chat", {**_COMMON, **_CHAT_ONLY}), ["messages"])
TOKENIZE_REQUEST = _body("TokenizeRequest", {
    "model": _opt(_STR),
    "prompt": _d(_STR, "text to tokenize"),
    "messages": _d(_MESSAGES, "chat messages, tokenized with the chat template (wins over prompt)"),
    "add_generation_prompt": _opt(_d(_BOOL, "with messages (default true)")),
    "add_special_tokens": _opt(_d(_BOOL, "with prompt (default true)")),
}, [], anyOf=[{"required": ["prompt"]}, {"required": ["messages"]}])
DETOKENIZE_REQUEST = _body("DetokenizeRequest", {
    "model": _opt(_STR),
    "tokens": _d(_TOKEN_IDS, "token ids below the vocabulary size"),
}, ["tokens"])

# route -> (components name, schema)
REQUEST_SCHEMAS: dict[str, tuple[str, Schema]] = {
    "/v1/completions": ("CompletionRequest", COMPLETION_REQUEST),
    "/v1/chat/completions": ("ChatCompletionRequest", CHAT_REQUEST),
    "/tokenize": ("TokenizeRequest", TOKENIZE_REQUEST),
    "/detokenize": ("DetokenizeRequest", DETOKENIZE_REQUEST),
}


_STANDARD_ITEMS = Draft202012Validator.VALIDATORS["items"]


def _items(validator, items, instance, schema):
    """The standard `items` keyword, with a fast path for arrays of plain integers in a range or of
    strings (token id prompts, stop strings): when every element passes, no per-element descent;
    otherwise the standard implementation reports the error. Same semantics, ~100x cheaper per token."""
    if isinstance(instance, list) and "prefixItems" not in schema and isinstance(items, dict):
        if items.keys() == {"type", "minimum", "maximum"} and items["type"] == "integer":
            low, high = items["minimum"], items["maximum"]
            if all(type(x) is int and low <= x <= high for x in instance):
                return
        elif items == {"type": "string"} and all(type(x) is str for x in instance):
            return
    yield from _STANDARD_ITEMS(validator, items, instance, schema)


_Validator = validators.extend(Draft202012Validator, {"items": _items})


def _validator(schema: Schema):
    _Validator.check_schema(schema)
    return _Validator(schema)


_VALIDATORS = {route: _validator(s) for route, (_, s) in REQUEST_SCHEMAS.items()}
_MAX_MESSAGE = 300


def _where(error: ValidationError) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _param(error: ValidationError) -> str | None:
    """The top-level field a violation is in (OpenAI's error `param`)."""
    path = list(error.absolute_path)
    if path:
        return str(path[0])
    if error.validator == "required" and isinstance(error.instance, dict):
        return next((str(n) for n in error.validator_value if n not in error.instance), None)
    return None


def validate_body(route: str, body: object) -> None:
    """Raise BadRequest (param: the top-level field) for a body that violates the route's schema.
    KeyError for a route without one: a JSON body route must be documented here."""
    error = next(iter(_VALIDATORS[route].iter_errors(body)), None)
    if error is None:
        return
    while error.context:  # anyOf / oneOf: the branch that got deepest into the value, null's last
        error = max(error.context, key=lambda e: (not (e.validator == "type" and e.validator_value == "null"),
                                                  len(e.absolute_path), bool(e.context)))
    where, message = _where(error), error.message
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + "..."
    raise BadRequest(f"'{where}': {message}" if where else message, param=_param(error))


# -- response bodies -------------------------------------------------------------------------


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(required: list[str], properties: Schema, **extra: Any) -> Schema:
    return {"type": "object", "required": required, "properties": properties, **extra}


_INT: Schema = {"type": "integer"}
_NONNEG: Schema = {"type": "integer", "minimum": 0}
_FINISH: Schema = _d({"enum": ["stop", "length", "abort", "tool_calls", None]},
                     "null while a streamed choice goes on")
_STOP_REASON: Schema = _d({"type": ["string", "integer", "null"]},
                         "vLLM: the stop string or stop token id that ended it")
_PROMPT_LOGPROBS: Schema = _opt(_d({"type": "array", "items": _opt({
    "type": "object", "additionalProperties": _obj(["logprob"], {"logprob": _NUMBER, "decoded_token": _STR})})},
    "vLLM: per prompt token {token id: {logprob, decoded_token}}; the first is null"))
_COMPLETION_LOGPROBS: Schema = _opt(_obj(["tokens", "token_logprobs", "top_logprobs", "text_offset"], {
    "tokens": {"type": "array", "items": _STR},
    "token_logprobs": {"type": "array", "items": _opt(_NUMBER)},
    "top_logprobs": {"type": "array", "items": _opt({"type": "object", "additionalProperties": _NUMBER})},
    "text_offset": {"type": "array", "items": _NONNEG}}))
_TOP_LOGPROB: Schema = _obj(["token", "logprob"], {"token": _STR, "logprob": _NUMBER,
                                                   "bytes": _opt({"type": "array", "items": _NONNEG})})
_CHAT_LOGPROBS: Schema = _opt(_obj(["content"], {"content": _opt({"type": "array", "items": _obj(
    ["token", "logprob"], {**_TOP_LOGPROB["properties"], "top_logprobs": {"type": "array", "items": _TOP_LOGPROB}})})}))
_OUT_TOOL_CALL: Schema = _obj(["id", "type", "function"], {
    "index": _NONNEG, "id": _STR, "type": {"const": "function"},
    "function": _obj(["name", "arguments"], {"name": _STR, "arguments": _STR})})
_TOKEN_EXTRAS: Schema = {"token_ids": _d(_TOKEN_IDS, "with return_token_ids")}

_COMPLETION_CHOICE = _obj(["index", "text", "finish_reason", "logprobs"], {
    "index": _NONNEG, "text": _STR, "finish_reason": _FINISH, "stop_reason": _STOP_REASON,
    "logprobs": _COMPLETION_LOGPROBS, **_TOKEN_EXTRAS,
    "prompt_token_ids": _d(_TOKEN_IDS, "with return_token_ids"), "prompt_logprobs": _PROMPT_LOGPROBS})
_CHAT_CHOICE = _obj(["index", "message", "finish_reason", "logprobs"], {
    "index": _NONNEG, "finish_reason": _FINISH, "stop_reason": _STOP_REASON, "logprobs": _CHAT_LOGPROBS,
    "message": _obj(["role", "content"], {"role": {"const": "assistant"}, "content": _opt(_STR),
                                          "tool_calls": {"type": "array", "items": _OUT_TOOL_CALL}}),
    **_TOKEN_EXTRAS})
_CHAT_CHUNK_CHOICE = _obj(["index", "delta", "finish_reason"], {
    "index": _NONNEG, "finish_reason": _FINISH, "stop_reason": _STOP_REASON, "logprobs": _CHAT_LOGPROBS,
    "delta": _obj([], {"role": {"const": "assistant"}, "content": _opt(_STR),
                       "tool_calls": {"type": "array", "items": _OUT_TOOL_CALL}}),
    **_TOKEN_EXTRAS})
_CHAT_EXTRAS: Schema = {"prompt_token_ids": _d(_TOKEN_IDS, "vLLM, with return_token_ids"),
                        "prompt_logprobs": _PROMPT_LOGPROBS}


def _envelope(kind: str, choice: Schema, usage_required: bool, extras: Schema | None = None) -> Schema:
    return _obj(["id", "object", "created", "model", "choices", *(["usage"] if usage_required else [])], {
        "id": _STR, "object": {"const": kind}, "created": _INT, "model": _STR,
        "choices": {"type": "array", "items": choice},
        "usage": _ref("Usage") if usage_required else _opt(_ref("Usage")), **(extras or {})})


RESPONSE_SCHEMAS: dict[str, Schema] = {
    "ErrorResponse": _obj(["error"], {"error": _obj(["message", "type", "param", "code"], {
        "message": _STR, "type": _STR, "param": _opt(_STR), "code": {"type": ["string", "integer", "null"]}})},
        description="OpenAI's error body"),
    "Usage": _obj(["prompt_tokens", "completion_tokens", "total_tokens"], {
        "prompt_tokens": _NONNEG, "completion_tokens": _NONNEG, "total_tokens": _NONNEG,
        "prompt_tokens_details": _opt(_obj([], {"cached_tokens": _d(_NONNEG, "prompt tokens read from the "
                                                                              "prefix cache")}))}),
    "Completion": _envelope("text_completion", _COMPLETION_CHOICE, True),
    "CompletionChunk": _envelope("text_completion", _COMPLETION_CHOICE, False),
    "ChatCompletion": _envelope("chat.completion", _CHAT_CHOICE, True, _CHAT_EXTRAS),
    "ChatCompletionChunk": _envelope("chat.completion.chunk", _CHAT_CHUNK_CHOICE, False, _CHAT_EXTRAS),
    "Model": _obj(["id", "object", "created", "owned_by"], {
        "id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "max_model_len": _NONNEG}),
    "ModelList": _obj(["object", "data"], {"object": {"const": "list"},
                                           "data": {"type": "array", "items": _ref("Model")}}),
    "Health": _obj(["status"], {"status": {"const": "ok"}}),
    "Version": _obj(["version"], {"version": _d(_STR, "the metroserve package's")}),
    "TokenizerInfo": _obj(["tokenizer_class", "vocab_size", "model_max_length", "max_model_len", "chat_template"], {
        "tokenizer_class": _STR, "vocab_size": _NONNEG, "model_max_length": _opt(_NONNEG),
        "max_model_len": _NONNEG, "chat_template": _opt(_STR),
        **{f"{n}_token{s}": _opt(t) for n in ("bos", "eos", "pad", "unk") for s, t in (("", _STR), ("_id", _NONNEG))}},
        description="vLLM's /tokenizer_info"),
    "TokenizeResponse": _obj(["tokens", "count", "max_model_len"], {
        "tokens": _TOKEN_IDS, "count": _NONNEG, "max_model_len": _NONNEG}),
    "DetokenizeResponse": _obj(["prompt"], {"prompt": _STR}),
}


def _sse_event(chunk: str) -> Schema:
    """One server-sent event of a stream: a chunk, an in-band error, or the final [DONE]."""
    return _obj(["data"], {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}}]}},
        description=f"one event: data is a {chunk} as JSON (the last may carry only usage), an error body "
                    "if the request failed after the stream began, then [DONE]")


# -- the document ----------------------------------------------------------------------------

_ERRORS = {
    "400": "bad input: the body violates the schema or a value rule (param names the field)",
    "401": "the API key is missing or wrong (only with --api-key)",
    "404": "an unknown model (code model_not_found)",
    "408": "the body did not arrive within --body-read-timeout seconds of the headers (code request_timeout)",
    "413": "the body is larger than --max-body-bytes (code body_too_large)",
    "429": "the scheduler's queue is full (Retry-After)",
    "502": "a worker failed the request",
    "503": "no live worker",
}


def _errors(*codes: str) -> dict[str, Any]:
    return {code: {"description": _ERRORS[code], "content": {"application/json": {"schema": _ref("ErrorResponse")}}}
            for code in codes}


def _json_ok(name: str, description: str) -> dict[str, Any]:
    return {"200": {"description": description, "content": {"application/json": {"schema": _ref(name)}}}}


_OPEN = "open without the API key"
_KEY: list[dict] = [{"bearerAuth": []}, {}]  # the key is required only when the server runs with --api-key


def _examples(examples: dict[str, dict]) -> dict[str, Any]:
    return {name: {"summary": name, "value": value} for name, value in examples.items()}


_MESSAGES_EXAMPLE = [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is the capital of France?"}]
# Shown in /docs, and sent first by schemathesis (its explicit phase): the main paths to a 200.
REQUEST_EXAMPLES: dict[str, dict[str, dict]] = {
    "CompletionRequest": {
        "greedy": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        "stream with usage and logprobs": {"prompt": "Once upon a time", "max_tokens": 8, "stream": True,
                                           "stream_options": {"include_usage": True,
                                                              "continuous_usage_stats": True}, "logprobs": 2},
        "score a prompt (echo, max_tokens 0)": {"prompt": "Paris is in France", "max_tokens": 0, "echo": True,
                                               "logprobs": 1},
        "several prompts, token ids": {"prompt": [[504, 3458, 282], "Hello"], "n": 2, "max_tokens": 4, "seed": 7,
                                       "return_token_ids": True, "prompt_logprobs": 1},
        "constrained to a choice": {"prompt": "Is Paris in France? Answer:", "max_tokens": 4,
                                    "structured_outputs": {"choice": [" yes", " no"]}},
    },
    "ChatCompletionRequest": {
        "chat": {"messages": _MESSAGES_EXAMPLE, "max_tokens": 16, "temperature": 0},
        "stream with logprobs": {"messages": _MESSAGES_EXAMPLE, "max_tokens": 8, "stream": True,
                                 "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2},
        "JSON schema": {"messages": _MESSAGES_EXAMPLE, "max_tokens": 32, "response_format": {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": {
                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}},
        "a required tool call": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 32,
                                 "tools": [{"type": "function", "function": {
                                     "name": "get_weather", "description": "current weather in a city",
                                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"]}}}],
                                 "tool_choice": "required"},
        "prompt token ids and logprobs": {"messages": _MESSAGES_EXAMPLE, "max_tokens": 4, "return_token_ids": True,
                                          "prompt_logprobs": 0},
    },
    "TokenizeRequest": {"prompt": {"prompt": "Hello world"},
                        "messages": {"messages": _MESSAGES_EXAMPLE, "add_generation_prompt": True}},
    "DetokenizeRequest": {"tokens": {"tokens": [19556, 905]}},
}


def _request_body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(name),
                                                                "examples": _examples(REQUEST_EXAMPLES[name])}}}


def _generation(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
    return {"summary": summary, "security": _KEY, "requestBody": _request_body(request),
            "responses": {"200": {"description": f"a {response}, or with stream: true an event stream of "
                                                 f"{chunk}s ending in data: [DONE]",
                                  "content": {"application/json": {"schema": _ref(response)},
                                              "text/event-stream": {"schema": _sse_event(chunk)}}},
                          **_errors("400", "401", "404", "408", "413", "429", "502", "503")}}


def _post(summary: str, request: str, response: str, *errors: str) -> dict[str, Any]:
    return {"summary": summary, "security": _KEY, "requestBody": _request_body(request),
            "responses": {**_json_ok(response, summary), **_errors(*errors)}}


def _get(summary: str, responses: dict[str, Any], open_: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary + (f" ({_OPEN})" if open_ else "")}
    if not open_:
        op["security"] = _KEY
    op["responses"] = responses
    return {"get": op}


def _text(media_type: str, description: str) -> dict[str, Any]:
    return {"200": {"description": description, "content": {media_type: {"schema": _STR}}}}


@cache
def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of every REST route (GET /openapi.json). A fresh copy is cheap to
    make but callers share this one: do not mutate it."""
    model_id = {"name": "model_id", "in": "path", "required": True, "description": "a model id; may hold '/' "
                "(sent as %2F)", "schema": {"type": "string", "minLength": 1}}
    paths: dict[str, Any] = {
        "/v1/completions": {"post": _generation("Text completion (OpenAI's legacy completions, with vLLM's fields)",
                                                "CompletionRequest", "Completion", "CompletionChunk")},
        "/v1/chat/completions": {"post": _generation("Chat completion (OpenAI's, with vLLM's fields and tools)",
                                                     "ChatCompletionRequest", "ChatCompletion",
                                                     "ChatCompletionChunk")},
        "/tokenize": {"post": _post("Tokenize a prompt or chat messages (vLLM)", "TokenizeRequest",
                                    "TokenizeResponse", "400", "401", "404", "408", "413")},
        "/detokenize": {"post": _post("Token ids to text (vLLM)", "DetokenizeRequest", "DetokenizeResponse",
                                      "400", "401", "408", "413")},
        "/v1/models": _get("The served models", {**_json_ok("ModelList", "the served models"),
                                                **_errors("401", "503")}),
        "/v1/models/{model_id}": {**_get("One served model", {**_json_ok("Model", "the model"),
                                                             **_errors("401", "404", "503")}),
                                  "parameters": [model_id]},
        "/health": _get("Readiness: 200 once a worker is ready", {**_json_ok("Health", "a worker is ready"),
                                                                  **_errors("503")}, open_=True),
        "/version": _get("The metroserve version", _json_ok("Version", "the version"), open_=True),
        "/tokenizer_info": _get("The tokenizer's class, special tokens and chat template (vLLM)",
                                {**_json_ok("TokenizerInfo", "the tokenizer"), **_errors("401")}),
        "/metrics": _get("Prometheus metrics of this gateway", _text("text/plain", "Prometheus text format"),
                         open_=True),
        "/openapi.json": _get("This document", {"200": {"description": "the OpenAPI 3.1 document", "content": {
            "application/json": {"schema": {"type": "object", "required": ["openapi", "paths"]}}}}}, open_=True),
        "/docs": _get("This API as an HTML page", _text("text/html", "the routes and their schemas"), open_=True),
    }
    schemas = {name: copy.deepcopy(schema) for name, schema in REQUEST_SCHEMAS.values()}
    schemas.update(copy.deepcopy(RESPONSE_SCHEMAS))
    return {
        "openapi": "3.1.0",
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {"title": "metroserve", "version": version("metroserve"),
                 "description": "OpenAI-compatible REST API of the metroserve gateway (vLLM's extra fields "
                                "and routes included). Request bodies are validated against these schemas; "
                                "unknown fields are ignored, as OpenAI does."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                                          "description": "the --api-key, when the server has one"}}},
    }


def documented_routes() -> set[tuple[str, str]]:
    """(METHOD, path) of every operation in the document."""
    return {(method.upper(), path) for path, item in openapi_document()["paths"].items()
            for method in item if method != "parameters"}


# -- /docs -----------------------------------------------------------------------------------

_STYLE = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
          "h2{border-top:1px solid #ccc;padding-top:.8em;font-size:1.15em}.m{display:inline-block;min-width:4em;"
          "font-family:monospace;font-weight:bold}pre{background:#f6f6f6;padding:.6em;overflow:auto;font-size:.85em;"
          "max-height:32em}details{margin:.3em 0}summary{cursor:pointer}")


def _pre(value: object) -> str:
    return f"<pre>{html.escape(json.dumps(value, indent=2))}</pre>"


def _schema_link(schema: Schema | None) -> str:
    ref = (schema or {}).get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        name = ref.rsplit("/", 1)[1]
        return f'<a href="#schema-{html.escape(name)}">{html.escape(name)}</a>'
    return _pre(schema)


@cache
def docs_html() -> str:
    doc = openapi_document()
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(doc['info']['title'])} API"
           f"</title><style>{_STYLE}</style></head><body>",
           f"<h1>{html.escape(doc['info']['title'])} {html.escape(doc['info']['version'])}</h1>",
           f"<p>{html.escape(doc['info']['description'])}</p>",
           '<p>Machine-readable: <a href="/openapi.json">/openapi.json</a> (OpenAPI 3.1).</p><h2>Routes</h2><ul>']
    operations = [(path, method, op) for path, item in doc["paths"].items()
                  for method, op in item.items() if method != "parameters"]
    for path, method, op in operations:
        out.append(f'<li><a href="#{method}-{html.escape(path)}"><span class="m">{method.upper()}</span>'
                   f"{html.escape(path)}</a>: {html.escape(op['summary'])}</li>")
    out.append("</ul>")
    for path, method, op in operations:
        out.append(f'<h2 id="{method}-{html.escape(path)}"><span class="m">{method.upper()}</span>'
                   f"{html.escape(path)}</h2><p>{html.escape(op['summary'])}</p>")
        if "requestBody" in op:
            for media, content in op["requestBody"]["content"].items():
                out.append(f"<p>Request body ({html.escape(media)}): {_schema_link(content.get('schema'))}</p>")
                for name, example in content.get("examples", {}).items():
                    out.append(f"<details><summary>example: {html.escape(name)}</summary>"
                               f"{_pre(example['value'])}</details>")
        out.append("<ul>")
        for status, response in op["responses"].items():
            kinds = "; ".join(f"{html.escape(m)}: {_schema_link(c.get('schema'))}"
                              for m, c in response.get("content", {}).items())
            out.append(f"<li><b>{status}</b> {html.escape(response['description'])}<br>{kinds}</li>")
        out.append("</ul>")
    out.append("<h2>Schemas</h2>")
    for name, schema in doc["components"]["schemas"].items():
        out.append(f'<details id="schema-{html.escape(name)}"><summary>{html.escape(name)}</summary>'
                   f"{_pre(schema)}</details>")
    out.append("</body></html>")
    return "\n".join(out)


@cache
def _openapi_text() -> str:
    return json.dumps(openapi_document())


async def openapi_handler(request: web.Request) -> web.Response:
    return web.Response(text=_openapi_text(), content_type="application/json")


async def docs_handler(request: web.Request) -> web.Response:
    return web.Response(text=docs_html(), content_type="text/html")
