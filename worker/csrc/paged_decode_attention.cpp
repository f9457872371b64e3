// Paged decode attention on CPU: one query token per sequence attends over its context, read
// straight from the block pool through the block table (no gather copy). One task per
// (sequence, KV head) serves all query heads of that GQA group with an exact two-pass softmax;
// head_dim is a template parameter so the per-head accumulators stay in registers.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

constexpr int64_t kMaxGroup = 16;  // query heads per KV head

template <int D>
static void decode_task(const float* qb, const float* kp, const float* vp, const int64_t* table, int64_t L,
                        int64_t bs, int64_t token_stride, int64_t h, int64_t G, float scale, float* scores,
                        float* ob) {
  float acc[kMaxGroup][D];
  float maxs[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) maxs[g] = -INFINITY;
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t n = std::min(bs, L - t0);
    const float* kblock = kp + table[t0 / bs] * bs * token_stride + h * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qb + g * D;
      float* sg = scores + g * L + t0;
      for (int64_t i = 0; i < n; ++i) {
        const float* k = kblock + i * token_stride;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int d = 0; d < D; ++d) s += qg[d] * k[d];
        s *= scale;
        sg[i] = s;
        maxs[g] = s > maxs[g] ? s : maxs[g];
      }
    }
  }
  float sums[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    const float m = maxs[g];
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = std::exp(sg[t] - m);
      total += sg[t];
    }
    sums[g] = total;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
  }
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t n = std::min(bs, L - t0);
    const float* vblock = vp + table[t0 / bs] * bs * token_stride + h * D;
    for (int64_t i = 0; i < n; ++i) {
      const float* v = vblock + i * token_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * L + t0 + i];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += p * v[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / sums[g];
    for (int d = 0; d < D; ++d) ob[g * D + d] = acc[g][d] * inv;
  }
}

torch::Tensor paged_decode_attention(torch::Tensor q,            // [B, H, D] float32
                                     torch::Tensor k_cache,      // [num_blocks, block_size, Hkv, D]
                                     torch::Tensor v_cache,      // same
                                     torch::Tensor block_tables, // [B, max_blocks] int64
                                     torch::Tensor seq_lens,     // [B] int64
                                     double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32, "paged_decode_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = H / Hkv;
  TORCH_CHECK(G <= kMaxGroup, "at most ", kMaxGroup, " query heads per KV head");
  TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128 || D == 256, "head_dim must be 16, 32, 64, 128 or 256");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t max_blocks = tables.size(1);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = lp[b];
      scores.resize(G * L);
      const float* qb = qp + (b * H + h * G) * D;
      float* ob = op + (b * H + h * G) * D;
      const int64_t* table = tp + b * max_blocks;
      const float s = static_cast<float>(scale);
      switch (D) {
        case 16: decode_task<16>(qb, kp, vp, table, L, bs, Hkv * D, h, G, s, scores.data(), ob); break;
        case 32: decode_task<32>(qb, kp, vp, table, L, bs, Hkv * D, h, G, s, scores.data(), ob); break;
        case 64: decode_task<64>(qb, kp, vp, table, L, bs, Hkv * D, h, G, s, scores.data(), ob); break;
        case 128: decode_task<128>(qb, kp, vp, table, L, bs, Hkv * D, h, G, s, scores.data(), ob); break;
        default: decode_task<256>(qb, kp, vp, table, L, bs, Hkv * D, h, G, s, scores.data(), ob);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
