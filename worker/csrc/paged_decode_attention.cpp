// Paged decode attention on CPU: one query token per sequence attends over its context, read
// straight from the block pool through the block table (no gather copy). One OpenMP task per
// (sequence, KV head) computes all query heads of that group with an exact two-pass softmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q,            // [B, H, D] float32
                                     torch::Tensor k_cache,      // [num_blocks, block_size, Hkv, D]
                                     torch::Tensor v_cache,      // same
                                     torch::Tensor block_tables, // [B, max_blocks] int64
                                     torch::Tensor seq_lens,     // [B] int64
                                     double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = H / Hkv;
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
  const int64_t token_stride = Hkv * D;  // between consecutive tokens of one block
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = lp[b];
      scores.resize(G * L);
      const float* qb = qp + (b * H + h * G) * D;
      const int64_t* table = tp + b * max_blocks;
      // Pass 1: scores and per-head max.
      std::vector<float> maxs(G, -INFINITY);
      for (int64_t t = 0; t < L; ++t) {
        const float* k = kp + (table[t / bs] * bs + t % bs) * token_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
          s *= fscale;
          scores[g * L + t] = s;
          if (s > maxs[g]) maxs[g] = s;
        }
      }
      // Pass 2: exp, sums, weighted V.
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> sums(G, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < L; ++t) {
          sg[t] = std::exp(sg[t] - maxs[g]);
          total += sg[t];
        }
        sums[g] = total;
      }
      for (int64_t t = 0; t < L; ++t) {
        const float* v = vp + (table[t / bs] * bs + t % bs) * token_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * H + h * G + g) * D;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
