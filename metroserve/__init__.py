"""metroserve: LLM serving with a paged KV cache, prefix caching and continuous batching.

``from metroserve import LLM, SamplingParams`` is the offline API. Every part installs under this
one name (``metroserve.worker``, ``metroserve.scheduler``, ``metroserve.services``,
``metroserve.kvstore``, ``metroserve.rpc``, ``metroserve.benchmarks``, ``metroserve.common``);
the repository keeps one top-level folder per service and pyproject.toml maps each into place.
Exports resolve lazily: importing ``metroserve`` alone loads no torch.
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
    raise AttributeError(f"module 'metroserve' has no attribute {name!r}")
