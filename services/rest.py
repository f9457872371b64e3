"""The gateway's OpenAI-compatible REST API (aiohttp).

Routes: /v1/chat/completions, /v1/completions (SSE streaming ending in [DONE], usage chunk with
stream_options.include_usage), /v1/models, /v1/models/{id}, /health, /version, /tokenize,
/detokenize, /tokenizer_info, /openapi.json and /docs (services/openapi.py, whose schemas every JSON
body is validated against before it is parsed). The server cancels a handler when its client
disconnects; the cancellation ends the request's stream, which aborts the request on its worker
and frees its blocks. A streaming response is only started once the scheduler has admitted every
prompt, so refusals still get a proper status (400/404/429/503).

Every response, streams and errors included, carries X-Request-Id: the client's own, echoed, else
a fresh uuid4 hex. The completion's body id stays `cmpl-<uuid4 hex>` / `chatcmpl-<uuid4 hex>`
either way (vLLM would build it from the client's header): it is also the id the cluster tracks
the request by, which must be unique, and two clients may well send the same header. CORS
(services/cors.py) is answered here too: preflights before the API key check, the allow-origin
header on every response to an allowed origin.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from importlib.metadata import version
from typing import Any

import grpc
from aiohttp import web
from opentelemetry import trace

from metroserve.common.json_limits import JsonLimitError, check_json_shape
from metroserve.rpc import generation_pb2
from metroserve.services.cluster_client import ClusterClient, UpstreamError
from metroserve.services.cors import CorsPolicy
from metroserve.services.gateway_metrics import CLIENT_CLOSED, GatewayMetrics
from metroserve.services.http_limits import HttpLimits
from metroserve.services.metrics_http import metrics_handler
from metroserve.services.openai_api import (
    BadRequest,
    GenerationRequest,
    ResponseBuilder,
    check_batch_size,
    error_body,
    parse_chat,
    parse_completion,
    parse_messages,
)
from metroserve.services.openapi import docs_handler, openapi_handler, validate_body
from metroserve.services.prompt_log import PromptLog
from metroserve.services.text_stream import StreamUpdate, TextDelta, Usage, stream_text
from metroserve.services.tracing import tracer

logger = logging.getLogger(__name__)

_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
           grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.UNAUTHENTICATED: 401}
# Open for probes and rollout checks, as in vLLM; /version tells only the package version; the API's
# description (/openapi.json, /docs) holds nothing secret.
_UNPROTECTED = ("/health", "/metrics", "/version", "/openapi.json", "/docs")
REQUEST_ID_HEADER = "X-Request-Id"
# transformers' model_max_length when the tokenizer's config sets none (its VERY_LARGE_INTEGER).
_UNSET_MAX_LENGTH = int(1e30)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate


class ModelNotFound(LookupError):
    """An unknown model id: 404 with OpenAI's body, as api.openai.com answers it (type
    "invalid_request_error", param "model", code "model_not_found"; vLLM's type is "NotFoundError"),
    so the openai client raises openai.NotFoundError."""

    def __init__(self, model: str, served: str):
        super().__init__(f"the model '{model}' does not exist; this server serves '{served}'")


def json_error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, headers: dict | None = None) -> web.Response:
    return web.json_response(error_body(message, type_, param, code), status=status, headers=headers)


def upstream_error_response(e: UpstreamError) -> web.Response:
    status = _STATUS.get(e.code, 502)
    headers = {"Retry-After": e.retry_after} if e.retry_after else None
    type_ = "invalid_request_error" if status == 400 else "server_error" if status >= 500 else "rate_limit_error"
    return json_error(status, e.message, type_, param=e.param, code=e.code.name.lower(), headers=headers)


def model_card(model: generation_pb2.ModelInfo) -> dict:
    """One model as /v1/models lists it and /v1/models/{id} returns it."""
    return {"id": model.id, "object": "model", "created": 0, "owned_by": "metroserve",
            "max_model_len": model.max_model_len}


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """GET /tokenizer_info: vLLM's field names (tokenizer_class, model_max_length, bos_token, ...,
    chat_template, as in tokenizer_config.json), plus what vLLM leaves to that file's keys: each
    special token's id, vocab_size (added tokens included) and the served max_model_len.
    chat_template is null when the tokenizer has none, model_max_length when its config sets none."""
    info: dict = {"tokenizer_class": type(tokenizer).__name__, "vocab_size": len(tokenizer),
                  "model_max_length": tokenizer.model_max_length
                  if tokenizer.model_max_length < _UNSET_MAX_LENGTH else None,
                  "max_model_len": max_model_len}
    for name in ("bos", "eos", "pad", "unk"):
        info[f"{name}_token"] = getattr(tokenizer, f"{name}_token")
        info[f"{name}_token_id"] = getattr(tokenizer, f"{name}_token_id")
    info["chat_template"] = tokenizer.chat_template or None
    return info


# A body this large leaves what its parse freed (100,000 prompt strings: ~7 MiB) in glibc's heap,
# kept for reuse but counted in the process's memory. Past this size the gateway hands freed heap
# back once the request is answered (malloc_trim: about a millisecond, for rare requests only).
TRIM_AFTER_BODY_BYTES = 1 << 20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc only; elsewhere nothing is trimmed
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class RestAPI:
    def __init__(self, client: ClusterClient, tokenizer, model_name: str, max_model_len: int,
                 api_key: str | None, limits: HttpLimits, metrics: GatewayMetrics,
                 cors: CorsPolicy | None = None, tool_call_parser: str | None = None,
                 prompt_log: PromptLog | None = None):
        self.client = client
        self.tool_call_parser = tool_call_parser
        self.metrics = metrics
        self.tracer = tracer("metroserve.gateway")
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.limits = limits
        self.prompt_log = prompt_log or PromptLog()
        self.cors = cors or CorsPolicy()
        self._version_body = {"version": version("metroserve")}
        self._tokenizer_info_body = tokenizer_info(tokenizer, max_model_len)  # fixed: built once

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes,
                              middlewares=[self._release_heap_after_large_bodies, self._preflight, self._count,
                                           self._errors_and_auth])
        # Headers go on in on_response_prepare, not in a middleware: a stream's are sent from
        # inside its handler, before any middleware sees the response.
        app.on_response_prepare.append(self._response_headers)
        app.router.add_get("/metrics", metrics_handler(self.metrics.registry))
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)  # ids may hold '/' (sent as %2F)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.get_version)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.get_tokenizer_info)
        app.router.add_get("/openapi.json", openapi_handler)  # services/openapi.py: the bodies' schemas
        app.router.add_get("/docs", docs_handler)
        return app

    async def _response_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[REQUEST_ID_HEADER] = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        origin = request.headers.get("Origin")
        if origin and self.cors.allows(origin) and "Access-Control-Allow-Origin" not in response.headers:
            response.headers.update(self.cors.response_headers(origin))

    @web.middleware
    async def _preflight(self, request: web.Request, handler):
        """A browser's CORS preflight from an allowed origin, answered for any path without the API
        key (browsers never send credentials on one); anything else goes on as usual."""
        origin, method = request.headers.get("Origin"), request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or not method or not origin or not self.cors.allows(origin):
            return await handler(request)
        headers = self.cors.preflight_headers(origin, method, request.headers.get("Access-Control-Request-Headers", ""))
        if headers is None:
            return json_error(400, f"CORS preflight: {method} or a requested header is not allowed",
                              code="cors_not_allowed")
        return web.Response(status=204, headers=headers)

    @web.middleware
    async def _count(self, request: web.Request, handler):
        """Every request lands in gateway_requests{route, status}; a client that left counts as 499."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        if route == "/metrics":
            return await handler(request)
        start = time.perf_counter()
        status = "500"
        try:
            response = await handler(request)
            status = str(response.status)
            return response
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        except ConnectionResetError:  # a stream write found the client gone: normal, not a server error
            status = CLIENT_CLOSED
            return web.Response(status=499)  # aiohttp drops it quietly: the transport is closing
        finally:
            self.metrics.record(route, status, time.perf_counter() - start)

    @web.middleware
    async def _release_heap_after_large_bodies(self, request: web.Request, handler):
        try:
            return await handler(request)
        finally:
            if (request.content_length or 0) > TRIM_AFTER_BODY_BYTES:
                release_free_heap()

    @web.middleware
    async def _errors_and_auth(self, request: web.Request, handler):
        if (self.api_key and request.path not in _UNPROTECTED
                and request.headers.get("Authorization", "") != f"Bearer {self.api_key}"):
            return json_error(401, "invalid or missing API key", code="invalid_api_key")
        try:
            return await handler(request)
        except BadRequest as e:
            return json_error(400, str(e), param=e.param, code=e.code)
        except ModelNotFound as e:
            return json_error(404, str(e), param="model", code="model_not_found")
        except UpstreamError as e:
            return upstream_error_response(e)
        except web.HTTPRequestEntityTooLarge:
            return self._body_too_large()
        except web.HTTPRequestTimeout:
            return await self._body_timed_out(request)
        except web.HTTPException as e:  # 404 / 405 from routing: keep the status, OpenAI-style body
            return json_error(e.status, e.reason, code=e.reason.lower().replace(" ", "_"))

    def _body_too_large(self) -> web.Response:
        return json_error(413, f"the request body exceeds {self.limits.max_body_bytes} bytes (--max-body-bytes)",
                          code="body_too_large")

    async def _body_timed_out(self, request: web.Request) -> web.Response:
        """The 408, sent whole, then the connection closed: aiohttp would otherwise linger reading
        the rest of the body (up to 10 s), which a slow client keeps trickling."""
        response = json_error(408, f"the request body did not arrive within {self.limits.body_read_timeout_s} s "
                                   "(--body-read-timeout)", code="request_timeout")
        response.force_close()
        await response.prepare(request)
        await response.write_eof()
        if request.transport is not None:
            request.transport.close()
        return response

    async def _json_body(self, request: web.Request) -> dict:
        limit = self.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        try:
            async with asyncio.timeout(self.limits.body_read_timeout_s):
                raw = await request.read()  # a chunked body is cut off at client_max_size
        except TimeoutError:
            raise web.HTTPRequestTimeout() from None
        try:
            text = raw.decode("utf-8-sig")  # strict: invalid bytes and encoded lone surrogates fail here
            body = json.loads(text)
            if _SURROGATE_ESCAPE.search(text):  # \ud800 escapes: pairs are fine, a lone one cannot be encoded
                json.dumps(body, ensure_ascii=False).encode()
        except UnicodeError as e:
            raise BadRequest(f"the body is not valid UTF-8: {e}") from None
        except (json.JSONDecodeError, RecursionError) as e:
            raise BadRequest(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        check_batch_size(body, self.limits.max_sequences_per_request)
        try:
            check_json_shape(body, "the body")
        except JsonLimitError as e:
            raise BadRequest(str(e), code="json_too_deep_or_long") from None
        validate_body(request.path, body)  # the route's published schema (services/openapi.py)
        return body

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ModelNotFound(model, self.model_name)

    # -- generation ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        return await self._generate(request, parse_completion(body, self.tokenizer, self.max_model_len))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        return await self._generate(request, parse_chat(body, self.tokenizer, self.max_model_len,
                                                        self.tool_call_parser))

    async def _generate(self, request: web.Request, req: GenerationRequest) -> web.StreamResponse:
        self._check_model(req.model)
        if self.tracer is None:
            return await self._generate_untraced(request, req)
        with self.tracer.start_as_current_span(f"{request.method} {request.path}", kind=trace.SpanKind.SERVER,
                                               attributes={"http.route": request.path,
                                                           "gen_ai.request.model": self.model_name}):
            return await self._generate_untraced(request, req)

    async def _generate_untraced(self, request: web.Request, req: GenerationRequest) -> web.StreamResponse:
        request_id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.prompt_log.log(request_id, req.prompts, self.tokenizer)
        n = req.params.n
        builder = ResponseBuilder(request_id, self.model_name, req.output, self.tokenizer, req.prompts, n,
                                  req.prompt_texts)
        streams = [stream_text(self.client, self.tokenizer, prompt, req.params, f"{request_id}-{i}",
                               self.model_name, req.priority, req.cache_salt) for i, prompt in enumerate(req.prompts)]
        merged = _merge(streams)
        try:
            try:
                # Every prompt admitted (or the first refusal raised) before the response starts.
                first_updates = await merged.__anext__()
                if req.params.structured_outputs is not None:
                    first_updates = await _until_first_tokens(first_updates, merged, req)
            except UpstreamError as e:
                # A worker refusing a grammar names the engine's field; the client named its own (a
                # refusal may come before or after the request is admitted).
                if e.param == "structured_outputs" and req.constraint_field:
                    e.param = req.constraint_field
                raise
            if req.stream:
                return await self._stream(request, builder, req, merged, first_updates)
            choices: dict[int, list[TextDelta]] = {}
            usage = Usage(prompt_tokens=0)
            async for prompt_index, update in _chain(first_updates, merged):
                if update.prompt_logprobs:
                    builder.prompt_logprobs[prompt_index] = update.prompt_logprobs
                for delta in update.deltas:
                    choices.setdefault(prompt_index * n + delta.index, []).append(delta)
                if update.usage is not None:
                    _add_usage(usage, update.usage)
            _trace_usage(usage)
            return web.json_response(builder.full(choices, usage))
        finally:
            await merged.aclose()

    async def _stream(self, request: web.Request, builder: ResponseBuilder, req: GenerationRequest,
                      merged: AsyncIterator[tuple[int, StreamUpdate]], first_updates: list) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        n = req.params.n
        started: set[int] = set()
        usage = Usage(prompt_tokens=0)
        try:
            async for prompt_index, update in _chain(first_updates, merged):
                if update.prompt_logprobs:
                    builder.prompt_logprobs[prompt_index] = update.prompt_logprobs
                events = []
                for delta in update.deltas:
                    index = prompt_index * n + delta.index
                    events.append(builder.chunk(index, delta, first=index not in started))
                    started.add(index)
                if update.usage is not None:
                    _add_usage(usage, update.usage)
                if events:
                    await response.write("".join(f"data: {json.dumps(e)}\n\n" for e in events).encode())
        except UpstreamError as e:  # failed after the stream began: report it in-band
            payload = error_body(e.message, "server_error", code=e.code.name.lower())
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())
        else:
            _trace_usage(usage)
            if req.include_usage:
                await response.write(f"data: {json.dumps(builder.usage_chunk(usage))}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # -- the rest ----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        models = await self.client.list_models()
        return web.json_response({"object": "list", "data": [model_card(m) for m in models]})

    async def model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        models = await self.client.list_models()
        card = next((model_card(m) for m in models if m.id == model_id), None)
        if card is None:
            raise ModelNotFound(model_id, ", ".join(m.id for m in models))
        return web.json_response(card)

    async def get_version(self, request: web.Request) -> web.Response:
        return web.json_response(self._version_body)

    async def get_tokenizer_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._tokenizer_info_body)

    async def health(self, request: web.Request) -> web.Response:
        if await self.client.ready():
            return web.json_response({"status": "ok"})
        return json_error(503, "no worker is ready behind the scheduler", "server_error", code="unavailable")

    async def tokenize(self, request: web.Request) -> web.Response:
        from metroserve.common.chat import ChatTemplateOptions, chat_prompt_ids

        body = await self._json_body(request)
        self._check_model(body.get("model") or "")
        if "messages" in body:
            try:
                tokens = chat_prompt_ids(self.tokenizer, parse_messages(body), ChatTemplateOptions(
                    add_generation_prompt=body.get("add_generation_prompt") is not False))
            except ValueError as e:
                raise BadRequest(str(e), param="messages") from None
            except Exception as e:  # the template itself raised (e.g. a role it does not allow)
                raise BadRequest(f"the chat template rejected these messages: {e}", param="messages") from None
        elif isinstance(body.get("prompt"), str):
            tokens = self.tokenizer.encode(body["prompt"],
                                           add_special_tokens=bool(body.get("add_special_tokens", True)))
        else:
            raise BadRequest("give 'prompt' (a string) or 'messages'", param="prompt")
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        tokens = body.get("tokens")
        vocab = len(self.tokenizer)
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in tokens):
            raise BadRequest(f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})


def _trace_usage(usage: Usage) -> None:
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                             "gen_ai.usage.output_tokens": usage.completion_tokens,
                             "metroserve.cached_tokens": usage.cached_tokens})


def _add_usage(total: Usage, part: Usage) -> None:
    total.prompt_tokens += part.prompt_tokens
    total.completion_tokens += part.completion_tokens
    total.cached_tokens += part.cached_tokens


async def _until_first_tokens(first: list, rest: AsyncIterator, req: GenerationRequest) -> list:
    """A constrained request's grammar is compiled by its worker, which refuses one the grammar engine
    rejects: wait for every prompt's first output (or that refusal, raised) before the response
    starts."""
    updates = list(first)
    waiting = set(range(len(req.prompts)))
    while waiting:
        item = await anext(rest, None)
        if item is None:
            break
        updates.append(item)
        if item[1].deltas or item[1].usage is not None:
            waiting.discard(item[0])
    return updates


async def _chain(first: list, rest: AsyncIterator) -> AsyncIterator[tuple[int, StreamUpdate]]:
    for item in first:
        yield item
    async for item in rest:
        yield item


async def _merge(streams: list[AsyncGenerator[StreamUpdate, None]]) -> AsyncGenerator[Any, None]:
    """Interleave several prompts' streams. The first item is a list: each stream's first update
    (so every refusal surfaces before the response starts); then (prompt index, update) pairs."""
    if len(streams) == 1:  # the common case, without tasks
        stream = streams[0]
        try:
            first = await anext(stream, None)
            if first is None:
                raise UpstreamError(grpc.StatusCode.INTERNAL, "the request ended without output")
            yield [(0, first)]
            async for update in stream:
                yield 0, update
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[StreamUpdate]) -> None:
        try:
            async for update in stream:
                await queue.put((index, update))
        except BaseException as e:
            await queue.put((index, e))
            raise
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        firsts: list[tuple[int, StreamUpdate]] = []
        seen: set[int] = set()
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if len(seen) < len(streams):
                firsts.append((index, item))
                seen.add(index)
                if len(seen) == len(streams):
                    yield firsts
                continue
            yield index, item
        if len(seen) < len(streams):
            yield firsts
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
