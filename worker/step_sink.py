"""What an engine driven by the worker service hands back after each step, and how it fails.

Shared by the real engine (worker/async_engine.py) and the simulated one (worker/mock_engine.py);
torch-free, so a mock worker never loads torch.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

from metroserve.common.block_hash import BlockHash
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
