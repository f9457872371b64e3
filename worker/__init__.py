"""The engine a worker process runs. ``from metroserve.worker import LLM, SamplingParams``.

Exports resolve lazily so torch-free pieces (sampling params, the detokenizer)
can be imported by the gateway without loading torch.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "metroserve.worker.llm",
    "SamplingParams": "metroserve.common.sampling_params",
    "LLMEngine": "metroserve.worker.engine",
    "AsyncEngine": "metroserve.worker.async_engine",
    "EngineConfig": "metroserve.worker.config",
    "RequestOutput": "metroserve.worker.outputs",
    "CompletionOutput": "metroserve.worker.outputs",
    "ModelLoadError": "metroserve.worker.model_files",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'metroserve.worker' has no attribute {name!r}")
