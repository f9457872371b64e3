"""The gateway's connection to the scheduler: one gRPC channel, one server stream per request."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metroserve.rpc import GENERATION_SERVICE, GRPC_OPTIONS, PARAM_METADATA_KEY, generation_pb2, generation_pb2_grpc
from metroserve.services.tracing import inject_context, tracer


@dataclass
class UpstreamError(Exception):
    """The scheduler refused or failed a request; the REST and gRPC layers map `code` to a status."""

    code: grpc.StatusCode
    message: str
    retry_after: str | None = None
    param: str | None = None  # the request field at fault, when the scheduler named one

    def __str__(self) -> str:
        return self.message


def _upstream_error(e: grpc.aio.AioRpcError) -> UpstreamError:
    trailers = dict(e.trailing_metadata() or ())
    retry_after = trailers.get("retry-after")
    message = e.details() or e.code().name
    if e.code() == grpc.StatusCode.UNAVAILABLE and "no worker" not in message:
        message = f"the scheduler is unavailable: {message}"
    return UpstreamError(e.code(), message, retry_after, trailers.get(PARAM_METADATA_KEY))


class SchedulerClient:
    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._tracing = tracer("metroserve.gateway") is not None

    async def generate(self, request: generation_pb2.GenerateRequest,
                       ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """Yields the scheduler's messages, the first being its admission acknowledgment (no tokens).

        Raises UpstreamError before yielding anything if the request is refused, so callers can
        still answer with an error status. Closing the iterator early cancels the call, which
        aborts the request down to the worker.
        """
        # The caller's span (if tracing) travels as W3C traceparent metadata.
        metadata = tuple(inject_context().items()) if self._tracing else None
        call = self._stub.Generate(request, metadata=metadata or None)
        try:
            try:
                ack = await call.read()
            except grpc.aio.AioRpcError as e:
                raise _upstream_error(e) from None
            if ack is grpc.aio.EOF:
                raise UpstreamError(grpc.StatusCode.INTERNAL, "the scheduler closed the stream at once")
            yield ack
            while True:
                try:
                    msg = await call.read()
                except grpc.aio.AioRpcError as e:
                    raise _upstream_error(e) from None
                if msg is grpc.aio.EOF:
                    return
                yield msg
        finally:
            call.cancel()  # no-op once the call is done

    async def abort(self, request_id: str, ended: Sequence[generation_pb2.SequenceEnd] = ()) -> bool:
        """End a request; `ended`: sequences a stop string ended here (the rest end as "abort")."""
        return (await self._stub.Abort(generation_pb2.AbortRequest(request_id=request_id, ended=ended))).found

    async def list_models(self) -> list[generation_pb2.ModelInfo]:
        try:
            return list((await self._stub.ListModels(generation_pb2.ListModelsRequest(), timeout=5)).models)
        except grpc.aio.AioRpcError as e:
            raise _upstream_error(e) from None

    async def ready(self) -> bool:
        """At least one worker is serving behind the scheduler."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE),
                                             timeout=3)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()
