// Projections y = x W^T on CPU with W kept in a GGML block format (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) and
// float32 arithmetic. Single-stream decode reads every weight once per token, so its time is the
// weights' bytes over memory bandwidth: 0.56 / 0.63 / 1.06 / 0.58 / 1.07 bytes a weight here
// instead of float32's 4.
//
// Packing (once, at load) groups the weight's rows (output columns) into strips of one vector width
// W and turns each GGML block into a strip block: the W columns' scales side by side, then each
// quant byte j of the W columns side by side, so one load of W bytes widens to the weights of W
// columns at input j. The 32-element formats keep the file's bytes (in another order, plus zero
// columns up to a whole strip). The 256-element super-blocks (Q4_K, Q6_K) get their sub-blocks'
// 6-bit scales and mins as bytes and their quants regrouped per sub-block: Q4_K in Q4_1's nibble
// order (byte j holds inputs j and j + 16), 3% over the file's size; Q6_K as centred int8, 30% over.
//
// The kernel sweeps register tiles of R rows x S strips. Per sub-block it accumulates
// sum_j q_j x_j in float from the widened quants, then applies the sub-block's scale once:
// d * sum q x, plus m * sum x for the formats with an offset (x's sums over each 32 inputs are
// computed once a call; Q4_0 is m = -8 d). A block's quants are widened once for all R rows. Small
// M takes 4 strips a tile so that enough independent accumulation chains hide the FMA latency;
// large M (prefill) takes full row tiles per strip, re-widening each strip once per row tile,
// which is small next to the R FMAs per widened vector.
#include <ATen/ops/empty.h>

#include "quant_formats.h"

namespace {


struct Problem {
  const float* x;
  int64_t ldx, M;
  const float* xsum;  // [M, K / kSum]: each row's sums over kSum inputs (formats with an offset)
  const uint8_t* w;   // [strips, blocks, kStripBlock]
  int64_t blocks, strips, N;
  float* y;  // [M, N]
};

// part[s][r] += sum over the sub-block's inputs j of q[s]_j x[r]_j.
template <class F, int R, int S>
inline void sub_block_dot(const float* x, int64_t ldx, const uint8_t* const* q, V (*part)[R]) {
  if constexpr (F::kNibbles) {
    for (int j = 0; j < F::kSub / 2; ++j)
      for (int s = 0; s < S; ++s) {
        V lo, hi;
        nibbles(q[s] + j * W, lo, hi);
        for (int r = 0; r < R; ++r) {
          part[s][r] = Vec::fma(Vec::broadcast(x + r * ldx + j), lo, part[s][r]);
          part[s][r] = Vec::fma(Vec::broadcast(x + r * ldx + j + F::kSub / 2), hi, part[s][r]);
        }
      }
  } else {
    for (int j = 0; j < F::kSub; ++j)
      for (int s = 0; s < S; ++s) {
        const V w = int8s(q[s] + j * W);
        for (int r = 0; r < R; ++r) part[s][r] = Vec::fma(Vec::broadcast(x + r * ldx + j), w, part[s][r]);
      }
  }
}

// y[row .. row + R, strip columns .. + S strips] over all blocks.
template <class F, int R, int S>
void tile(const Problem& p, int64_t row, int64_t strip) {
  V acc[S][R], part[S][R];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) acc[s][r] = Vec::zero();
  const float* x = p.x + row * p.ldx;
  const int64_t sums = p.blocks * F::kBlock / kSum;
  for (int64_t b = 0; b < p.blocks; ++b) {
    const uint8_t* block[S];
    for (int s = 0; s < S; ++s) block[s] = p.w + ((strip + s) * p.blocks + b) * kStripBlock<F>;
    prefetch_next_tile<F, S>(block, p.blocks);
    for (int sub = 0; sub < F::kBlock / F::kSub; ++sub) {
      const uint8_t* quants[S];
      for (int s = 0; s < S; ++s) {
        quants[s] = F::quants(block[s], sub);
        for (int r = 0; r < R; ++r) part[s][r] = Vec::zero();
      }
      sub_block_dot<F, R, S>(x + b * F::kBlock + sub * F::kSub, p.ldx, quants, part);
      for (int s = 0; s < S; ++s) {
        const V d = F::scale(block[s], sub);
        for (int r = 0; r < R; ++r) acc[s][r] = Vec::fma(d, part[s][r], acc[s][r]);
        if constexpr (F::kOffset) {
          static_assert(F::kSub == kSum);
          const V m = F::offset(block[s], sub, d);
          const float* xsum = p.xsum + row * sums + b * F::kBlock / kSum + sub;
          for (int r = 0; r < R; ++r) acc[s][r] = Vec::fma(m, Vec::broadcast(xsum + r * sums), acc[s][r]);
        }
      }
    }
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) store_columns(p.y + (row + r) * p.N, (strip + s) * W, p.N, acc[s][r]);
}

// `rows` (<= R) rows over `strips` (<= kGroup) strips: one tile of kGroup strips when its
// accumulators fit in registers, else a tile per strip.
template <class F, int R>
void tiles(int rows, int strips, const Problem& p, int64_t row, int64_t strip) {
  if constexpr (R > 1) {
    if (rows < R) return tiles<F, R - 1>(rows, strips, p, row, strip);
  }
  if constexpr (R * kGroup <= kTileRows) {
    if (strips == kGroup) return tile<F, R, kGroup>(p, row, strip);
  }
  for (int s = 0; s < strips; ++s) tile<F, R, 1>(p, row, strip + s);
}

template <class F>
void run(const Problem& p) {
  sweep(p.M, p.strips, kTileRows, [&](int rows, int strips, int64_t row, int64_t strip) {
    tiles<F, kTileRows>(rows, strips, p, row, strip);
  });
}

template <class F>
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / F::kBlock, strips = (N + W - 1) / W;
  check_packed<F, FloatLayout>(packed, K, N, "quant_linear");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t sums = K / kSum;
  std::vector<float> xsum(F::kOffset ? M * sums : 0);
  if constexpr (F::kOffset) {
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t i = 0; i < sums; ++i) {
          float s = 0.f;
          for (int j = 0; j < kSum; ++j) s += xp[m * ldx + i * kSum + j];
          xsum[m * sums + i] = s;
        }
    });
  }
  const auto* w = static_cast<const uint8_t*>(packed.data_ptr());
  run<F>({xp, ldx, M, xsum.data(), w, blocks, strips, N, y.data_ptr<float>()});
  return y;
}

// W [N, K]: the weights the kernel widens in registers (d q, plus m for the offset formats), written
// out. A block's W columns are widened input by input, as the strips hold them, then stored row by row.
template <class F>
at::Tensor dequantize(const at::Tensor& packed, int64_t K, int64_t N) {
  const int64_t blocks = K / F::kBlock, strips = (N + W - 1) / W;
  check_packed<F, FloatLayout>(packed, K, N, "dequantize_quant_weight");
  auto out = at::empty({N, K}, packed.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const auto* w = static_cast<const uint8_t*>(packed.data_ptr());
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    alignas(64) float widened[F::kBlock][W];
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t cols = std::min<int64_t>(W, N - s * W);
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = w + (s * blocks + b) * kStripBlock<F>;
        for (int sub = 0; sub < F::kBlock / F::kSub; ++sub) {
          const V d = F::scale(block, sub);
          const V m = F::kOffset ? F::offset(block, sub, d) : Vec::zero();
          const uint8_t* q = F::quants(block, sub);
          float(*rows)[W] = widened + sub * F::kSub;
          if constexpr (F::kNibbles) {
            for (int j = 0; j < F::kSub / 2; ++j) {
              V lo, hi;
              nibbles(q + j * W, lo, hi);
              Vec::store(rows[j], Vec::fma(d, lo, m));
              Vec::store(rows[j + F::kSub / 2], Vec::fma(d, hi, m));
            }
          } else {
            for (int j = 0; j < F::kSub; ++j) Vec::store(rows[j], Vec::fma(d, int8s(q + j * W), m));
          }
        }
        for (int64_t c = 0; c < cols; ++c) {
          float* dst = o + (s * W + c) * K + b * F::kBlock;
          for (int j = 0; j < F::kBlock; ++j) dst[j] = widened[j][c];
        }
      }
    }
  });
  return out;
}

}  // namespace

// raw [N, K / block * block bytes]: N rows of GGML blocks as a GGUF file stores them -> this build's strips.
at::Tensor pack_quant_weight(at::Tensor raw, int64_t qtype, int64_t K) {
  return dispatch(qtype, "pack_quant_weight", [&](auto f) {
    using F = decltype(f);
    check_raw<F>(raw, K, "pack_quant_weight");
    return pack<F, FloatLayout>(raw, K / F::kBlock);
  });
}

// The packed weight of N output columns and K inputs as float32 [N, K] (for large products through
// another GEMM: worker/quantization.py).
at::Tensor dequantize_quant_weight(at::Tensor packed, int64_t qtype, int64_t K, int64_t N) {
  return dispatch(qtype, "dequantize_quant_weight", [&](auto f) { return dequantize<decltype(f)>(packed, K, N); });
}

// x [M, K] (rows contiguous) times the packed weight of N output columns: [M, N], float32.
at::Tensor quant_linear(at::Tensor x, at::Tensor packed, int64_t qtype, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "quant_linear: x must be float32 [M, K] with contiguous rows");
  return dispatch(qtype, "quant_linear", [&](auto f) { return linear<decltype(f)>(x, packed, N); });
}
