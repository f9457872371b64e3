// GGML block formats as the quantized GEMMs read them (quant_linear.cpp: float32 activations;
// quant_linear_int8.cpp: int8 activations). Each format knows its file layout, its two packed
// layouts (strips of W output columns; see the two kernels for why each is so) and where a
// block's scales, offsets and quants lie in them. Header-only, one copy per translation unit.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <vector>

#include "task_queue.h"
#include "vec.h"

namespace {

using vec::kTileRows;
using vec::Vec;
using V = Vec::T;
constexpr int W = Vec::kWidth;  // output columns per strip
constexpr int kSum = 32;        // inputs per sum of x (the offset formats' sub-block)
constexpr int kGroup = 4;       // strips per tile for small row counts

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

// Where quant byte j of column c lies among a strip block's quants. The float kernel widens byte j
// of the W columns with one load; vpdpbusd multiplies 4 consecutive bytes of one column per lane.
// Each layout's packed tensor has its own dtype (the bytes are unsigned either way), so a weight
// packed for one kernel is refused by the other.
struct FloatLayout {
  static constexpr bool kInt8 = false;
  static constexpr auto kDtype = at::kByte;
  static int at(int j, int c) { return j * W + c; }
};
struct Int8Layout {
  static constexpr bool kInt8 = true;
  static constexpr auto kDtype = at::kChar;
  static int at(int j, int c) { return (j / 4 * W + c) * 4 + j % 4; }
};

// Column c's fp16 scales and quant bytes (each plus `add`) of a 32-element block, in a strip block.
template <class L>
void scatter(const uint8_t* in, uint8_t* out, int c, int halves, int quants, uint8_t add = 0) {
  for (int h = 0; h < halves; ++h) std::memcpy(out + (h * W + c) * 2, in + 2 * h, 2);
  for (int j = 0; j < quants; ++j) out[2 * halves * W + L::at(j, c)] = in[2 * halves + j] + add;
}

// A GGML block format: kBlock inputs in kRaw bytes a column in the file, kPacked in a strip (either
// layout); scale and (with kOffset) offset of sub-block `sub` (kSub inputs); its quants, W bytes
// per 4-bit pair (kNibbles: byte j holds inputs j and j + kSub / 2) or per 8-bit value. The float
// layout keeps signed values as int8; the int8 layout makes every quant unsigned (vpdpbusd's
// unsigned operand), its offset8 moving what that added into the sub-block's offset.
struct Q4_0 {
  static constexpr int kBlock = 32, kSub = 32, kRaw = 18, kPacked = 18;
  static constexpr bool kNibbles = true, kOffset = true;
  template <class L>
  static void pack(const uint8_t* in, uint8_t* out, int c) { scatter<L>(in, out, c, 1, 16); }
  static V scale(const uint8_t* block, int) { return halves(block); }
  static V offset(const uint8_t*, int, V d) { return Vec::mul(d, Vec::set1(-8.f)); }  // d (q - 8)
  static V offset8(const uint8_t* block, int sub, V d) { return offset(block, sub, d); }
  static const uint8_t* quants(const uint8_t* block, int) { return block + 2 * W; }
};
struct Q4_1 {
  static constexpr int kBlock = 32, kSub = 32, kRaw = 20, kPacked = 20;
  static constexpr bool kNibbles = true, kOffset = true;
  template <class L>
  static void pack(const uint8_t* in, uint8_t* out, int c) { scatter<L>(in, out, c, 2, 16); }
  static V scale(const uint8_t* block, int) { return halves(block); }
  static V offset(const uint8_t* block, int, V) { return halves(block + 2 * W); }
  static V offset8(const uint8_t* block, int sub, V d) { return offset(block, sub, d); }
  static const uint8_t* quants(const uint8_t* block, int) { return block + 4 * W; }
};
struct Q8_0 {
  static constexpr int kBlock = 32, kSub = 32, kRaw = 34, kPacked = 34;
  static constexpr bool kNibbles = false, kOffset = false;
  template <class L>
  static void pack(const uint8_t* in, uint8_t* out, int c) { scatter<L>(in, out, c, 1, 32, L::kInt8 ? 128 : 0); }
  static V scale(const uint8_t* block, int) { return halves(block); }
  static V offset(const uint8_t*, int, V d) { return d; }
  static V offset8(const uint8_t*, int, V d) { return Vec::mul(d, Vec::set1(-128.f)); }  // d (u - 128)
  static const uint8_t* quants(const uint8_t* block, int) { return block + 2 * W; }
};
// File: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (32 bytes hold
// sub-blocks 2i and 2i + 1 in their low and high halves); w = d sc q - dmin m.
// Strip: d, dmin, 8 scale bytes, 8 min bytes, then 16 nibble bytes per sub-block.
struct Q4_K {
  static constexpr int kBlock = 256, kSub = 32, kRaw = 144, kPacked = 4 + 16 + 128;
  static constexpr bool kNibbles = true, kOffset = true;
  template <class L>
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
        out[(20 + sub * 16) * W + L::at(j, c)] = (q[j] >> shift & 15) | (q[j + 16] >> shift & 15) << 4;
      }
  }
  static V scale(const uint8_t* block, int sub) { return Vec::mul(halves(block), uint8s(block + (4 + sub) * W)); }
  static V offset(const uint8_t* block, int sub, V) {
    return Vec::mul(halves(block + 2 * W), Vec::mul(uint8s(block + (12 + sub) * W), Vec::set1(-1.f)));
  }
  static V offset8(const uint8_t* block, int sub, V d) { return offset(block, sub, d); }
  static const uint8_t* quants(const uint8_t* block, int sub) { return block + (20 + sub * 16) * W; }
};
// File: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 sub-block scales, fp16 d;
// w = d sc (q - 32). Strip: d, 16 scale bytes, then the 256 quants (float layout: q - 32 as int8).
struct Q6_K {
  static constexpr int kBlock = 256, kSub = 16, kRaw = 210, kPacked = 2 + 16 + 256;
  static constexpr bool kNibbles = false, kOffset = false;
  template <class L>
  static void pack(const uint8_t* in, uint8_t* out, int c) {
    std::memcpy(out + 2 * c, in + 208, 2);
    for (int i = 0; i < 16; ++i) out[(2 + i) * W + c] = in[192 + i];
    for (int i = 0; i < 256; ++i) {  // llama.cpp's dequantize_row_q6_K order
      const int half = i / 128, quarter = i % 128 / 32, l = i % 32;
      const uint8_t low = in[half * 64 + l + quarter % 2 * 32] >> (quarter / 2 * 4) & 15;
      const uint8_t high = in[128 + half * 32 + l] >> (2 * quarter) & 3;
      out[18 * W + i / kSub * kSub * W + L::at(i % kSub, c)] = static_cast<uint8_t>((low | high << 4) - (L::kInt8 ? 0 : 32));
    }
  }
  static V scale(const uint8_t* block, int sub) { return Vec::mul(halves(block), int8s(block + (2 + sub) * W)); }
  static V offset(const uint8_t*, int, V d) { return d; }
  static V offset8(const uint8_t*, int, V d) { return Vec::mul(d, Vec::set1(-32.f)); }  // d sc (q - 32)
  static const uint8_t* quants(const uint8_t* block, int sub) { return block + (18 + sub * kSub) * W; }
};
template <class F>
constexpr int64_t kStripBlock = W * F::kPacked;

// Validation shared by both kernels' entry points.
template <class F>
void check_raw(const at::Tensor& raw, int64_t K, const char* what) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() && K > 0 &&
                  K % F::kBlock == 0 && raw.size(1) == K / F::kBlock * F::kRaw,
              what, ": raw must be contiguous uint8 [N, K / ", F::kBlock, " * ", F::kRaw, "] with K = ", K,
              " a multiple of ", F::kBlock);
}
template <class F, class L>
void check_packed(const at::Tensor& packed, int64_t K, int64_t N, const char* what) {
  const int64_t strips = (N + W - 1) / W;
  TORCH_CHECK(packed.scalar_type() == L::kDtype && K % F::kBlock == 0 && packed.dim() == 3 &&
                  packed.size(0) == strips && packed.size(1) == K / F::kBlock && packed.size(2) == kStripBlock<F> &&
                  packed.is_contiguous(),
              what, ": the weight is not packed for this x, N and type by this build and kernel");
}

// Prefetches (into L2) the block S strips after each of a tile's S blocks: the same block of the
// tile that comes next in the thread's run of strips, which starts a tile's worth of blocks later
// in memory (a group's strips are contiguous). A fixed distance within a strip fell short: at
// K = 576 a strip is 2.9 KB, so each strip's first blocks were never prefetched, and single-stream
// decode streamed its weights at 8 GB/s of this Zen 3's 23.
template <class F, int S>
inline void prefetch_next_tile(const uint8_t* const* block, int64_t blocks) {
  const int64_t ahead = S * blocks * kStripBlock<F>;
  for (int s = 0; s < S; ++s)
    for (int64_t c = 0; c < kStripBlock<F>; c += 64) __builtin_prefetch(block[s] + ahead + c, 0, 2);
}

// A tile's W outputs of one row at column col, of a row of N (the last strip may be partial).
inline void store_columns(float* row, int64_t col, int64_t N, V v) {
  const int cols = static_cast<int>(std::min<int64_t>(W, N - col));
  if (cols == W) return Vec::store(row + col, v);
  float buf[W];
  Vec::store(buf, v);
  std::copy(buf, buf + cols, row + col);
}

// tile(rows, strips, row, strip) over an [M, strips] output in tiles of up to tile_rows rows and
// kGroup strips. The strips are split evenly between the threads (a decode step's small
// projections have few: whole groups left one thread idle a tenth of the time), each thread's a
// contiguous run so its weight stream stays sequential, and a thread done with its run takes groups
// left in the other's (task_queue.h); a group's row tiles run one after another while its strips
// are in cache.
template <class Fn>
void sweep(int64_t M, int64_t strips, int tile_rows, Fn&& tile) {
  run_chunks_shared(strips, kGroup, [&](int64_t s, int64_t end) {
    const int n = static_cast<int>(end - s);
    for (int64_t m = 0; m < M; m += tile_rows) tile(static_cast<int>(std::min<int64_t>(tile_rows, M - m)), n, m, s);
  });
}

// raw [N, blocks * F::kRaw] GGML rows -> [strips, blocks, kStripBlock<F>] in layout L.
template <class F, class L>
at::Tensor pack(const at::Tensor& raw, int64_t blocks) {
  const int64_t N = raw.size(0), strips = (N + W - 1) / W, row_bytes = blocks * F::kRaw;
  at::Tensor packed = at::zeros({strips, blocks, kStripBlock<F>}, raw.options().dtype(L::kDtype));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  auto* dst = static_cast<uint8_t*>(packed.data_ptr());
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* out = dst + (s * blocks + b) * kStripBlock<F>;
        for (int c = 0; c < W && s * W + c < N; ++c) F::template pack<L>(src + (s * W + c) * row_bytes + b * F::kRaw, out, c);
      }
  });
  return packed;
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
