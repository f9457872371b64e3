"""The engine a worker process runs. ``from worker import LLM, SamplingParams``.

Exports resolve lazily so torch-free pieces (``worker.sampling_params``, ``worker.detokenizer``)
can be imported by the gateway without loading torch.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "worker.llm",
    "SamplingParams": "worker.sampling_params",
    "LLMEngine": "worker.engine",
    "AsyncEngine": "worker.async_engine",
    "EngineConfig": "worker.config",
    "RequestOutput": "worker.outputs",
    "CompletionOutput": "worker.outputs",
    "ModelLoadError": "worker.model_files",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
