// One float vector type for the CPU kernels' register tiles: AVX-512 where the build machine has it,
// else AVX2+FMA, else 8-lane loops the compiler vectorizes as it can. kTileRows is how many rows a
// tile of two vectors per row can hold in registers (2 x rows accumulators + 2 operand vectors).
#pragma once
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace vec {

constexpr float kExpLow = -87.0f;  // below this exp() is 0 here (float's smallest normal is e^-87.3)

#if defined(__AVX512F__)
struct Vec {
  using T = __m512;
  static constexpr int kWidth = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  // a where key <= query, else fill.
  static T keep_if_le(T a, T key, T query, T fill) {
    return _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(key, query, _CMP_GT_OQ), fill);
  }
  static T exp(T x);
};
constexpr int kTileRows = 12;
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using T = __m256;
  static constexpr int kWidth = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T keep_if_le(T a, T key, T query, T fill) {
    return _mm256_blendv_ps(a, fill, _mm256_cmp_ps(key, query, _CMP_GT_OQ));
  }
  static T exp(T x);
};
constexpr int kTileRows = 6;
#else
struct Vec {
  struct T {
    float v[8];
  };
  static constexpr int kWidth = 8;
  template <class F>
  static T map(F f) {
    T r;
    for (int i = 0; i < 8; ++i) r.v[i] = f(i);
    return r;
  }
  static T zero() { return T{}; }
  static T set1(float x) { return map([&](int) { return x; }); }
  static T load(const float* p) { return map([&](int i) { return p[i]; }); }
  static T broadcast(const float* p) { return set1(*p); }
  static void store(float* p, T v) {
    for (int i = 0; i < 8; ++i) p[i] = v.v[i];
  }
  static T fma(T a, T b, T c) { return map([&](int i) { return a.v[i] * b.v[i] + c.v[i]; }); }
  static T add(T a, T b) { return map([&](int i) { return a.v[i] + b.v[i]; }); }
  static T sub(T a, T b) { return map([&](int i) { return a.v[i] - b.v[i]; }); }
  static T mul(T a, T b) { return map([&](int i) { return a.v[i] * b.v[i]; }); }
  static T max(T a, T b) { return map([&](int i) { return a.v[i] > b.v[i] ? a.v[i] : b.v[i]; }); }
  static T keep_if_le(T a, T key, T query, T fill) {
    return map([&](int i) { return key.v[i] > query.v[i] ? fill.v[i] : a.v[i]; });
  }
  static T exp(T x) { return map([&](int i) { return x.v[i] < kExpLow ? 0.f : std::exp(x.v[i]); }); }
};
constexpr int kTileRows = 4;
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// exp(x) = 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2: ln 2 split in two parts so r
// is exact, e^r from its degree-7 Taylor polynomial (relative error below 2e-7, a float ulp or
// two, like libm's expf). Inputs below kExpLow give 0; the softmax inputs are never above 0.
inline Vec::T Vec::exp(T x) {
  const T low = set1(kExpLow);
  const T xc = max(x, low);
  const T n = mul(xc, set1(1.44269504088896341f));
#if defined(__AVX512F__)
  const T nr = _mm512_roundscale_ps(n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const T nr = _mm256_round_ps(n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  T r = fma(nr, set1(-0.693359375f), xc);
  r = fma(nr, set1(2.12194440e-4f), r);
  T p = set1(1.0f / 5040);
  p = fma(p, r, set1(1.0f / 720));
  p = fma(p, r, set1(1.0f / 120));
  p = fma(p, r, set1(1.0f / 24));
  p = fma(p, r, set1(1.0f / 6));
  p = fma(p, r, set1(0.5f));
  p = fma(p, r, set1(1.0f));
  p = fma(p, r, set1(1.0f));
#if defined(__AVX512F__)
  const T e = _mm512_scalef_ps(p, nr);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GE_OQ), e);
#else
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nr), _mm256_set1_epi32(127)), 23);
  const T e = mul(p, _mm256_castsi256_ps(bits));
  return _mm256_and_ps(e, _mm256_cmp_ps(x, low, _CMP_GE_OQ));
#endif
}
#endif

// n values of a KV pool row as float32: a float32 row itself, a bfloat16 one widened into buf
// (exact). Kernels read both through the same float loops, so their sums are the same.
inline const float* as_floats(const float* row, int64_t, float*) { return row; }
template <class BF16>
inline const float* as_floats(const BF16* row, int64_t n, float* buf) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(row[i]);
  return buf;
}

}  // namespace vec
