// Paged decode attention on CPU: one query token per sequence attends over its context, read
// straight from the block pool through the block table (no gather copy), with an exact two-pass
// softmax. A task is one sequence (or one of its KV heads when there are few sequences); head_dim
// is a template parameter so loops over it unroll and accumulators stay in registers.
//
// With AVX2+FMA (every x86 machine this project has run on): keys are dotted 8 at a time with
// independent accumulators and one transposed horizontal sum, every query head uses a key or value
// row while it is in L1, and rows are prefetched into L2 about two blocks ahead, since the
// hardware prefetcher cannot follow a block table (into L1 the prefetches competed with the
// loads and were slower than none), the first rows of each pass included. Threads take sequences
// longest first, one at a time. On a 2-core Zen 4, 64 sequences of ~450 tokens, 30 layers with
// the pool in DRAM: 117 ms with L1 prefetches and a static split, 78 ms with the first 32 keys
// and 64 values of each sequence not prefetched, 66 ms now. The loads are then bound by how many
// misses a core keeps in flight (the prefetch instructions stall; fewer or later ones are slower).
// The portable loops are the fallback for other CPUs and the last keys. AVX-512 builds multiply in
// 16 lanes (half the FMAs; the value pass takes two keys at a time so that 4 vectors of sums are
// still 8 independent chains): on a 2-core Zen 5 with the context in cache, 29 -> 23 ns a context
// row of SmolLM2 (9 query heads). Issuing the prefetches four a loop iteration was slower with the
// pool in DRAM (bfloat16: 46 -> 65 ms a step), as if prefetches issued faster crowd out the loads.
//
// A sliding window (Mistral, Gemma) limits a query to its last `sliding_window` keys: the task's
// row table starts at the first of them, so the loops below never see, nor fetch, older keys.
// Soft-capping (Gemma 2) maps each score s to softcap * tanh(s / softcap) before the softmax.
//
// The pool holds float32 or bfloat16 (--kv-cache-dtype bfloat16: half the bytes, which is what
// decode attention at a large batch waits on). A bfloat16 row is widened to float32 as it is
// loaded (exact), so the output is the float32 kernel's on a pool of the same rounded values.
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <ATen/ops/empty_like.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "task_queue.h"
#include "vec.h"

// Pool offset of the rows of context tokens [first, end) (block table lookup done once per task, not
// per head). The block size is a power of two (EngineConfig): shifts, not a division per row.
static void row_offsets(const int64_t* table, int64_t first, int64_t end, int64_t bs, int64_t token_stride,
                        int64_t* rows) {
  const int shift = __builtin_ctzll(static_cast<uint64_t>(bs));
  for (int64_t t = first; t < end; ++t)
    rows[t - first] = ((table[t >> shift] << shift) + (t & (bs - 1))) * token_stride;
}

using BFloat16 = c10::BFloat16;

#if defined(__AVX2__) && defined(__FMA__)
// Rows of a context are scattered over blocks, which the hardware prefetcher cannot follow.
template <class KV>
static inline void prefetch_row(const KV* row, int64_t n) {
  for (int64_t d = 0; d < n; d += 64 / sizeof(KV)) _mm_prefetch(reinterpret_cast<const char*>(row + d), _MM_HINT_T2);
}

// 8 consecutive pool values as float32.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const BFloat16* p) {  // bfloat16 is float32's upper half
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

#if defined(__AVX512F__)
// 16 consecutive pool values as float32 (AVX-512 builds: half the instructions of two load8s).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// The sum of a vector's two 8-lane halves.
static inline __m256 fold(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

// scores[g * L + t] = scale * q_g . k_t for every query head g of the task. Keys are taken 8 at a
// time and every head uses them while they are in L1 (a long context's keys do not fit in L2, so
// one pass per head would read them from memory again).
template <int D, class KV>
static void key_scores(const float* qb, const KV* kp, const KV* vp, const int64_t* rows, int64_t L, int64_t NQ,
                       int64_t G, float scale, float* scores) {
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < std::min<int64_t>(L, 32); ++j) prefetch_row(kp + rows[j], NQ / G * D);
  for (; t + 8 <= L; t += 8) {
    const KV* k[8];
    for (int j = 0; j < 8; ++j) k[j] = kp + rows[t + j];
    for (int64_t j = t + 32; j < std::min(L, t + 40); ++j) prefetch_row(kp + rows[j], NQ / G * D);
    // The value pass starts on the first rows: fetch them while the last keys are scored.
    for (int64_t j = t + 64 - L; j < t + 72 - L; ++j)
      if (j >= 0 && j < L) prefetch_row(vp + rows[j], NQ / G * D);
    for (int64_t g = 0; g < NQ; ++g) {
      const float* qg = qb + g * D;
      const int64_t kh = g / G * D;
      __m256 acc[8];
#if defined(__AVX512F__)  // (head_dim is a multiple of 16)
      __m512 wide[8];
      for (int j = 0; j < 8; ++j) wide[j] = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(qg + d);
        for (int j = 0; j < 8; ++j) wide[j] = _mm512_fmadd_ps(qv, load16(k[j] + kh + d), wide[j]);
      }
      for (int j = 0; j < 8; ++j) acc[j] = fold(wide[j]);
#else
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(k[j] + kh + d), acc[j]);
      }
#endif
      // Transposed horizontal sum: lane j of the result is the sum of acc[j]'s lanes.
      const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
      const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
      const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                        _mm256_permute2f128_ps(h0123, h4567, 0x31));
      _mm256_storeu_ps(scores + g * L + t, _mm256_mul_ps(sums, vscale));
    }
  }
#endif
  for (; t < L; ++t) {
    for (int64_t g = 0; g < NQ; ++g) {
      const float* qg = qb + g * D;
      float widened[D];
      const float* k = vec::as_floats(kp + rows[t] + g / G * D, D, widened);
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int d = 0; d < D; ++d) s += qg[d] * k[d];
      scores[g * L + t] = s * scale;
    }
  }
}

// ob[g] = sum_t p[g * L + t] * v_t / sums[g]. Values are taken 32 at a time, used by every head of
// the task while in L1; each head's sums are carried in registers 64 dims at a time.
template <int D, class KV>
static void weighted_values(const KV* vp, const int64_t* rows, int64_t L, int64_t NQ, int64_t G, const float* p,
                            const float* sums, float* ob) {
  constexpr int kChunk = D < 64 ? D : 64;
  constexpr int64_t kTile = 32;
  for (int64_t i = 0; i < NQ * D; ++i) ob[i] = 0.f;
  for (int64_t t0 = 0; t0 < L; t0 += kTile) {
    const int64_t t1 = std::min(L, t0 + kTile);
#if defined(__AVX2__) && defined(__FMA__)
    for (int64_t t = t1 + 32; t < std::min(L, t1 + 32 + kTile); ++t) prefetch_row(vp + rows[t], NQ / G * D);
#endif
    for (int64_t g = 0; g < NQ; ++g) {
      const float* pg = p + g * L;
      const int64_t vh = g / G * D;
      for (int c = 0; c < D; c += kChunk) {
        float* og = ob + g * D + c;
#if defined(__AVX512F__)
        // Two keys at a time into two sets of sums: with 16-lane vectors one set would be too few
        // independent FMA chains at kChunk = 64.
        constexpr int NV = kChunk / 16;
        __m512 even[NV], odd[NV];
        for (int i = 0; i < NV; ++i) {
          even[i] = _mm512_loadu_ps(og + 16 * i);
          odd[i] = _mm512_setzero_ps();
        }
        int64_t t = t0;
        for (; t + 2 <= t1; t += 2) {
          const __m512 w0 = _mm512_set1_ps(pg[t]), w1 = _mm512_set1_ps(pg[t + 1]);
          const KV* v0 = vp + rows[t] + vh + c;
          const KV* v1 = vp + rows[t + 1] + vh + c;
          for (int i = 0; i < NV; ++i) {
            even[i] = _mm512_fmadd_ps(w0, load16(v0 + 16 * i), even[i]);
            odd[i] = _mm512_fmadd_ps(w1, load16(v1 + 16 * i), odd[i]);
          }
        }
        if (t < t1) {
          const __m512 w = _mm512_set1_ps(pg[t]);
          const KV* v = vp + rows[t] + vh + c;
          for (int i = 0; i < NV; ++i) even[i] = _mm512_fmadd_ps(w, load16(v + 16 * i), even[i]);
        }
        for (int i = 0; i < NV; ++i) _mm512_storeu_ps(og + 16 * i, _mm512_add_ps(even[i], odd[i]));
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 acc[kChunk / 8];
        for (int i = 0; i < kChunk / 8; ++i) acc[i] = _mm256_loadu_ps(og + 8 * i);
        for (int64_t t = t0; t < t1; ++t) {
          const __m256 w = _mm256_set1_ps(pg[t]);
          const KV* v = vp + rows[t] + vh + c;
          for (int i = 0; i < kChunk / 8; ++i) acc[i] = _mm256_fmadd_ps(w, load8(v + 8 * i), acc[i]);
        }
        for (int i = 0; i < kChunk / 8; ++i) _mm256_storeu_ps(og + 8 * i, acc[i]);
#else
        for (int64_t t = t0; t < t1; ++t) {
          const float w = pg[t];
          float widened[kChunk];
          const float* v = vec::as_floats(vp + rows[t] + vh + c, kChunk, widened);
#pragma omp simd
          for (int d = 0; d < kChunk; ++d) og[d] += w * v[d];
        }
#endif
      }
    }
  }
  for (int64_t g = 0; g < NQ; ++g) {
    const float inv = 1.f / sums[g];
    for (int d = 0; d < D; ++d) ob[g * D + d] *= inv;
  }
}

// Query heads [0, NQ) of one sequence: head i reads KV head i / G of each row.
template <int D, class KV>
static void decode_task(const float* qb, const KV* kp, const KV* vp, const int64_t* rows, int64_t L, int64_t NQ,
                        int64_t G, float scale, float softcap, float* scores, float* sums, float* ob) {
  key_scores<D, KV>(qb, kp, vp, rows, L, NQ, G, scale, scores);
  if (softcap > 0.f) {
    const float inv = 1.f / softcap;
    for (int64_t i = 0; i < NQ * L; ++i) scores[i] = softcap * std::tanh(scores[i] * inv);
  }
  for (int64_t g = 0; g < NQ; ++g) {
    float* sg = scores + g * L;
    float m = -INFINITY;
    for (int64_t t = 0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = std::exp(sg[t] - m);
      total += sg[t];
    }
    sums[g] = total;
  }
  weighted_values<D, KV>(vp, rows, L, NQ, G, scores, sums, ob);
}

// Every sequence's attention over a pool of KV (float or BFloat16).
template <class KV>
static void decode_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t sliding_window,
                       double softcap, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = H / Hkv;
  const float* qp = q.data_ptr<float>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t max_blocks = tables.size(1);
  // A task is a whole sequence, so each row is read in one piece (every KV head), unless there are
  // too few sequences to keep the threads busy: then one task per (sequence, KV head).
  const int64_t kv_per_task = B >= 2 * at::get_num_threads() ? Hkv : 1;
  const int64_t tasks_per_seq = Hkv / kv_per_task;
  const int64_t num_tasks = B * tasks_per_seq;
  // The first key each sequence's query sees.
  std::vector<int64_t> first(B);
  for (int64_t b = 0; b < B; ++b) first[b] = sliding_window > 0 ? std::max<int64_t>(0, lp[b] - sliding_window) : 0;
  const auto keys = [&](int64_t task) { return lp[task / tasks_per_seq] - first[task / tasks_per_seq]; };
  // Most keys first (see task_queue.h).
  std::vector<int64_t> order(num_tasks);
  for (int64_t i = 0; i < num_tasks; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return keys(a) > keys(b); });
  struct Scratch {
    std::vector<float> scores, sums;
    std::vector<int64_t> rows;
  };
  const auto make_scratch = [&] { return Scratch{{}, std::vector<float>(kv_per_task * G), {}}; };
  run_tasks_in_order(num_tasks, make_scratch, [&](Scratch& w, int64_t i) {
    const int64_t task = order[i];
    const int64_t b = task / tasks_per_seq, h = task % tasks_per_seq * kv_per_task;
    const int64_t L = lp[b] - first[b];
    const int64_t nq = kv_per_task * G;
    w.scores.resize(nq * L);
    w.rows.resize(L);
    row_offsets(tp + b * max_blocks, first[b], lp[b], bs, Hkv * D, w.rows.data());
    const float* qb = qp + (b * H + h * G) * D;
    const KV* kh = kp + h * D;  // the task's first KV head in every row
    const KV* vh = vp + h * D;
    float* ob = op + (b * H + h * G) * D;
    const float s = static_cast<float>(scale), c = static_cast<float>(softcap);
    const int64_t* rows = w.rows.data();
    switch (D) {
      case 16: decode_task<16, KV>(qb, kh, vh, rows, L, nq, G, s, c, w.scores.data(), w.sums.data(), ob); break;
      case 32: decode_task<32, KV>(qb, kh, vh, rows, L, nq, G, s, c, w.scores.data(), w.sums.data(), ob); break;
      case 64: decode_task<64, KV>(qb, kh, vh, rows, L, nq, G, s, c, w.scores.data(), w.sums.data(), ob); break;
      case 128: decode_task<128, KV>(qb, kh, vh, rows, L, nq, G, s, c, w.scores.data(), w.sums.data(), ob); break;
      default: decode_task<256, KV>(qb, kh, vh, rows, L, nq, G, s, c, w.scores.data(), w.sums.data(), ob);
    }
  });
}

at::Tensor paged_decode_attention(at::Tensor q,            // [B, H, D] float32
                                  at::Tensor k_cache,      // [num_blocks, block_size, Hkv, D] float32 or bfloat16
                                  at::Tensor v_cache,      // same
                                  at::Tensor block_tables, // [B, max_blocks] int64
                                  at::Tensor seq_lens,     // [B] int64
                                  double scale,
                                  int64_t sliding_window,     // keys each query sees at most; 0: all
                                  double softcap) {           // 0: none
  const auto pool = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && (pool == at::kFloat || pool == at::kBFloat16) &&
                  v_cache.scalar_type() == pool, "paged_decode_attention: float32 q, float32 or bfloat16 K/V pools");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  const int64_t D = q.size(2);
  TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128 || D == 256, "head_dim must be 16, 32, 64, 128 or 256");
  const int64_t bs = k_cache.size(1);
  TORCH_CHECK(bs > 0 && (bs & (bs - 1)) == 0, "paged_decode_attention: the block size must be a power of two");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  if (pool == at::kFloat)
    decode_all<float>(q, k_cache, v_cache, tables, lens, scale, sliding_window, softcap, out);
  else
    decode_all<BFloat16>(q, k_cache, v_cache, tables, lens, scale, sliding_window, softcap, out);
  return out;
}
