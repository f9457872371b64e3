"""Which attention backend a worker runs: the one asked for, or for auto the fastest that works here.

The CPU and Triton backends are imported only when they may be chosen: Triton is a GPU (or
interpreter) dependency, and the CPU backend needs its compiled kernels, which may not build here.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from metroserve.worker.attention.base import AttentionBackend
from metroserve.worker.attention.torch_backend import TorchAttention


def make_attention_backend(name: str, block_size: int, device: torch.device, dtype: torch.dtype,
                           num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    """auto: Triton on CUDA; on CPU the compiled kernel for float32 when it builds and fits the model, else torch."""
    if name == "triton" or (name == "auto" and device.type == "cuda" and _triton_importable()):
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton attention backend runs on CUDA; on CPU only in Triton's interpreter "
                             "(set TRITON_INTERPRET=1: slow, for tests). Choose auto, cpu or torch")
        from metroserve.worker.attention.triton import TritonAttention

        # Split-KV fills a GPU's SMs; in the interpreter it would only multiply the programs run one by one.
        return TritonAttention(block_size, num_heads, num_kv_heads, head_dim, dtype, split_kv=device.type == "cuda")
    if name in ("auto", "cpu") and device.type == "cpu" and dtype == torch.float32:
        from metroserve.worker.attention.cpu import CpuAttention
        from metroserve.worker.cpu_kernels import load_cpu_kernels

        if CpuAttention.supports(head_dim) and load_cpu_kernels(required=name == "cpu") is not None:
            return CpuAttention(block_size)
    if name in ("auto", "torch"):
        return TorchAttention(block_size)
    raise ValueError(f"attention backend {name!r} is not available on {device.type} with {dtype}; "
                     "choose auto or torch")


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None
