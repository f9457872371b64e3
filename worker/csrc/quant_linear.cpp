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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using vec::kTileRows;
using vec::Vec;
using V = Vec::T;
constexpr int W = Vec::kWidth;  // output columns per strip
constexpr int kSum = 32;        // inputs per sum of x (the offset formats' sub-block)
constexpr int kGroup = 4;       // strips per tile for small row counts
constexpr int kAhead = 2048;    // prefetch distance in a strip's bytes: the streams cross pages

// What vec.h lacks: W fp16 scales, W unsigned nibble pairs and W int8 / uint8 as float vectors.
#if defined(__AVX512F__)
V halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// A nibble's float by a lookup in a register (vpermps reads the low 4 bits of each index): one
// instruction where masking and converting take two.
void nibbles(const uint8_t* p, V& lo, V& hi) {
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_permutexvar_ps(b, values);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values);
}
V int8s(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
V uint8s(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__)
V halves(const uint8_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[W];
  for (int i = 0; i < W; ++i) f[i] = c10::detail::fp16_ieee_to_fp32_value(p[2 * i] | p[2 * i + 1] << 8);
  return Vec::load(f);
#endif
}
void nibbles(const uint8_t* p, V& lo, V& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
V int8s(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
V uint8s(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
V halves(const uint8_t* p) {
  return Vec::map([&](int i) { return c10::detail::fp16_ieee_to_fp32_value(p[2 * i] | p[2 * i + 1] << 8); });
}
void nibbles(const uint8_t* p, V& lo, V& hi) {
  lo = Vec::map([&](int i) { return static_cast<float>(p[i] & 15); });
  hi = Vec::map([&](int i) { return static_cast<float>(p[i] >> 4); });
}
V int8s(const uint8_t* p) { return Vec::map([&](int i) { return static_cast<float>(static_cast<int8_t>(p[i])); }); }
V uint8s(const uint8_t* p) { return Vec::map([&](int i) { return static_cast<float>(p[i]); }); }
#endif

// Column c's fp16 scales and quant bytes of a 32-element block, in a strip block of that layout.
void scatter(const uint8_t* in, uint8_t* out, int c, int halves, int quants) {
  for (int h = 0; h < halves; ++h) std::memcpy(out + (h * W + c) * 2, in + 2 * h, 2);
  for (int j = 0; j < quants; ++j) out[(2 * halves + j) * W + c] = in[2 * halves + j];
}

// A GGML block format: kBlock inputs in kRaw bytes a column in the file, kPacked in a strip; scale
// and (with kOffset) offset of sub-block `sub` (kSub inputs); its quants, W bytes per 4-bit pair
// (kNibbles: byte j holds inputs j and j + kSub / 2) or per int8.
struct Q4_0 {
  static constexpr int kBlock = 32, kSub = 32, kRaw = 18, kPacked = 18;
  static constexpr bool kNibbles = true, kOffset = true;
  static void pack(const uint8_t* in, uint8_t* out, int c) { scatter(in, out, c, 1, 16); }
  static V scale(const uint8_t* block, int) { return halves(block); }
  static V offset(const uint8_t*, int, V d) { return Vec::mul(d, Vec::set1(-8.f)); }  // d (q - 8)
  static const uint8_t* quants(const uint8_t* block, int) { return block + 2 * W; }
};
struct Q4_1 {
  static constexpr int kBlock = 32, kSub = 32, kRaw = 20, kPacked = 20;
  static constexpr bool kNibbles = true, kOffset = true;
  static void pack(const uint8_t* in, uint8_t* out, int c) { scatter(in, out, c, 2, 16); }
  static V scale(const uint8_t* block, int) { return halves(block); }
  static V offset(const uint8_t* block, int, V) { return halves(block + 2 * W); }
  static const uint8_t* quants(const uint8_t* block, int) { return block + 4 * W; }
};
struct Q8_0 {
  static constexpr int kBlock = 32, kSub = 32, kRaw = 34, kPacked = 34;
  static constexpr bool kNibbles = false, kOffset = false;
  static void pack(const uint8_t* in, uint8_t* out, int c) { scatter(in, out, c, 1, 32); }
  static V scale(const uint8_t* block, int) { return halves(block); }
  static V offset(const uint8_t*, int, V d) { return d; }
  static const uint8_t* quants(const uint8_t* block, int) { return block + 2 * W; }
};
// File: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (32 bytes hold
// sub-blocks 2i and 2i + 1 in their low and high halves); w = d sc q - dmin m.
// Strip: d, dmin, 8 scale bytes, 8 min bytes, then 16 nibble bytes per sub-block.
struct Q4_K {
  static constexpr int kBlock = 256, kSub = 32, kRaw = 144, kPacked = 4 + 16 + 128;
  static constexpr bool kNibbles = true, kOffset = true;
  static void pack(const uint8_t* in, uint8_t* out, int c) {
    std::memcpy(out + 2 * c, in, 2);
    std::memcpy(out + (W + c) * 2, in + 2, 2);
    const uint8_t* sm = in + 4;  // llama.cpp's get_scale_min_k4
    for (int i = 0; i < 8; ++i) {
      const bool low = i < 4;
      out[(4 + i) * W + c] = low ? sm[i] & 63 : (sm[i + 4] & 15) | (sm[i - 4] >> 6) << 4;
      out[(12 + i) * W + c] = low ? sm[i + 4] & 63 : (sm[i + 4] >> 4) | (sm[i] >> 6) << 4;
    }
    for (int sub = 0; sub < 8; ++sub)
      for (int j = 0; j < 16; ++j) {
        const uint8_t* q = in + 16 + sub / 2 * 32;
        const int shift = sub % 2 * 4;
        out[(20 + sub * 16 + j) * W + c] = (q[j] >> shift & 15) | (q[j + 16] >> shift & 15) << 4;
      }
  }
  static V scale(const uint8_t* block, int sub) { return Vec::mul(halves(block), uint8s(block + (4 + sub) * W)); }
  static V offset(const uint8_t* block, int sub, V) {
    return Vec::mul(halves(block + 2 * W), Vec::mul(uint8s(block + (12 + sub) * W), Vec::set1(-1.f)));
  }
  static const uint8_t* quants(const uint8_t* block, int sub) { return block + (20 + sub * 16) * W; }
};
// File: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 sub-block scales, fp16 d;
// w = d sc (q - 32). Strip: d, 16 scale bytes, then the 256 (q - 32) as int8.
struct Q6_K {
  static constexpr int kBlock = 256, kSub = 16, kRaw = 210, kPacked = 2 + 16 + 256;
  static constexpr bool kNibbles = false, kOffset = false;
  static void pack(const uint8_t* in, uint8_t* out, int c) {
    std::memcpy(out + 2 * c, in + 208, 2);
    for (int i = 0; i < 16; ++i) out[(2 + i) * W + c] = in[192 + i];
    for (int i = 0; i < 256; ++i) {  // llama.cpp's dequantize_row_q6_K order
      const int half = i / 128, quarter = i % 128 / 32, l = i % 32;
      const uint8_t low = in[half * 64 + l + quarter % 2 * 32] >> (quarter / 2 * 4) & 15;
      const uint8_t high = in[128 + half * 32 + l] >> (2 * quarter) & 3;
      out[(18 + i) * W + c] = static_cast<uint8_t>((low | high << 4) - 32);
    }
  }
  static V scale(const uint8_t* block, int sub) { return Vec::mul(halves(block), int8s(block + (2 + sub) * W)); }
  static V offset(const uint8_t*, int, V d) { return d; }
  static const uint8_t* quants(const uint8_t* block, int sub) { return block + (18 + sub * kSub) * W; }
};
template <class F>
constexpr int64_t kStripBlock = W * F::kPacked;

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
    for (int s = 0; s < S; ++s) {
      block[s] = p.w + ((strip + s) * p.blocks + b) * kStripBlock<F>;
      for (int64_t c = 0; c < kStripBlock<F>; c += 64) __builtin_prefetch(block[s] + kAhead + c, 0, 2);
    }
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
  for (int s = 0; s < S; ++s) {
    const int64_t col = (strip + s) * W;
    const int cols = static_cast<int>(std::min<int64_t>(W, p.N - col));
    float buf[W];
    for (int r = 0; r < R; ++r) {
      float* out = p.y + (row + r) * p.N + col;
      if (cols == W) {
        Vec::store(out, acc[s][r]);
      } else {
        Vec::store(buf, acc[s][r]);
        std::copy(buf, buf + cols, out);
      }
    }
  }
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
  const int64_t groups = (p.strips + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t s = g0 * kGroup; s < std::min(g1 * kGroup, p.strips); s += kGroup) {
      const int strips = static_cast<int>(std::min<int64_t>(kGroup, p.strips - s));
      for (int64_t m = 0; m < p.M; m += kTileRows)
        tiles<F, kTileRows>(static_cast<int>(std::min<int64_t>(kTileRows, p.M - m)), strips, p, m, s);
    }
  });
}

template <class F>
torch::Tensor pack(const torch::Tensor& raw, int64_t blocks) {
  const int64_t N = raw.size(0), strips = (N + W - 1) / W, row_bytes = blocks * F::kRaw;
  torch::Tensor packed = torch::zeros({strips, blocks, kStripBlock<F>}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* out = dst + (s * blocks + b) * kStripBlock<F>;
        for (int c = 0; c < W && s * W + c < N; ++c) F::pack(src + (s * W + c) * row_bytes + b * F::kRaw, out, c);
      }
  });
  return packed;
}

template <class F>
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / F::kBlock, strips = (N + W - 1) / W;
  TORCH_CHECK(K % F::kBlock == 0 && packed.dim() == 3 && packed.size(0) == strips && packed.size(1) == blocks &&
                  packed.size(2) == kStripBlock<F> && packed.is_contiguous(),
              "quant_linear: the weight is not packed for this x, N and type by this build (pack_quant_weight)");
  auto y = torch::empty({M, N}, x.options());
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
  run<F>({xp, ldx, M, xsum.data(), packed.data_ptr<uint8_t>(), blocks, strips, N, y.data_ptr<float>()});
  return y;
}

template <class Fn>
auto dispatch(int64_t qtype, const char* what, Fn&& fn) {
  switch (qtype) {
    case 2:
      return fn(Q4_0{});
    case 3:
      return fn(Q4_1{});
    case 8:
      return fn(Q8_0{});
    case 12:
      return fn(Q4_K{});
    case 14:
      return fn(Q6_K{});
    default:
      TORCH_CHECK(false, what, ": GGML type ", qtype,
                  " is not supported (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14)");
  }
}

}  // namespace

// raw [N, K / block * block bytes]: N rows of GGML blocks as a GGUF file stores them -> this build's strips.
torch::Tensor pack_quant_weight(torch::Tensor raw, int64_t qtype, int64_t K) {
  return dispatch(qtype, "pack_quant_weight", [&](auto f) {
    using F = decltype(f);
    TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous() && K > 0 &&
                    K % F::kBlock == 0 && raw.size(1) == K / F::kBlock * F::kRaw,
                "pack_quant_weight: raw must be contiguous uint8 [N, K / ", F::kBlock, " * ", F::kRaw,
                "] with K = ", K, " a multiple of ", F::kBlock);
    return pack<F>(raw, K / F::kBlock);
  });
}

// x [M, K] (rows contiguous) times the packed weight of N output columns: [M, N], float32.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t N) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "quant_linear: x must be float32 [M, K] with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8, "quant_linear: the weight must come from pack_quant_weight");
  return dispatch(qtype, "quant_linear", [&](auto f) { return linear<decltype(f)>(x, packed, N); });
}
