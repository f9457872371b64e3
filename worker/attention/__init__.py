"""Paged attention behind a small backend interface (base.py).

Backends: torch SDPA for any device (torch_backend.py), the compiled CPU kernels (cpu.py) and
Triton (triton.py); selector.py picks one. The CPU and Triton backends resolve lazily, so importing
this package neither imports Triton nor loads the CPU kernels.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from metroserve.worker.attention.base import AttentionBackend, BatchLayout, block_tables_to_slots
from metroserve.worker.attention.selector import make_attention_backend
from metroserve.worker.attention.torch_backend import TorchAttention, TorchMetadata

if TYPE_CHECKING:
    from metroserve.worker.attention.cpu import CpuAttention, CpuMetadata
    from metroserve.worker.attention.triton import TritonAttention, TritonMetadata

_LAZY = {
    "CpuAttention": "metroserve.worker.attention.cpu",
    "CpuMetadata": "metroserve.worker.attention.cpu",
    "TritonAttention": "metroserve.worker.attention.triton",
    "TritonMetadata": "metroserve.worker.attention.triton",
}

__all__ = ["AttentionBackend", "BatchLayout", "block_tables_to_slots", "make_attention_backend", "TorchAttention",
           "TorchMetadata", "CpuAttention", "CpuMetadata", "TritonAttention", "TritonMetadata"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'metroserve.worker.attention' has no attribute {name!r}")
