// The CPU attention extension's Python module: decode and prefill kernels, one build.
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                             torch::Tensor query_start, torch::Tensor query_lens, torch::Tensor seq_lens, double scale,
                             torch::Tensor out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged causal prefill attention (CPU, float32)");
}
