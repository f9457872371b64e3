"""AsyncEngine: the LLMEngine behind asyncio, for the worker service.

One background task owns the engine. Steps run in a dedicated thread so the event loop stays
free for I/O; requests and aborts queue up on the loop and are applied between steps, so the
engine is only ever touched by one step at a time. Each generate() call is an async iterator of
incremental outputs (delta=True: only new tokens and text per item). Leaving the iterator early
(client gone, task cancelled) aborts the request, which frees its blocks before the next step.

The worker service uses the batched form instead: submit() queues a request without a stream of
its own, and after every step the StepSink gets one StepResult: all submitted requests' deltas,
the KV block events and the engine's stats, so one step's output for hundreds of sequences
becomes one message and the service never reads the engine's internals. Requests and aborts reach
the step loop as typed commands (AddCommand, AbortCommand).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from metroserve.common.block_hash import BlockHash
from metroserve.common.request_limits import RequestLimits
from metroserve.common.sampling_params import SamplingParams
from metroserve.worker.config import EngineConfig
from metroserve.worker.engine import LLMEngine
from metroserve.worker.metrics import EngineCollector, EngineStats
from metroserve.worker.outputs import RequestOutput, make_request_output
from metroserve.worker.sequence import Request
from metroserve.worker.step_sink import EngineDeadError, StepResult, StepSink

logger = logging.getLogger(__name__)


@dataclass
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    resume_token_ids: list[int] = field(default_factory=list)  # output produced before a migration
    prompt: str | None = None  # the text, when the caller gave text


@dataclass
class AbortCommand:
    request_id: str
    finish_reasons: list[str] = field(default_factory=list)  # per sequence index; missing: "abort"
    num_tokens: list[int] = field(default_factory=list)  # per sequence index: output to keep; missing: all


EngineCommand = AddCommand | AbortCommand


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, detokenize: bool = True, sink: StepSink | None = None,
                 record_block_events: bool = False, step_inline: bool = False, **kwargs):
        self.engine = LLMEngine(config, detokenize=detokenize, record_block_events=record_block_events, **kwargs)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._sink = sink
        # Inline: decode steps run on the event loop's thread, between its other work. For a process
        # whose loop only feeds the engine (the worker), this avoids GIL hand-offs between the two
        # threads in every step. A step that computes prompt tokens still runs in the thread: it can
        # take seconds on a CPU, and meanwhile the loop must send tokens and the worker's heartbeats
        # (inline, a 2,048-token chunk on one slow core outlasted a 3 s heartbeat timeout, and the
        # scheduler declared a healthy worker lost). An application that must stay responsive
        # during every step keeps the thread for all of them.
        self._step_inline = step_inline
        # request id -> (its stream's queue, delta); queue None: a submit()ted request, output to the sink
        self._queues: dict[str, tuple[asyncio.Queue | None, bool]] = {}
        self._pending: list[EngineCommand] = []  # applied between steps, in order
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                       delta: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream outputs for one request; the last one has finished=True (finish_reason "abort" if aborted).

        A bad request raises ValueError on the first iteration, before anything is queued.
        """
        if self._error is not None:
            raise EngineDeadError(f"engine step loop failed: {self._error!r}")
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.engine.tokenize(prompt)
        self.engine.validate_request(token_ids, params)
        wakeup = self._ensure_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (queue, delta)
        self._pending.append(AddCommand(request_id, token_ids, params, priority, cache_salt,
                                        prompt=prompt if isinstance(prompt, str) else None))
        wakeup.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is None:  # aborted before it was ever scheduled
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0,
               cache_salt: str | None = None, resume_token_ids: Sequence[int] = ()) -> None:
        """Queue a request whose outputs go to the sink. The caller (the worker service) passes only
        requests the scheduler admitted against this worker's limits: they are not checked again."""
        if self._error is not None:
            raise EngineDeadError(f"engine step loop failed: {self._error!r}")
        assert request_id not in self._queues, f"request id {request_id!r} is already in use"
        wakeup = self._ensure_loop()
        self._queues[request_id] = (None, True)
        self._pending.append(AddCommand(request_id, prompt_token_ids, params, priority, cache_salt,
                                        list(resume_token_ids)))
        wakeup.set()

    def abort(self, request_id: str, finish_reasons: Sequence[str] = (), num_tokens: Sequence[int] = ()) -> None:
        """End a request: its blocks are freed and its stream ends before the next step runs.
        Per sequence: finish_reasons ("stop" when the gateway found a stop string; default "abort")
        and num_tokens (the output the client got; what was generated past it is dropped)."""
        if request_id in self._queues:
            self._pending.append(AbortCommand(request_id, list(finish_reasons), list(num_tokens)))
            if self._wakeup is not None:
                self._wakeup.set()

    @property
    def limits(self) -> RequestLimits:
        return self.engine.limits

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every block the prefix cache holds now (a worker's first report after connecting)."""
        return self.engine.cached_block_hashes()

    def metrics_collector(self, labels: dict[str, str]) -> EngineCollector | None:
        return EngineCollector(self.engine, labels) if self.engine.metrics is not None else None

    def _ensure_loop(self) -> asyncio.Event:
        """The step loop's wake-up event; starts the loop when none is running."""
        if self._wakeup is None or self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run(self._wakeup))
        return self._wakeup

    def _apply_pending(self) -> list[Request]:
        """Apply queued commands in order; returns the submitted requests they ended."""
        pending, self._pending = self._pending, []
        ended: list[Request] = []
        for command in pending:
            if isinstance(command, AbortCommand):
                entry = self._queues.pop(command.request_id, None)
                request = self.engine.abort_request(command.request_id, command.finish_reasons,
                                                    command.num_tokens)
                if entry is not None and entry[0] is not None:
                    entry[0].put_nowait(make_request_output(request, entry[1]) if request is not None else None)
                elif entry is not None and request is not None:
                    ended.append(request)
                continue
            if command.request_id not in self._queues:
                continue  # aborted before it was ever added
            try:
                request = self.engine.add_request(command.prompt_token_ids, command.params, command.request_id,
                                                  command.priority, command.cache_salt,
                                                  resume_token_ids=command.resume_token_ids, validated=True)
            except Exception as e:  # e.g. a request id reused meanwhile: fail this stream only
                queue = self._queues.pop(command.request_id)[0]
                if queue is None:
                    assert self._sink is not None, "submit()ted requests report to the sink"
                    self._sink.rejected(command.request_id, e)
                else:
                    queue.put_nowait(e)
                continue
            request.prompt = command.prompt
        return ended

    def _publish(self, requests: list[Request], ended: Sequence[Request] = ()) -> Awaitable[None] | None:
        batched = [make_request_output(request, delta=True) for request in ended]
        for request in requests:
            entry = self._queues.get(request.request_id)
            if entry is None:
                continue
            queue, delta = entry
            output = make_request_output(request, delta=delta)
            if queue is None:
                batched.append(output)
            else:
                queue.put_nowait(output)
            if request.finished:
                del self._queues[request.request_id]
        if self._sink is not None:
            stored, removed = self.engine.take_kv_events()
            return self._sink.step_done(StepResult(batched, stored, removed, self.engine.stats()))
        return None

    async def _run(self, wakeup: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                ended = self._apply_pending()
                if ended:  # aborted submitted requests: the sink hears of them before the next step
                    flushed = self._publish([], ended)
                    if flushed is not None:
                        await flushed
                        continue  # commands that came meanwhile are applied before the loop may sleep
                if not self.engine.has_unfinished_requests():
                    wakeup.clear()
                    await wakeup.wait()
                    continue
                if self._step_inline and not self.engine.next_step_computes_prompt():
                    touched = self.engine.step()
                else:
                    touched = await loop.run_in_executor(self._executor, self.engine.step)
                flushed = self._publish(touched)
                if flushed is not None:
                    await flushed
                elif self._step_inline:
                    await asyncio.sleep(0)  # let the loop take new requests between steps
        except asyncio.CancelledError:
            self._fail_all(EngineDeadError("engine shut down"), notify_sink=False)
            raise
        except Exception as e:  # a bug or device failure: fail every stream rather than hang them
            logger.exception("engine step loop failed")
            self._error = e
            self._fail_all(EngineDeadError(f"engine step loop failed: {e!r}"))

    def _fail_all(self, error: EngineDeadError, notify_sink: bool = True) -> None:
        for queue, _ in self._queues.values():
            if queue is not None:
                queue.put_nowait(error)
        self._queues.clear()
        if self._sink is not None and notify_sink:
            self._sink.failed(error)

    async def shutdown(self) -> None:
        """Stop the step loop; open streams end with EngineDeadError."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self._executor.shutdown(wait=True)
