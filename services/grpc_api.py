"""The gateway's public gRPC API: Generation with text or token ids in, token ids and text out.

Same path as REST: tokenize here, submit token ids to the cluster, detokenize the workers' tokens
and apply stop strings (services/text_stream.py). A cancelled call aborts the request upstream.
An unknown model is NOT_FOUND, as REST's 404. Bytes that do not parse as the method's request
message are INVALID_ARGUMENT (add_generation_servicer): grpc's own answer would be UNKNOWN, its
"server error".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace

from metroserve.rpc import GENERATION_SERVICE, PARAM_METADATA_KEY, generation_pb2, generation_pb2_grpc
from metroserve.rpc.convert import params_from_proto
from metroserve.services.cluster_client import ClusterClient, UpstreamError
from metroserve.services.gateway_metrics import CLIENT_CLOSED, GatewayMetrics
from metroserve.services.prompt_log import PromptLog
from metroserve.services.text_stream import stream_text
from metroserve.services.tracing import tracer

GENERATE_ROUTE = "grpc:/metroserve.v1.Generation/Generate"
# Open without the API key: health, for probes; reflection, so grpcurl can list and describe the
# services without one. Reflection tells only the schema, which proto/ publishes anyway; every
# Generation call still needs the key.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <key>` metadata; health and reflection stay open."""

    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if metadata.get("authorization") == self._expected:
            return await continuation(details)
        return self._deny_stream if details.method.endswith("/Generate") else self._deny


class GatewayGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self, client: ClusterClient, tokenizer, model_name: str, metrics: GatewayMetrics,
                 prompt_log: PromptLog | None = None):
        self.client = client
        self.prompt_log = prompt_log or PromptLog()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.tracer = tracer("metroserve.gateway")

    async def Generate(self, request, context):
        """Counted in gateway_requests under the gRPC status code name; traced like a REST call."""
        start = time.perf_counter()
        status = "OK"
        span = contextlib.nullcontext() if self.tracer is None else self.tracer.start_as_current_span(
            "metroserve.v1.Generation/Generate", kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "gen_ai.request.model": self.model_name})
        try:
            with span:
                async for msg in self._generate(request, context):
                    yield msg
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        except BaseException:
            status = context.code().name if context.code() is not None else "UNKNOWN"
            raise
        finally:
            self.metrics.record(GENERATE_ROUTE, status, time.perf_counter() - start)

    async def _generate(self, request, context):
        if request is None:
            await _malformed(context, "GenerateRequest")
        if request.model and request.model != self.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model {request.model!r} does not exist; this server serves {self.model_name!r}")
        kind = request.WhichOneof("prompt")
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give a prompt: text or token_ids")
        prompt = self.tokenizer.encode(request.text) if kind == "text" else list(request.token_ids.ids)
        try:
            params = params_from_proto(request.params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        self.prompt_log.log(request_id, [prompt], self.tokenizer)
        stream = stream_text(self.client, self.tokenizer, prompt, params, request_id, self.model_name,
                             request.priority, request.cache_salt or None)
        try:
            first = True  # the first update is the admission acknowledgment, passed on as is
            async for update in stream:
                if not (first or update.deltas or update.usage):
                    continue
                first = False
                msg = generation_pb2.GenerateResponse(request_id=request_id, prompt_logprobs=update.prompt_logprobs)
                for d in update.deltas:
                    delta = msg.outputs.add(index=d.index, token_ids=d.token_ids, text=d.text, logprobs=d.logprobs,
                                            finish_reason=d.finish_reason or "")
                    if isinstance(d.stop_reason, str):
                        delta.stop_str = d.stop_reason
                    elif isinstance(d.stop_reason, int):
                        delta.stop_token_id = d.stop_reason
                if update.usage is not None:
                    msg.usage.prompt_tokens = update.usage.prompt_tokens
                    msg.usage.completion_tokens = update.usage.completion_tokens
                    msg.usage.cached_tokens = update.usage.cached_tokens
                yield msg
        except UpstreamError as e:
            trailers = [(k, v) for k, v in (("retry-after", e.retry_after), (PARAM_METADATA_KEY, e.param)) if v]
            if trailers:
                context.set_trailing_metadata(tuple(trailers))
            await context.abort(e.code, e.message)
        finally:
            await stream.aclose()

    async def Abort(self, request, context):
        if request is None:
            await _malformed(context, "AbortRequest")
        if request.ended:  # how sequences ended is the gateway's report to the scheduler, not a client's
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ended: not accepted from clients")
        return generation_pb2.AbortResponse(found=await self.client.abort(request.request_id))

    async def ListModels(self, request, context):
        if request is None:
            await _malformed(context, "ListModelsRequest")
        try:
            return generation_pb2.ListModelsResponse(models=await self.client.list_models())
        except UpstreamError as e:
            await context.abort(e.code, e.message)


async def _malformed(context, message: str) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request bytes are not a {message} message")


def _tolerant(message_cls) -> Callable[[bytes], Any]:
    """A request deserializer that yields None for bytes that do not parse; the handler refuses it."""
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError:
            return None
    return parse


def add_generation_servicer(servicer: GatewayGeneration, server) -> None:
    """generation_pb2_grpc.add_GenerationServicer_to_server, with tolerant request deserializers."""
    pb = generation_pb2
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_tolerant(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=_tolerant(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=_tolerant(pb.ListModelsRequest),
            response_serializer=pb.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers),))
    server.add_registered_method_handlers(GENERATION_SERVICE, handlers)
