"""Projections served from quantized weights: a GGUF's own GGML blocks, or int8 made at load.

A quantized projection multiplies through a compiled CPU kernel that reads each GGML block inside
the matmul, so a decode step reads the quantized bytes (Q4_1: 0.625 bytes per weight) instead of
float32 (4 bytes). The float32 copy of such a weight is dropped after loading. Its input, by
`--quantized-activations`:
- "float32" (default; `quant_linear`, csrc/quant_linear.cpp): exact inputs; each block is widened
  to float in registers and multiplied with FMAs (prefill chunks of DEQUANTIZE_MIN_ROWS rows or more:
  the weight widened for the call and multiplied by oneDNN). Greedy output equals the dequantized
  model's up to the order of the sums, so every invariant of the engine holds.
- "int8" (`quant_linear_int8`, csrc/quant_linear_int8.cpp; x86 CPUs with AVX2 or AVX-512): each
  row rounded to int8 per 32 inputs (one float scale each) and multiplied by the quants in
  integers, as llama.cpp does: VNNI dot products (4x the multiply-adds an instruction of float
  FMAs) where the CPU has them, else AVX2/AVX-512 byte products (2x), and no widening of the
  weights, so prefill runs well above float32 GEMMs. Opt-in because the rounding changes greedy output (top-1
  agreement with the dequantized model 97%, as llama.cpp's, in benchmarks/README.md) and amplifies
  float-order differences, so greedy output may depend on batch composition and chunking (as in
  llama.cpp). Decided as --dtype bfloat16 was: the default is the fastest exact choice.
A draft model (speculative decoding) is loaded with its checkpoint's own quantization and float32
inputs: both flags are the target model's.

Which weights are quantized (`--quantization`, vLLM's flag):
- None (default): a checkpoint's own quantization. A GGUF's matrices in Q4_0, Q4_1, Q8_0, Q4_K or
  Q6_K are served in those types; a Hugging Face directory is served as it is (unquantized).
- "gguf": the same, but an error when the checkpoint has no quantized matrices.
- "int8": every projection and the LM head quantized at load to GGML's Q8_0 (blocks of 32 int8
  values with one scale), from whatever the checkpoint holds.
- "none": everything dequantized to --dtype (the engine before quantized serving; the reference
  for what quantization changes).
Quantized serving needs the CPU kernels and float32 activations on CPU; elsewhere (CUDA, bfloat16,
no compiler) the weights are dequantized and a warning says so.

A fused projection (Q/K/V, gate/up) whose parts have different types (a Q4_K_M file keeps V in
Q6_K) stays one Linear with one part per type, each multiplied into its slice of the output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from metroserve.worker import onednn

logger = logging.getLogger(__name__)

# A converted GGUF's quantized matrices as raw GGML blocks, beside model.safetensors (which holds
# them dequantized too, for transformers and for --quantization none); the file's metadata maps
# each tensor name to its GGML type name.
QUANTIZED_FILE = "quantized.safetensors"
# GGML type ids the kernel serves (gguf.GGMLQuantizationType), by name.
KERNEL_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
# From this many rows (prefill chunks) a float32-input product widens the weight to float32 for the
# call and multiplies through oneDNN's GEMM, which does more multiply-adds a cycle than the
# quantized kernel's register tiles. On a 2-core Zen 5, SmolLM2's four projections of a layer:
# 1.14x the kernel's speed at 2048 rows, 1.05x at 1024, 0.96x at 512 (widening and packing the
# weight is the difference). One projection part's float32 copy (and oneDNN's packing of it) lives
# for the call: 7 MB each for SmolLM2's gate/up.
DEQUANTIZE_MIN_ROWS = 1024



@dataclass
class QuantPart:
    packed: torch.Tensor  # the kernel's layout of the part's rows (pack_quant_weight or its _int8 twin)
    qtype: int  # GGML type id
    rows: int  # output features of this part
    nbytes: int  # of the raw GGML blocks: what a step reads
    int8_activations: bool  # multiplied by quant_linear_int8 (else quant_linear)

    def __call__(self, kernels: object, x: torch.Tensor) -> torch.Tensor:
        if not self.int8_activations and x.shape[0] >= DEQUANTIZE_MIN_ROWS and onednn.available():
            return self._through_onednn(kernels, x)
        gemm = kernels.quant_linear_int8 if self.int8_activations else kernels.quant_linear  # type: ignore[attr-defined]
        return gemm(x, self.packed, self.qtype, self.rows)

    def _through_onednn(self, kernels: object, x: torch.Tensor) -> torch.Tensor:
        """Prefill-sized products: the weight widened to float32 for this call and multiplied by
        oneDNN's float32 GEMM (same weights, the sums in another order), then dropped."""
        weight = kernels.dequantize_quant_weight(self.packed, self.qtype, x.shape[1], self.rows)  # type: ignore[attr-defined]
        return onednn.linear(x, onednn.pack(weight, x.shape[0]))


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] weight as consecutive row ranges of quantized parts."""

    parts: list[QuantPart]
    kernels: object

    @property
    def out_features(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] float32 -> [M, out_features] float32."""
        x = x.contiguous()
        if len(self.parts) == 1:
            return self.parts[0](self.kernels, x)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        row = 0
        for part in self.parts:
            out[:, row : row + part.rows] = part(self.kernels, x)
            row += part.rows
        return out


def quantize_q8_0(weight: torch.Tensor) -> np.ndarray:
    """GGML Q8_0 blocks of a float weight [rows, cols] (cols a multiple of 32): uint8 [rows, cols / 32 * 34]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType.Q8_0)


def make_weight(shards: list[tuple[np.ndarray, str]], kernels: object, int8: bool = False) -> QuantizedWeight:
    """A QuantizedWeight from row shards in order: (raw GGML blocks [rows, bytes per row], type
    name), packed for int8 (quant_linear_int8) or float32 activations. Adjacent shards of one type
    are packed as one part."""
    merged: list[tuple[list[np.ndarray], str]] = []
    for blocks, kind in shards:
        if merged and merged[-1][1] == kind:
            merged[-1][0].append(blocks)
        else:
            merged.append(([blocks], kind))
    parts = []
    for pieces, kind in merged:
        raw = np.ascontiguousarray(np.concatenate(pieces, axis=0))
        block_inputs, block_bytes = _block_shape(kind)
        cols = raw.shape[1] // block_bytes * block_inputs
        pack = kernels.pack_quant_weight_int8 if int8 else kernels.pack_quant_weight  # type: ignore[attr-defined]
        packed = pack(torch.from_numpy(raw), KERNEL_TYPES[kind], cols)
        parts.append(QuantPart(packed, KERNEL_TYPES[kind], raw.shape[0], raw.nbytes, int8))
    return QuantizedWeight(parts, kernels)


def _block_shape(kind: str) -> tuple[int, int]:
    """(inputs, bytes) of one GGML block of the type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[kind]]


def read_gguf_blocks(model_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A converted GGUF's quantized matrices (QUANTIZED_FILE): HF name -> raw blocks,
    HF name -> GGML type name; empty for a directory without them."""
    from safetensors import safe_open

    path = model_dir / QUANTIZED_FILE
    if not path.is_file():
        return {}, {}
    with safe_open(str(path), framework="np") as handle:
        types = dict(handle.metadata() or {})
        return {name: handle.get_tensor(name) for name in handle.keys()}, types  # noqa: SIM118
