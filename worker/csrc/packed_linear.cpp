// Projections y = x W^T on CPU in float32, through a weight packed once into column panels.
//
// Decode steps multiply a few dozen rows by each weight. oneDNN's kernels are tuned for large
// products; at these sizes its row blocking wastes work (43 rows cost as much as 64) and
// each call carries setup. Here the weight is packed into panels of 2 vector widths of output
// columns ([panels][K][panel width], each k's columns adjacent), the threads share the panels,
// and each panel is swept by register tiles of up to kTileRows rows x one panel over the whole K:
// two vector loads of the panel and one broadcast per row per k, nothing else in the inner loop.
// A panel (K x 128 B with AVX-512) stays in L2 while every row tile of the step passes over it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <algorithm>

#include "task_queue.h"
#include "vec.h"

namespace {

using vec::kTileRows;
using vec::Vec;
constexpr int kPanel = 2 * Vec::kWidth;  // output columns per panel

// y[r, :cols] = x[r, :] . panel for R rows; the panel's columns past `cols` are padding. With
// `next`, the next panel is fetched into L2 meanwhile: the hardware prefetcher stops at page
// boundaries, and the weights of a step come from memory (all layers do not fit in cache).
template <int R>
void tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy, int cols,
          const float* next) {
  typename Vec::T lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr)
      for (int c = 0; c < kPanel; c += 16) __builtin_prefetch(next + k * kPanel + c, 0, 2);  // into L2
    const auto b0 = Vec::load(panel + k * kPanel), b1 = Vec::load(panel + k * kPanel + Vec::kWidth);
    for (int r = 0; r < R; ++r) {
      const auto a = Vec::broadcast(x + r * ldx + k);
      lo[r] = Vec::fma(a, b0, lo[r]);
      hi[r] = Vec::fma(a, b1, hi[r]);
    }
  }
  if (cols == kPanel) {
    for (int r = 0; r < R; ++r) {
      Vec::store(y + r * ldy, lo[r]);
      Vec::store(y + r * ldy + Vec::kWidth, hi[r]);
    }
    return;
  }
  float buf[kPanel];
  for (int r = 0; r < R; ++r) {
    Vec::store(buf, lo[r]);
    Vec::store(buf + Vec::kWidth, hi[r]);
    std::copy(buf, buf + cols, y + r * ldy);
  }
}

template <int R>
void tile_up_to(int rows, const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy,
                int cols, const float* next) {
  if constexpr (R > 1) {
    if (rows < R) return tile_up_to<R - 1>(rows, x, ldx, panel, K, y, ldy, cols, next);
  }
  tile<R>(x, ldx, panel, K, y, ldy, cols, next);
}

}  // namespace

// w [N, K] -> [ceil(N / panel), K, panel], zero-padded past N. The panel width is this build's.
at::Tensor pack_linear_weight(at::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "pack_linear_weight: float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// x [M, K] (rows contiguous) times a packed weight of `out_features` columns: [M, out_features].
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "packed_linear: x must be float32 [M, K] with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.size(1) == x.size(1) && packed.is_contiguous(),
              "packed_linear: the weight is not packed for this x (pack_linear_weight)");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), N = out_features;
  TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, "packed_linear: out_features does not match");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Chunks of 2 panels (task_queue.h): a small projection has 18; the prefetch of the next panel
  // crosses chunks, as the thread that owns them usually takes the next one itself.
  run_chunks_shared(panels, 2, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
      const float* panel = wp + p * K * kPanel;
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m));
        const float* next = m == 0 && p + 1 < panels ? panel + K * kPanel : nullptr;
        tile_up_to<kTileRows>(rows, xp + m * ldx, ldx, panel, K, yp + m * N + p * kPanel, N, cols, next);
      }
    }
  });
  return y;
}
