// The kernels' entry points, declared once for the files that call them across translation units
// (bindings.cpp binds them, decode_stack.cpp chains them). Each is defined in the file named.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

// paged_decode_attention.cpp, paged_prefill_attention.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale, int64_t sliding_window, double softcap);
void paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                             at::Tensor query_start, at::Tensor query_lens, at::Tensor seq_lens, double scale,
                             int64_t sliding_window, double softcap, at::Tensor out);
// kv_store.cpp
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slot_mapping);
// quant_linear.cpp, quant_linear_int8.cpp
at::Tensor pack_quant_weight(at::Tensor raw, int64_t qtype, int64_t K);
at::Tensor quant_linear(at::Tensor x, at::Tensor packed, int64_t qtype, int64_t N);
at::Tensor dequantize_quant_weight(at::Tensor packed, int64_t qtype, int64_t K, int64_t N);
bool int8_gemm_available();
std::vector<at::Tensor> quantize_activations(at::Tensor x);
at::Tensor pack_quant_weight_int8(at::Tensor raw, int64_t qtype, int64_t K);
at::Tensor quant_linear_int8(at::Tensor x, at::Tensor packed, int64_t qtype, int64_t N);
// layer_ops.cpp, packed_linear.cpp (not in the instruction-set test builds)
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
void rotary_embedding(at::Tensor x, int64_t heads, int64_t head_dim, at::Tensor cos, at::Tensor sin);
at::Tensor pack_linear_weight(at::Tensor w);
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, int64_t out_features);
