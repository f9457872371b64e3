"""oneDNN's linear on CPU through torch's mkldnn ops: a weight packed into the blocked layout
oneDNN's kernels read, then multiplied. The one place that names these private ops.

Packing copies the weight (cost: one pass over it); the product then runs oneDNN's float32 or
bfloat16 GEMM (AMX tiles or AVX512-BF16 dot products for bfloat16 where the CPU has them)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN and its prepacked linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack(weight: torch.Tensor, batch_size: int) -> torch.Tensor:
    """weight [out, in] in the layout oneDNN picks for inputs of `batch_size` rows (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through pack's copy of the weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
