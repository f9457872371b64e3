"""The worker service's view of an engine: what it calls (ServingEngine), what it gets back after
each step (StepResult, through its StepSink) and how an engine fails.

Shared by the real engine (worker/async_engine.py) and the simulated one (worker/mock_engine.py);
torch-free, so a mock worker never loads torch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from metroserve.common.block_hash import BlockHash
from metroserve.common.request_limits import RequestLimits
from metroserve.common.sampling_params import SamplingParams
from metroserve.worker.metrics import EngineStats
from metroserve.worker.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The step loop failed; no request on this engine can make progress."""


@dataclass
class StepResult:
    """What one step (or a batch of aborts between steps) hands the sink."""

    outputs: list[RequestOutput]  # deltas of submitted requests that got tokens or finished
    blocks_stored: list[BlockHash]  # prefix-cache blocks registered since the last result
    blocks_removed: list[BlockHash]  # and evicted
    stats: EngineStats


class StepSink(Protocol):
    """Receives the outputs of submit()ted requests, on the event loop."""

    def step_done(self, result: StepResult) -> Awaitable[None] | None:
        """After every step (outputs may be empty: a step can only advance prefills), and after
        aborts of submitted requests. An awaitable returned here is awaited before the next step:
        the sink's chance to send the outputs first."""

    def rejected(self, request_id: str, error: Exception) -> None: ...

    def failed(self, error: EngineDeadError) -> None:
        """The step loop died; every submitted request is lost."""


class ServingEngine(Protocol):
    """An engine in its batched form: AsyncEngine (the model) or MockEngine (simulated). Every
    method is called on the event loop and returns at once; work happens in the engine's step loop."""

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0,
               cache_salt: str | None = None, resume_token_ids: Sequence[int] = ()) -> None:
        """Queue a request the scheduler validated; its outputs go to the sink."""

    def abort(self, request_id: str, finish_reasons: Sequence[str] = (), num_tokens: Sequence[int] = ()) -> None:
        """End a request before the next step (per sequence: reason, output tokens to keep)."""

    @property
    def limits(self) -> RequestLimits: ...

    def stats(self) -> EngineStats: ...

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every block the prefix cache holds now."""

    def metrics_collector(self, labels: dict[str, str]) -> Any:
        """A prometheus collector of the engine's metrics, or None when it keeps none."""

    async def shutdown(self) -> None: ...
