"""Compile the Triton kernels for an NVIDIA GPU on a machine without one.

    TRITON_INTERPRET= python -m tests.compile_for_gpu [compute capability, default 90 (Hopper)]

Triton lowers each kernel to PTX and assembles it with its bundled ptxas for the named target, so
what only the GPU compiler checks (tl.dot shapes, types, constexpr use) fails here, in CI, rather
than on a GPU machine lent for minutes. The interpreter replaces kernels with Python, so it must be
off. Variants: the ones the engine launches for the shapes the tests cover.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run with TRITON_INTERPRET unset: the interpreter does not compile")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from metroserve.worker.attention.triton import (  # noqa: E402
    TritonAttention,
    _merge_segments_kernel,
    _paged_attention_kernel,
    _pow2,
    _write_kv_kernel,
)

_POINTERS = {"block_tables_ptr": "*i64", "slot_ptr": "*i64", "partial_acc_ptr": "*fp32", "partial_ml_ptr": "*fp32",
             "seq_lens_ptr": "*i32", "query_start_ptr": "*i32", "tile_seq_ptr": "*i32", "tile_start_ptr": "*i32"}


# Hopper's and Ampere's largest shared memory per block (227 KiB, 163 KiB): a variant over it
# compiles but fails at launch.
SHARED_MEMORY_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


def compile_kernel(kernel, dtype: str, constexprs: dict, capability: int) -> int:
    """Compile one variant; returns the shared memory it needs."""
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        # At launch Triton marks 16-divisible pointers and integers (every pointer and stride here,
        # for head_dim 64 and 128; the table stride is never specialized): compile that variant,
        # whose K/V loads are the pipelined ones.
        if name.endswith("_ptr") or (name.startswith("stride_") and name != "stride_table"):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _POINTERS.get(name, f"*{dtype}")
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", capability, 32))
    return compiled.metadata.shared


def variants() -> list[tuple[JITFunction, str, dict]]:
    out = []
    for dtype, torch_dtype, precision in (("fp32", torch.float32, "ieee"), ("bf16", torch.bfloat16, "tf32")):
        # The tiny test model (4/2 heads x 16), SmolLM2 and Llama-3-like layouts.
        for num_heads, num_kv_heads, head_dim in ((4, 2, 16), (4, 4, 64), (9, 3, 64), (32, 4, 128)):
            backend = TritonAttention(16, num_heads, num_kv_heads, head_dim, torch_dtype)
            common = dict(GROUP=backend.group, GROUP_PAD=backend.group_pad, HEAD_DIM=head_dim,
                          HEAD_DIM_PAD=_pow2(head_dim), BLOCK_SIZE=16, TILE_N=backend.tile_n, PRECISION=precision)
            decode_q = backend.decode_block_q()
            prefill_q = max(1, backend.PREFILL_ROWS // backend.group_pad)
            for block_q, segments in ((decode_q, 1), (decode_q, backend.SPLIT_KV_SEGMENTS), (prefill_q, 1)):
                out.append((_paged_attention_kernel, dtype, dict(common, BLOCK_Q=block_q,
                                                                  BLOCK_M=block_q * backend.group_pad,
                                                                  NUM_SEGMENTS=segments)))
            out.append((_merge_segments_kernel, dtype, dict(NUM_SEGMENTS=backend.SPLIT_KV_SEGMENTS, HEAD_DIM=head_dim,
                                                            HEAD_DIM_PAD=_pow2(head_dim))))
            out.append((_write_kv_kernel, dtype, dict(NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=_pow2(num_kv_heads),
                                                      HEAD_DIM=head_dim, HEAD_DIM_PAD=_pow2(head_dim))))
    return out


def main() -> int:
    capability = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    compiled, too_big = 0, []
    limit = SHARED_MEMORY_LIMIT.get(capability, SHARED_MEMORY_LIMIT[80])
    for kernel, dtype, constexprs in variants():
        shared = compile_kernel(kernel, dtype, constexprs, capability)
        compiled += 1
        if shared > limit:
            too_big.append(f"{kernel.__name__} {dtype} {constexprs}: {shared} bytes of shared memory")
    if too_big:
        listing = "\n".join(too_big)
        print(f"over the shared-memory limit of sm_{capability} ({limit} bytes):\n{listing}")
        return 1
    print(f"compiled {compiled} kernel variants for sm_{capability}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
