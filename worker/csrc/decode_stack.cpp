// A decode step's decoder layers in one call from Python (worker/fused_decode.py says when the
// model takes it). Each op is the kernel the Python layer calls, in the same order on the same
// tensors, so the output is bitwise the Python path's; what goes is the interpreter between them:
// about 40 Python-level calls a layer, 1.2 ms a step of SmolLM2's 30 layers on a 2-core Zen 5 and
// about 10 ms on a 2-core Zen 3 VM, where one stream's whole step is 24 ms.
//
// The layer it runs: Llama's (RMSNorm, fused qkv projection with optional bias, half-split RoPE
// over every dimension, paged attention with optional scale, sliding window and soft-cap, o
// projection, RMSNorm, SiLU-gated MLP), projections quantized (quant_linear / quant_linear_int8
// parts) or in float32 panels (packed_linear). Query rows only: every row of the flat batch
// attends as one token (decodes, speculative verification rows); prefill chunks take the Python path.
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kPanels = -1;  // a part's qtype when its tensor is packed_linear's float32 panels

// (packed tensor, GGML type or kPanels, output rows, int8 inputs): one row range of a projection.
using Part = std::tuple<at::Tensor, int64_t, int64_t, bool>;

struct Projection {
  std::vector<Part> parts;
  std::optional<at::Tensor> bias;

  static at::Tensor part(const Part& p, const at::Tensor& x) {
    const auto& [packed, qtype, rows, int8] = p;
    if (qtype == kPanels) return packed_linear(x, packed, rows);
    return int8 ? quant_linear_int8(x, packed, qtype, rows) : quant_linear(x, packed, qtype, rows);
  }

  // x [T, in] contiguous -> [T, out]: QuantizedWeight.__call__ and Linear.forward's order.
  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor out;
    if (parts.size() == 1) {
      out = part(parts[0], x);
    } else {
      int64_t total = 0;
      for (const Part& p : parts) total += std::get<2>(p);
      out = at::empty({x.size(0), total}, x.options());
      int64_t row = 0;
      for (const Part& p : parts) {
        const int64_t rows = std::get<2>(p);
        out.narrow(1, row, rows).copy_(part(p, x));
        row += rows;
      }
    }
    return bias ? out.add_(*bias) : out;
  }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;  // offset + weight, as RMSNorm.kernel_weight
  Projection qkv, o, gate_up, down;
  double scale, softcap;
  int64_t sliding_window;  // keys a query sees at most; 0: all
  at::Tensor k_pool, v_pool;  // [num_blocks, block_size, Hkv, D]
};

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps) {}

  // Appends the next layer; each projection a list of parts, in output-row order.
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, std::vector<std::vector<Part>> projections,
                 std::vector<std::optional<at::Tensor>> biases, double scale, int64_t sliding_window, double softcap,
                 at::Tensor k_pool, at::Tensor v_pool) {
    TORCH_CHECK(projections.size() == 4 && biases.size() == 4, "add_layer: qkv, o, gate_up and down");
    auto projection = [&](int i) { return Projection{std::move(projections[i]), std::move(biases[i])}; };
    layers_.push_back({input_norm.contiguous(), post_attention_norm.contiguous(), projection(0), projection(1),
                       projection(2), projection(3), scale, softcap, sliding_window, k_pool, v_pool});
  }

  // x [T, hidden] (the embeddings; becomes the residual stream), cos/sin [T, D / 2], slot_mapping [T],
  // block_tables [T, max_blocks], seq_lens [T] -> (last layer's MLP output, residual stream), as
  // DecoderLayer.forward returns them.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
                                             at::Tensor block_tables, at::Tensor seq_lens) const {
    const int64_t T = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    at::Tensor residual = x, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      h = i == 0 ? rms_norm(x, l.input_norm, eps_) : add_rms_norm(x, residual, l.input_norm, eps_);
      at::Tensor qkv = l.qkv(h);
      rotary_embedding(qkv, heads_ + kv_heads_, head_dim_, cos, sin);
      const at::Tensor q = qkv.narrow(1, 0, q_size).reshape({T, heads_, head_dim_});
      store_kv(qkv.narrow(1, q_size, kv_size).view({T, kv_heads_, head_dim_}),
               qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads_, head_dim_}), l.k_pool, l.v_pool,
               slot_mapping);
      const at::Tensor attn = paged_decode_attention(q.contiguous(), l.k_pool, l.v_pool, block_tables, seq_lens,
                                                     l.scale, l.sliding_window, l.softcap);
      h = add_rms_norm(l.o(attn.view({T, q_size})), residual, l.post_attention_norm, eps_);
      x = l.down(silu_and_mul(l.gate_up(h)));
    }
    return {x, residual};
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack", "a decode step's decoder layers in one call (decode_stack.cpp)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
