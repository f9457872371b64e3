"""The gateway's side of the cluster: a control stream to the scheduler, token streams from the workers.

A gateway owns its requests. It submits each to the scheduler over one GatewayHub stream (with
every other submission, abort and completion of the moment, in one message) and gets back a
refusal, or "admitted" (at once if the request waits in the scheduler's queue, within about a
second if it was placed). Their tokens do not come back that way: the gateway subscribes to every
worker's TokenStream (the scheduler keeps it told which workers exist), and each worker sends the
output of this gateway's placements there, one TokenBatch per engine step. A request placed at
once is usually admitted by its worker's first output, before the scheduler's word.

When a request's last token arrives, the gateway tells the scheduler (a Completion: the slots are
free). It does so with its next submission, or after COMPLETION_DELAY_S, so a busy gateway's
completions cost the scheduler no message of their own; while requests wait in the scheduler's
queue (it says so), at once.

What this side keeps per request is what the scheduler does not: the tokens delivered per
sequence. So when a placement must move (its worker died or handed it back), the scheduler asks
here (ResumeQuery), this side answers with those tokens and from then on drops any late output of
the old placement; the new placement continues from exactly what the client has. And when the
scheduler restarts, this side keeps streaming, redials, and reports every request it owns
(GatewayRegister.in_flight), from which the new scheduler rebuilds them. A request that arrives
while no scheduler answers waits up to `scheduler_wait_s`, then fails as UNAVAILABLE (HTTP 503
with Retry-After).

All of it runs on the gateway's event loop; no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import grpc

from metroserve.rpc import GRPC_OPTIONS, cluster_pb2, cluster_pb2_grpc, generation_pb2
from metroserve.rpc.auth import ClusterCredentials, open_channel
from metroserve.services.tracing import inject_context, tracer

logger = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.5
RETRY_AFTER_S = "1"
# How long a completion may wait to ride with a submission while no request waits for a slot.
# Meanwhile the scheduler counts the slots busy, which matters only if they would take a request:
# then the queue fills, the scheduler says so, and completions go at once. Long enough that a
# gateway with a few submissions a second sends few completions alone (at 0.1 s, each of two
# gateways sharing 20 requests a second sent about half of them alone, a scheduler wakeup each);
# the Completion says how long it was held, so the scheduler's timings do not include the wait.
COMPLETION_DELAY_S = 0.5


@dataclass
class UpstreamError(Exception):
    """The cluster refused or failed a request; the REST and gRPC layers map `code` to a status."""

    code: grpc.StatusCode
    message: str
    retry_after: str | None = None
    param: str | None = None  # the request field at fault, when the scheduler named one

    def __str__(self) -> str:
        return self.message


@dataclass
class OwnedRequest:
    submission: cluster_pb2.Submission
    admitted: asyncio.Future  # True, or the refusal
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # GenerateResponse, or an UpstreamError
    tokens: list[list[int]] = field(default_factory=list)  # per sequence: delivered so far
    finish_reasons: list[str] = field(default_factory=list)  # per sequence: "" while running
    retired: set[str] = field(default_factory=set)  # placements moved away: late output dropped
    num_cached_tokens: int | None = None  # from the first output
    got_prompt_logprobs: bool = False  # a migrated placement's worker computes them again: keep the first
    ended: bool = False  # finished, or aborted from here: nothing more to tell the scheduler

    @property
    def request(self) -> generation_pb2.GenerateRequest:
        return self.submission.request


class ClusterClient:
    def __init__(self, scheduler: str, credentials: ClusterCredentials, gateway_id: str | None = None,
                 scheduler_wait_s: float = 30.0):
        self.scheduler = scheduler
        self.credentials = credentials
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.scheduler_wait_s = scheduler_wait_s
        self._requests: dict[str, OwnedRequest] = {}
        self._submit: list[cluster_pb2.Submission] = []
        self._abort: list[generation_pb2.AbortRequest] = []
        self._resume: list[cluster_pb2.ResumeState] = []
        self._completed: list[tuple[cluster_pb2.Completion, float]] = []  # with when each request ended
        self._completion_timer: asyncio.TimerHandle | None = None
        self._requests_waiting = False  # as the scheduler last said
        self._wakeup = asyncio.Event()
        self._connected = False
        self._models: list[generation_pb2.ModelInfo] = []
        self._workers: dict[tuple[str, int], asyncio.Task] = {}  # (worker id, epoch) -> its token stream
        self._listed: set[tuple[str, int]] = set()  # the workers the scheduler lists now
        self._control: asyncio.Task | None = None
        self._session = 0  # the current control stream
        self._tracing = tracer("metroserve.gateway") is not None

    def start(self) -> None:
        self._control = asyncio.ensure_future(self._control_loop())

    # -- requests ----------------------------------------------------------------------------

    async def generate(self, request: generation_pb2.GenerateRequest,
                       ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """Yields an admission acknowledgment (no tokens), then the request's output as it comes,
        the last message with usage. Raises UpstreamError before yielding anything if the request is
        refused, so callers can still answer with an error status. Closing the iterator early aborts
        the request."""
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise UpstreamError(grpc.StatusCode.INVALID_ARGUMENT, f"request id {request_id!r} is already in use")
        request.request_id = request_id
        # The caller's span (if tracing) travels to the scheduler as W3C trace context.
        submission = cluster_pb2.Submission(request=request, trace_context=inject_context() if self._tracing else {})
        n = request.params.n if request.params.HasField("n") else 1
        owned = OwnedRequest(submission, asyncio.get_running_loop().create_future(),
                             tokens=[[] for _ in range(n)], finish_reasons=[""] * n)
        self._requests[request_id] = owned
        self._submit.append(submission)
        self._wakeup.set()
        try:
            try:
                await asyncio.wait_for(asyncio.shield(owned.admitted), self.scheduler_wait_s)
            except TimeoutError:
                raise UpstreamError(grpc.StatusCode.UNAVAILABLE, f"the scheduler did not answer in "
                                    f"{self.scheduler_wait_s:g} s", RETRY_AFTER_S) from None
            yield generation_pb2.GenerateResponse(request_id=request_id)
            while True:
                item = await owned.events.get()
                if isinstance(item, UpstreamError):
                    owned.ended = True
                    raise item
                yield item
                if item.HasField("usage"):
                    return
        finally:
            self._requests.pop(request_id, None)
            unsent = any(s is submission for s in self._submit)
            self._submit = [s for s in self._submit if s is not submission]
            refused = owned.admitted.done() and owned.admitted.exception() is not None
            if not owned.ended and not unsent and not refused:  # admitted, or sent and not answered yet
                self._queue_abort(owned, [generation_pb2.SequenceEnd(index=i, finish_reason="abort", num_tokens=len(t))
                                          for i, t in enumerate(owned.tokens) if not owned.finish_reasons[i]])

    async def abort(self, request_id: str, ended: Sequence[generation_pb2.SequenceEnd] = ()) -> bool:
        """End a request this gateway owns; `ended`: sequences a stop string ended here, with the
        tokens their client got (the rest end as "abort"). False if it is not running here."""
        owned = self._requests.get(request_id)
        if owned is None or owned.ended:
            return False
        self._queue_abort(owned, ended)
        return True

    def _queue_abort(self, owned: OwnedRequest, ended: Sequence[generation_pb2.SequenceEnd]) -> None:
        owned.ended = True
        self._abort.append(generation_pb2.AbortRequest(request_id=owned.request.request_id, ended=ended))
        self._wakeup.set()

    async def list_models(self) -> list[generation_pb2.ModelInfo]:
        if not self._models:
            raise UpstreamError(grpc.StatusCode.UNAVAILABLE, "no worker is available", RETRY_AFTER_S)
        return list(self._models)

    async def ready(self) -> bool:
        """Connected to the scheduler, with at least one worker behind it."""
        return self._connected and bool(self._listed)

    async def close(self) -> None:
        self._listed = set()
        tasks = [t for t in (self._control, *self._workers.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- the control stream ------------------------------------------------------------------

    async def _control_loop(self) -> None:
        while True:
            try:
                async with open_channel(self.scheduler, self.credentials, GRPC_OPTIONS) as channel:
                    self._session += 1
                    call = cluster_pb2_grpc.GatewayHubStub(channel).Connect(self._outgoing(self._session))
                    async for msg in call:
                        self._connected = True
                        self._handle(msg)
            except grpc.aio.AioRpcError as e:
                if self._connected:
                    logger.warning("scheduler stream at %s: %s", self.scheduler, e.details() or e.code())
            self._connected = False
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _outgoing(self, session: int):
        # Every request owned, submitted before or not: a restarted scheduler rebuilds them from
        # this; aborts and answers meant for the previous stream are moot (an unreported request
        # is over for the scheduler; it asks again for what it still needs).
        in_flight = [o.submission for o in self._requests.values() if not o.ended]
        self._submit, self._abort, self._resume, self._completed = [], [], [], []
        yield cluster_pb2.GatewayMessage(register=cluster_pb2.GatewayRegister(gateway_id=self.gateway_id,
                                                                              in_flight=in_flight))
        while True:
            await self._wakeup.wait()
            if session != self._session:
                return  # a dead call's iterator, which grpc may still run: it must not take messages
            self._wakeup.clear()
            if not (self._submit or self._abort or self._resume or self._completed):
                continue
            now = asyncio.get_running_loop().time()
            for completion, ended in self._completed:
                completion.held_s = now - ended
            msg = cluster_pb2.GatewayMessage(submit=self._submit, abort=self._abort, resume=self._resume,
                                             completed=[completion for completion, _ in self._completed])
            self._submit, self._abort, self._resume, self._completed = [], [], [], []
            if self._completion_timer is not None:
                self._completion_timer.cancel()
                self._completion_timer = None
            yield msg

    def _handle(self, msg: cluster_pb2.GatewayControl) -> None:
        for status in msg.status:
            self._on_status(status)
        for query in msg.resume:
            self._on_resume_query(query)
        if msg.HasField("requests_waiting"):
            self._requests_waiting = msg.requests_waiting
            if self._requests_waiting and self._completed:
                self._wakeup.set()
        if msg.workers_changed:
            self._models = list(msg.models)
            self._subscribe_to(msg.workers)

    def _on_status(self, status: cluster_pb2.RequestStatus) -> None:
        owned = self._requests.get(status.request_id)
        if owned is None:
            return
        if not status.code:
            if not owned.admitted.done():
                owned.admitted.set_result(True)
            return
        error = UpstreamError(grpc.StatusCode[status.code], status.message,
                              str(status.retry_after_s) if status.retry_after_s else None, status.param or None)
        if not owned.admitted.done():
            owned.admitted.set_exception(error)
        else:
            owned.events.put_nowait(error)

    def _on_resume_query(self, query: cluster_pb2.ResumeQuery) -> None:
        owned = self._requests.get(query.request_id)
        indices = range(query.base_index, query.base_index + query.num_seqs)
        if owned is None or owned.ended:  # over here: nothing to continue
            self._resume.append(cluster_pb2.ResumeState(placement_id=query.placement_id,
                                                        finish_reasons=["abort"] * query.num_seqs))
        else:
            owned.retired.add(query.placement_id)
            self._resume.append(cluster_pb2.ResumeState(
                placement_id=query.placement_id, tokens=[generation_pb2.TokenIds(ids=owned.tokens[i]) for i in indices],
                finish_reasons=[owned.finish_reasons[i] for i in indices]))
        self._wakeup.set()

    def _complete(self, owned: OwnedRequest) -> None:
        """Every sequence ended here: tell the scheduler, now if requests wait, else with the next
        submission or after COMPLETION_DELAY_S."""
        self._completed.append((cluster_pb2.Completion(
            request_id=owned.request.request_id, finish_reasons=owned.finish_reasons,
            num_tokens=[len(t) for t in owned.tokens], num_cached_tokens=owned.num_cached_tokens or 0),
            asyncio.get_running_loop().time()))
        if self._requests_waiting:
            self._wakeup.set()
        elif self._completion_timer is None:
            self._completion_timer = asyncio.get_running_loop().call_later(COMPLETION_DELAY_S, self._flush_completions)

    def _flush_completions(self) -> None:
        self._completion_timer = None
        self._wakeup.set()

    def _lost_output(self, owned: OwnedRequest) -> None:
        """Output of the request was lost on its way here (a token stream broke mid-message): the
        request fails rather than show its client a text with a hole in it."""
        self._queue_abort(owned, [])
        owned.events.put_nowait(UpstreamError(grpc.StatusCode.INTERNAL, "output from the worker was lost in transit; "
                                              "the request was aborted"))

    # -- the token streams -------------------------------------------------------------------

    def _subscribe_to(self, endpoints: Sequence[cluster_pb2.WorkerEndpoint]) -> None:
        """Subscribe to every worker listed. A stream is never cut because a worker is not listed:
        a restarted scheduler lists workers as they come back, and a batch in flight on a cut stream
        would be lost. A stream ends when it breaks and its worker is no longer listed."""
        self._listed = {(e.worker_id, e.epoch) for e in endpoints}
        for endpoint in endpoints:
            key = (endpoint.worker_id, endpoint.epoch)
            if key not in self._workers:
                self._workers[key] = asyncio.ensure_future(self._token_stream(key, endpoint.address))

    async def _token_stream(self, key: tuple[str, int], address: str) -> None:
        """Subscribe to one worker's tokens, and again whenever the stream breaks while the
        scheduler lists the worker."""
        try:
            while True:
                try:
                    async with open_channel(address, self.credentials, GRPC_OPTIONS) as channel:
                        call = cluster_pb2_grpc.TokenStreamStub(channel).Subscribe(
                            cluster_pb2.Subscription(gateway_id=self.gateway_id))
                        async for batch in call:
                            self._deliver(batch)
                except grpc.aio.AioRpcError as e:
                    logger.info("token stream of %s at %s: %s", key[0], address, e.details() or e.code())
                if key not in self._listed:
                    return
                await asyncio.sleep(RECONNECT_DELAY_S)
        finally:
            self._workers.pop(key, None)

    def _deliver(self, batch: cluster_pb2.TokenBatch) -> None:
        for out in batch.outputs:
            owned = self._requests.get(out.request_id)
            if owned is None or owned.ended or out.placement_id in owned.retired:
                continue
            if not owned.admitted.done():  # placed at once: the scheduler's word comes later
                owned.admitted.set_result(True)
            if not out.seqs:  # the worker took the placement; no output yet
                continue
            msg = generation_pb2.GenerateResponse(request_id=out.request_id)
            if owned.num_cached_tokens is None:
                owned.num_cached_tokens = msg.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs and not owned.got_prompt_logprobs:
                owned.got_prompt_logprobs = True
                msg.prompt_logprobs.extend(out.prompt_logprobs)
            for delta, count in zip(out.seqs, out.num_tokens, strict=True):
                index = out.base_index + delta.index
                if owned.finish_reasons[index]:
                    continue
                if len(owned.tokens[index]) + len(delta.token_ids) != count:  # a batch never arrived
                    self._lost_output(owned)
                    break
                owned.tokens[index].extend(delta.token_ids)
                owned.finish_reasons[index] = delta.finish_reason
                delta.index = index
                msg.outputs.append(delta)
            if owned.ended:
                continue
            if all(owned.finish_reasons):
                owned.ended = True
                self._complete(owned)
                msg.usage.CopyFrom(generation_pb2.Usage(
                    prompt_tokens=len(owned.request.token_ids.ids), completion_tokens=sum(map(len, owned.tokens)),
                    cached_tokens=owned.num_cached_tokens or 0))
            if msg.outputs or msg.HasField("usage"):
                owned.events.put_nowait(msg)
