// The decoder layer's elementwise steps on CPU in float32, each fused into one pass over its rows:
// RMSNorm (optionally after the residual add), SiLU-and-multiply, and rotary embedding in place.
// In torch each is 3-6 separate ops over [tokens, hidden] tensors; for a 2048-token prefill step
// of SmolLM2 they took about 0.25 s of 2.7 s on a 2-core Zen 4. Same formulas and the same
// float32 arithmetic as Hugging Face's Llama, so results differ from torch's only in rounding.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {

// Rows per parallel task: enough work per task to hide the fork, small rows still spread.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1,
              name, ": float32 [rows, n] with contiguous rows");
}

void norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

}  // namespace

// out = weight * x / sqrt(mean(x^2) + eps), row by row.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * xs, wp, static_cast<float>(eps), n, op + r * n);
  });
  return out;
}

// residual += x (in place), then returns rms_norm(residual): the residual add and the next norm in one pass.
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual shapes differ");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* res = rp + r * rs;
      const float* xr = xp + r * xs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) res[i] += xr[i];
      norm_row(res, wp, static_cast<float>(eps), n, op + r * n);
    }
  });
  return out;
}

// [rows, 2I] (gate | up) -> [rows, I]: silu(gate) * up, with silu(g) = g / (1 + exp(-g)).
at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + n;
      float* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// Rotates the first `heads` heads of every row of x ([rows, >= heads * D], rows contiguous) in
// place, in Llama's half-split layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with
// cos/sin [rows, D/2] per token.
void rotary_embedding(at::Tensor x, int64_t heads, int64_t head_dim, at::Tensor cos, at::Tensor sin) {
  check_rows(x, "rotary_embedding");
  TORCH_CHECK(x.size(1) >= heads * head_dim, "rotary_embedding: rows shorter than heads * head_dim");
  auto c = cos.contiguous(), s = sin.contiguous();
  const int64_t rows = x.size(0), half = head_dim / 2;
  TORCH_CHECK(c.numel() == rows * half && s.numel() == rows * half, "rotary_embedding: cos/sin must be [rows, head_dim / 2]");
  float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain(heads * head_dim), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* cr = cp + r * half;
      const float* sr = sp + r * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = xp + r * xs + h * head_dim;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b2 = x2[i];
          x1[i] = a * cr[i] - b2 * sr[i];
          x2[i] = b2 * cr[i] + a * sr[i];
        }
      }
    }
  });
}
