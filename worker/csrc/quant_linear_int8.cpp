// Projections y = x W^T over GGML block weights with x rounded to int8, as llama.cpp multiplies
// them: each row of x in blocks of 32 inputs, x ~ d q with d = max|x| / 127 and q = round(x / d),
// and W's quants multiplied by q in integers, without widening the weights to float.
//
// What it computes is exactly sum_j w_j x~_j with x~ = d q (up to float rounding of the per-block
// sums), so a reference needs only x~: quantize_activations returns the q and d this kernel uses.
//
// Layout (Int8Layout in quant_formats.h): every quant made unsigned (Q8_0 + 128; Q6_K's 6-bit q as
// stored), 4 consecutive inputs of a column in each 32-bit lane; per sub-block the integer sum
// s = sum u q then gives  d_w d_x s + m_w d_x sum q, the second term carrying the offset of the
// format (Q4_1's m, Q4_0's -8 d, Q8_0's -128 d, ...).
//
// The integer products, by what the build targets (SubBlockSum below):
// - VNNI (AVX512-VNNI, 16 lanes; AVX-VNNI, 8 lanes): vpdpbusd, 4 unsigned bytes times 4 signed bytes
//   summed into an int32 lane, 64 (32) multiply-adds an instruction where the float kernel
//   (quant_linear.cpp) does 16 (8);
// - AVX2 or AVX512BW without VNNI: vpmaddubsw (pairs of products into saturating int16 lanes,
//   kept below 2^15; SubBlockSum says how) widened to int32 by vpmaddwd: llama.cpp's path on such
//   CPUs (Zen 2/3, Haswell to Skylake).
// A portable build has neither: int8_gemm_available() is false and --quantized-activations int8 is
// refused.
#include <ATen/ops/empty.h>

#include "quant_formats.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define METROSERVE_INT8_GEMM 1
#if defined(__AVX512VNNI__)
#define METROSERVE_INT8_VNNI 1
#endif
#elif !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define METROSERVE_INT8_GEMM 1
#if defined(__AVXVNNI__)
#define METROSERVE_INT8_VNNI 1
#endif
#endif

namespace {

constexpr int kAct = 32;   // inputs per activation scale
constexpr int kHalf = 16;  // inputs per activation sum (Q6_K's sub-block)

// x rounded to int8 per kAct inputs: q [M, K], d [M, K / kAct] (x ~ d q), s [M, K / kHalf] (d times
// the sum of each kHalf q's: what the offsets multiply).
struct Int8Rows {
  at::Tensor q, d, s;
};

// One block of kAct inputs: q = round(x / d) with d = max|x| / 127, and the sums of each kHalf q's.
// The vector paths round like nearbyint (to nearest even, MXCSR's default) and give the same q.
inline void quantize_block(const float* x, int8_t* q, float& d, int (&sums)[kAct / kHalf]) {
  static_assert(kAct == 32 && kHalf == 16);
#if defined(__AVX512F__)
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8), x2 = _mm256_loadu_ps(x + 16),
               x3 = _mm256_loadu_ps(x + 24);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                           _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
#else
  float amax = 0.f;
  for (int j = 0; j < kAct; ++j) amax = std::max(amax, std::fabs(x[j]));
#endif
  d = amax / 127.f;
  // Clamped: with a subnormal amax, inv overflows (NaN inputs are the model's bug, not handled).
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
#if defined(__AVX512F__)
  const __m512 vi = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(a, vi), lo), hi));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(b, vi), lo), hi));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  sums[0] = _mm512_reduce_add_epi32(qa);
  sums[1] = _mm512_reduce_add_epi32(qb);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vi = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const auto round = [&](__m256 v) {
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v, vi), lo), hi));
  };
  const __m256i q0 = round(x0), q1 = round(x1), q2 = round(x2), q3 = round(x3);
  // packs work within 128-bit lanes: the permutation puts the four int32 vectors' bytes back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const auto total = [](__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
  };
  sums[0] = total(_mm256_add_epi32(q0, q1));
  sums[1] = total(_mm256_add_epi32(q2, q3));
#else
  sums[0] = sums[1] = 0;
  for (int j = 0; j < kAct; ++j) {
    q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(x[j] * inv), -127.f, 127.f));
    sums[j / kHalf] += q[j];
  }
#endif
}

Int8Rows quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  Int8Rows r{at::empty({M, K}, at::kChar), at::empty({M, K / kAct}, at::kFloat),
             at::empty({M, K / kHalf}, at::kFloat)};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = r.q.data_ptr<int8_t>();
  float* dp = r.d.data_ptr<float>();
  float* sp = r.s.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < K / kAct; ++b) {
        float d;
        int sums[kAct / kHalf];
        quantize_block(xp + m * ldx + b * kAct, qp + m * K + b * kAct, d, sums);
        dp[m * (K / kAct) + b] = d;
        for (int h = 0; h < kAct / kHalf; ++h) sp[m * (K / kHalf) + b * (kAct / kHalf) + h] = d * sums[h];
      }
  });
  return r;
}

#if defined(METROSERVE_INT8_GEMM)
#if defined(__AVX512F__)
using IV = __m512i;
IV izero() { return _mm512_setzero_si512(); }
IV iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
IV four(const int8_t* p) {  // 4 bytes of q in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
IV low4(IV v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
IV high4(IV v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
V to_float(IV v) { return _mm512_cvtepi32_ps(v); }
#if defined(METROSERVE_INT8_VNNI)
IV dot(IV acc, IV u, IV q) { return _mm512_dpbusd_epi32(acc, u, q); }
#else
IV pairs(IV u, IV q) { return _mm512_maddubs_epi16(u, q); }
IV add16(IV a, IV b) { return _mm512_add_epi16(a, b); }
IV widen(IV v) { return _mm512_madd_epi16(v, _mm512_set1_epi16(1)); }
IV add32(IV a, IV b) { return _mm512_add_epi32(a, b); }
IV centered(IV u) { return _mm512_xor_si512(u, _mm512_set1_epi8(-128)); }  // u - 128 as a signed byte
IV magnitude(IV w) { return _mm512_abs_epi8(w); }
IV signed_like(IV q, IV w) {  // q negated where w < 0 (AVX-512 has no vpsignb)
  return _mm512_mask_sub_epi8(q, _mm512_movepi8_mask(w), _mm512_setzero_si512(), q);
}
#endif
constexpr int kTileAcc = 16;  // float plus int accumulators a tile may hold: half the 32 registers
constexpr int kMaxRows = 4;
#else
using IV = __m256i;
IV izero() { return _mm256_setzero_si256(); }
IV iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
IV four(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
IV low4(IV v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
IV high4(IV v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
V to_float(IV v) { return _mm256_cvtepi32_ps(v); }
#if defined(METROSERVE_INT8_VNNI)
IV dot(IV acc, IV u, IV q) { return _mm256_dpbusd_avx_epi32(acc, u, q); }
#else
IV pairs(IV u, IV q) { return _mm256_maddubs_epi16(u, q); }
IV add16(IV a, IV b) { return _mm256_add_epi16(a, b); }
IV widen(IV v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }
IV add32(IV a, IV b) { return _mm256_add_epi32(a, b); }
IV centered(IV u) { return _mm256_xor_si256(u, _mm256_set1_epi8(-128)); }
IV magnitude(IV w) { return _mm256_abs_epi8(w); }
IV signed_like(IV q, IV w) { return _mm256_sign_epi8(q, w); }  // (where w = 0 the product is 0 anyway)
#endif
constexpr int kTileAcc = 8;  // of the 16 registers
constexpr int kMaxRows = 2;
#endif

// A sub-block's sum of u q in int32 lanes, 4 inputs of one column a lane, less bias<F>() times the
// sum of its q (the tile adds that back with the format's offset). A byte quant u comes as what
// split() makes of it; a nibble (u <= 15) as it is.
#if defined(METROSERVE_INT8_VNNI)
struct SubBlockSum {
  struct Bytes {
    IV u;
  };
  IV sum = izero();
  template <class F>
  static constexpr int bias() { return 0; }
  static Bytes split(IV u) { return {u}; }
  void add_nibbles(IV u, IV q) { sum = dot(sum, u, q); }
  void add_bytes(Bytes b, IV q) { sum = dot(sum, b.u, q); }
  IV total() const { return sum; }
};
#else
// vpmaddubsw multiplies unsigned by signed bytes into pairs summed in saturating int16 lanes.
// Nibbles (u <= 15): a pair is at most 2 * 15 * 127 = 3810 in magnitude, so a sub-block's 8 stay
// below 2^15 in one int16 sum, widened once. Bytes: w = u - 128 is multiplied as |w| times q with
// w's sign (llama.cpp's trick), a pair at most 2 * 128 * 127 < 2^15, widened at once; the sum
// then lacks 128 sum q, the bias.
struct SubBlockSum {
  static constexpr int kMaxNibbleAdds = 8;
  struct Bytes {
    IV magnitude, sign;
  };
  IV nibbles = izero(), bytes = izero();  // one of the two stays 0 for a format, and compiles away
  template <class F>
  static constexpr int bias() { return F::kNibbles ? 0 : 128; }
  static Bytes split(IV u) {
    const IV w = centered(u);
    return {magnitude(w), w};
  }
  void add_nibbles(IV u, IV q) { nibbles = add16(nibbles, pairs(u, q)); }
  void add_bytes(Bytes b, IV q) { bytes = add32(bytes, widen(pairs(b.magnitude, signed_like(q, b.sign)))); }
  IV total() const { return add32(widen(nibbles), bytes); }
};
#endif

struct Problem {
  const int8_t* q;  // [M, K]
  const float* d;   // [M, K / kAct]
  const float* s;   // [M, K / kHalf]
  int64_t K, M;
  const uint8_t* w;  // [strips, blocks, kStripBlock]
  int64_t blocks, strips, N;
  float* y;  // [M, N]
};

// isum[s][r] += sum over the sub-block's inputs j of u[s]_j q[r]_j (q: row 0 at the sub-block).
template <class F, int R, int S>
inline void sub_block_dot(const int8_t* q, int64_t K, const uint8_t* const* u, SubBlockSum (*isum)[R]) {
  if constexpr (F::kNibbles) {
    for (int v = 0; v < F::kSub / 8; ++v)
      for (int s = 0; s < S; ++s) {
        const IV packed = iload(u[s] + v * W * 4);
        const IV lo = low4(packed), hi = high4(packed);
        for (int r = 0; r < R; ++r) {
          isum[s][r].add_nibbles(lo, four(q + r * K + 4 * v));
          isum[s][r].add_nibbles(hi, four(q + r * K + F::kSub / 2 + 4 * v));
        }
      }
  } else {
    for (int g = 0; g < F::kSub / 4; ++g)
      for (int s = 0; s < S; ++s) {
        const SubBlockSum::Bytes w = SubBlockSum::split(iload(u[s] + g * W * 4));
        for (int r = 0; r < R; ++r) isum[s][r].add_bytes(w, four(q + r * K + 4 * g));
      }
  }
}

// y[row .. row + R, strip columns .. + S strips] over all blocks.
template <class F, int R, int S>
void tile(const Problem& p, int64_t row, int64_t strip) {
  static_assert(F::kSub == kAct || F::kSub == kHalf);
#if !defined(METROSERVE_INT8_VNNI)
  static_assert(!F::kNibbles || F::kSub / 4 <= SubBlockSum::kMaxNibbleAdds);  // int16 sums stay below 2^15
#endif
  V acc[S][R];
  SubBlockSum isum[S][R];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) acc[s][r] = Vec::zero();
  const int8_t* q = p.q + row * p.K;
  const int64_t ld = p.K / kAct, lds = p.K / kHalf;
  for (int64_t b = 0; b < p.blocks; ++b) {
    const uint8_t* block[S];
    for (int s = 0; s < S; ++s) block[s] = p.w + ((strip + s) * p.blocks + b) * kStripBlock<F>;
    prefetch_next_tile<F, S>(block, p.blocks);
    for (int sub = 0; sub < F::kBlock / F::kSub; ++sub) {
      const int64_t at = b * F::kBlock + sub * F::kSub;  // the sub-block's first input
      const uint8_t* quants[S];
      for (int s = 0; s < S; ++s) {
        quants[s] = F::quants(block[s], sub);
        for (int r = 0; r < R; ++r) isum[s][r] = SubBlockSum{};
      }
      sub_block_dot<F, R, S>(q + at, p.K, quants, isum);
      for (int s = 0; s < S; ++s) {
        const V dw = F::scale(block[s], sub);
        V mw = F::offset8(block[s], sub, dw);
        if constexpr (SubBlockSum::bias<F>() != 0) mw = Vec::fma(dw, Vec::set1(SubBlockSum::bias<F>()), mw);
        for (int r = 0; r < R; ++r) {
          const float* d = p.d + (row + r) * ld + at / kAct;
          const float* sums = p.s + (row + r) * lds + at / kHalf;
          const float sum = F::kSub == kHalf ? sums[0] : sums[0] + sums[1];
          acc[s][r] = Vec::fma(Vec::mul(dw, Vec::broadcast(d)), to_float(isum[s][r].total()), acc[s][r]);
          acc[s][r] = Vec::fma(mw, Vec::set1(sum), acc[s][r]);
        }
      }
    }
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) store_columns(p.y + (row + r) * p.N, (strip + s) * W, p.N, acc[s][r]);
}

// `rows` (<= R) rows over `strips` (<= kGroup) strips, in tiles of as many strips as the
// accumulators (a float and an int one a row and strip) allow.
template <class F, int R>
void tiles(int rows, int strips, const Problem& p, int64_t row, int64_t strip) {
  if constexpr (R > 1) {
    if (rows < R) return tiles<F, R - 1>(rows, strips, p, row, strip);
  }
  constexpr int S = std::min(kGroup, kTileAcc / (2 * R));
  int s = 0;
  for (; s + S <= strips; s += S) tile<F, R, S>(p, row, strip + s);
  for (; s < strips; ++s) tile<F, R, 1>(p, row, strip + s);
}

template <class F>
void run(const Problem& p) {
  sweep(p.M, p.strips, kMaxRows, [&](int rows, int strips, int64_t row, int64_t strip) {
    tiles<F, kMaxRows>(rows, strips, p, row, strip);
  });
}

template <class F>
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / F::kBlock, strips = (N + W - 1) / W;
  check_packed<F, Int8Layout>(packed, K, N, "quant_linear_int8");
  auto y = at::empty({M, N}, x.options());
  const Int8Rows a = quantize_rows(x);
  const auto* w = static_cast<const uint8_t*>(packed.data_ptr());
  run<F>({a.q.data_ptr<int8_t>(), a.d.data_ptr<float>(), a.s.data_ptr<float>(), K, M, w, blocks, strips, N,
          y.data_ptr<float>()});
  return y;
}
#endif

}  // namespace

bool int8_gemm_available() {
#if defined(METROSERVE_INT8_GEMM)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 (K a multiple of 32) -> (q int8 [M, K], d float32 [M, K / 32]): x ~ d q per 32 inputs.
std::vector<at::Tensor> quantize_activations(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % kAct == 0,
              "quantize_activations: x must be float32 [M, K] with contiguous rows and K a multiple of 32");
  Int8Rows r = quantize_rows(x);
  return {r.q, r.d};
}

// raw [N, K / block * block bytes] GGML rows -> the int8 kernel's strips (pack_quant_weight's twin).
at::Tensor pack_quant_weight_int8(at::Tensor raw, int64_t qtype, int64_t K) {
  TORCH_CHECK(int8_gemm_available(), "pack_quant_weight_int8: this build has no int8 products (portable; int8_gemm_available())");
  return dispatch(qtype, "pack_quant_weight_int8", [&](auto f) {
    using F = decltype(f);
    check_raw<F>(raw, K, "pack_quant_weight_int8");
    return pack<F, Int8Layout>(raw, K / F::kBlock);
  });
}

// x [M, K] float32 (rows contiguous) rounded to int8 per 32 inputs, times the packed weight of N
// output columns: [M, N] float32.
at::Tensor quant_linear_int8(at::Tensor x, at::Tensor packed, int64_t qtype, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "quant_linear_int8: x must be float32 [M, K] with contiguous rows");
#if defined(METROSERVE_INT8_GEMM)
  return dispatch(qtype, "quant_linear_int8", [&](auto f) { return linear<decltype(f)>(x, packed, N); });
#else
  TORCH_CHECK(false, "quant_linear_int8: this build has no int8 products (portable; int8_gemm_available())");
  return {};
#endif
}
