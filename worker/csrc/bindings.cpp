// The CPU kernels' Python module (worker/cpu_kernels.py builds it): attention and its KV store,
// the layer's fused elementwise steps, the small-batch projection GEMM, the GEMMs over
// GGUF-quantized weights and the decode step's layers in one call (DecodeStack), one build. With
// METROSERVE_ISA_TEST_BUILD defined, attention, its KV store and the quantized GEMM alone: the
// tests build them so for the instruction sets this machine does not select
// (tests/test_cpu_kernels.py).
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

#ifndef METROSERVE_ISA_TEST_BUILD
void register_decode_stack(pybind11::module& m);  // decode_stack.cpp
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged causal prefill attention (CPU, float32)");
  m.def("store_kv", &store_kv, "this step's K and V into their slots of the paged pools (CPU; float32 or bfloat16 pools)");
  m.def("pack_quant_weight", &pack_quant_weight,
        "[N, K / block * block bytes] GGML blocks (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14) in the strips quant_linear reads");
  m.def("quant_linear", &quant_linear, "x @ dequant(W)^T through pack_quant_weight's strips (CPU, float32)");
  m.def("dequantize_quant_weight", &dequantize_quant_weight, "pack_quant_weight's strips -> float32 W [N, K]");
  m.def("int8_gemm_available", &int8_gemm_available, "whether this build has the int8-activation GEMM (AVX2 or AVX-512; VNNI when present)");
  m.def("quantize_activations", &quantize_activations, "x [M, K] -> (q int8, d float32 [M, K / 32]): x ~ d q per 32 inputs");
  m.def("pack_quant_weight_int8", &pack_quant_weight_int8, "GGML blocks in the strips quant_linear_int8 reads");
  m.def("quant_linear_int8", &quant_linear_int8,
        "x~ @ dequant(W)^T, x~ = x rounded to int8 per 32 inputs (quantize_activations), integer products (CPU)");
#ifndef METROSERVE_ISA_TEST_BUILD
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU, float32)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of residual (CPU, float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [rows, gate | up] (CPU, float32)");
  m.def("rotary_embedding", &rotary_embedding, "rotary embedding of a row's first heads, in place (CPU, float32)");
  m.def("pack_linear_weight", &pack_linear_weight, "a [N, K] weight in the column panels packed_linear reads");
  m.def("packed_linear", &packed_linear, "x @ W^T through pack_linear_weight's panels (CPU, float32)");
  register_decode_stack(m);
#endif
}
