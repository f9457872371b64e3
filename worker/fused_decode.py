"""A decode step's decoder layers in one C++ call (csrc/decode_stack.cpp's DecodeStack).

Between its kernels, a decoder layer on the CPU path spends its time in the interpreter: about 40
Python-level calls a layer (module calls, views, the KV write), 1.2 ms a step of SmolLM2's 30
layers on a 2-core Zen 5 and about 10 ms on a 2-core Zen 3 VM, where one stream's whole step was
24 ms. DecodeStack runs the same kernels in the same order on the same tensors from C++, so its
output is bitwise the Python path's (tests/test_fused_decode.py) and nothing but the interpreter
goes. It is the CPU's counterpart of CUDA graphs (worker/cuda_graphs.py).

When it runs: the model is on the compiled CPU kernels (use_cpu_kernels), its layers are Llama's
(SiLU MLP, no q/k norms, no sandwich norms, RoPE over every head dimension, one RoPE for all
layers; biases, attention scale, soft-cap and sliding windows are fine), every projection is
quantized or in float32 panels, and the step is query rows only (every row attends as one token:
decodes and speculative verification rows) of at most PANEL_MAX_ROWS rows. Anything else (prefill
chunks, Gemma's norms, Qwen3's q/k norms, bfloat16, the torch attention backend) takes the Python
path, which computes the same thing.

Thread-safety: a stack holds the model's weight tensors and one KV cache's pools, and is used
from the engine's thread only; `forward` releases the GIL while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from metroserve.worker.attention.base import window_size
from metroserve.worker.kv_cache import KVCache

# The layers and projections are worker/model.py's DecoderLayer and Linear, typed Any here:
# model.py imports this module.

PANELS = -1  # a part's qtype in DecodeStack when it is packed_linear's float32 panels


@dataclass
class FusedDecode:
    """The model's layers for DecodeStack, and the stack over the KV cache last used (built on the
    first decode step, since the cache is allocated after the model; rebuilt if another comes)."""

    kernels: Any
    layers: list[Any]
    eps: float
    _stack: Any = field(default=None, repr=False)
    _kv_cache: KVCache | None = field(default=None, repr=False)

    @classmethod
    def for_layers(cls, kernels: Any, layers: list[Any], one_rope: bool) -> FusedDecode | None:
        """The fused path for these layers, or None where it does not apply (see the module docstring)."""
        if not hasattr(kernels, "DecodeStack") or not one_rope:
            return None
        for layer in layers:
            if (layer.kernels is None or layer.activation != "silu" or layer.q_norm is not None
                    or layer.pre_feedforward_layernorm is not None or layer.post_feedforward_layernorm is not None
                    or layer.rotary_dim != layer.head_dim or layer.input_layernorm.kernel_weight is None):
                return None
            projections = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            if any(_parts(p) is None for p in projections):
                return None
        return cls(kernels, layers, layers[0].input_layernorm.eps)

    def stack(self, kv_cache: KVCache) -> Any:
        """The DecodeStack over kv_cache's pools. Costs a walk over the layers the first time."""
        if self._kv_cache is not kv_cache:
            self._stack, self._kv_cache = self._build(kv_cache), kv_cache
        return self._stack

    def _build(self, kv_cache: KVCache) -> Any:
        first = self.layers[0]
        stack = self.kernels.DecodeStack(first.num_heads, first.num_kv_heads, first.head_dim, self.eps)
        for i, layer in enumerate(self.layers):
            projections = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            options = layer.attention_options
            stack.add_layer(layer.input_layernorm.kernel_weight, layer.post_attention_layernorm.kernel_weight,
                            [_parts(p) for p in projections], [p.bias for p in projections],
                            options.get("scale", layer.head_dim ** -0.5), window_size(layer.sliding_window),
                            options.get("softcap", 0.0), kv_cache.k[i], kv_cache.v[i])
        return stack

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderForCausalLM's layer loop for a step of query rows: x the embeddings [T, hidden],
        cos/sin [T, head_dim / 2], metadata any window's CpuMetadata (they differ in the window
        only, which each layer carries) -> (last layer's output, residual stream)."""
        return self.stack(kv_cache).forward(x, cos, sin, metadata.slot_mapping, metadata.block_tables,
                                            metadata.seq_lens)


def _parts(projection: Any) -> list[tuple[torch.Tensor, int, int, bool]] | None:
    """The projection as DecodeStack's parts: its quantized parts, or its float32 panels; None if neither."""
    if projection.quantized is not None:
        return [(p.packed, p.qtype, p.rows, p.int8_activations) for p in projection.quantized.parts]
    if projection.kernels is not None and projection.panels is not None:
        return [(projection.panels, PANELS, projection.out_features, False)]
    return None
