// Paged prefill attention on CPU: every query row of a prefill chunk attends causally over its
// sequence's context (earlier chunks and cached prefix blocks included), read from the block pool
// through the block table, with a one-pass (online) softmax.
//
// A task is (chunk, KV head, tile of query rows). Its G query heads x tile rows are M query
// columns, transposed once per task (Qt, [D][M]), so each 64-key tile is two small matrix
// products read straight from the pool: S^T = K Qt, then O += P V. With AVX2+FMA both run in
// 6 x 16 register tiles (12 accumulators); the softmax runs down S^T's columns, so its max, exp
// and sums are plain vector ops with no horizontal reductions. Only tiles that cross the diagonal
// are masked, and tiles past it are never read, so a causal chunk costs half the products of a
// full one. torch's flash kernel (SDPA) does the same work at 53-98 GFLOPS for SmolLM2's shapes on
// a 2-core Zen 4.
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "task_queue.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int kKeys = 64;        // keys per tile
constexpr float kMasked = -1e30f;  // finite, so exp() of it is 0 under -ffast-math

// S^T rows of R keys against 16 query columns: st[j * ld + c] = k_j . qt[:, c0 + c].
template <int D, int R>
inline void key_block(const float* const* k, const float* qt, int64_t ld, float* st) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m256 q0 = _mm256_loadu_ps(qt + d * ld), q1 = _mm256_loadu_ps(qt + d * ld + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 kv = _mm256_broadcast_ss(k[r] + d);
      a0[r] = _mm256_fmadd_ps(kv, q0, a0[r]);
      a1[r] = _mm256_fmadd_ps(kv, q1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(st + r * ld, a0[r]);
    _mm256_storeu_ps(st + r * ld + 8, a1[r]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 16; ++c) {
      float acc = 0.f;
      for (int d = 0; d < D; ++d) acc += k[r][d] * qt[d * ld + c];
      st[r * ld + c] = acc;
    }
#endif
}

// o[m] = o[m] * rescale[m] + sum_j p[j * ld + m] * v_j for R query columns, over n keys.
template <int D, int R>
inline void value_block(const float* p, int64_t ld, const float* const* v, int n, const float* rescale, float* o) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int c = 0; c < D; c += 16) {
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) {
      const __m256 f = _mm256_broadcast_ss(rescale + r);
      a0[r] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D + c), f);
      a1[r] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D + c + 8), f);
    }
    for (int j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v[j] + c), v1 = _mm256_loadu_ps(v[j] + c + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(p + j * ld + r);
        a0[r] = _mm256_fmadd_ps(w, v0, a0[r]);
        a1[r] = _mm256_fmadd_ps(w, v1, a1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(o + r * D + c, a0[r]);
      _mm256_storeu_ps(o + r * D + c + 8, a1[r]);
    }
  }
#else
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d) {
      float acc = o[r * D + d] * rescale[r];
      for (int j = 0; j < n; ++j) acc += p[j * ld + r] * v[j][d];
      o[r * D + d] = acc;
    }
#endif
}

// S^T for n keys (rows) and ld query columns (a multiple of 16).
template <int D>
void tile_scores(const float* const* k, int n, const float* qt, int64_t ld, float* st) {
  for (int64_t c = 0; c < ld; c += 16) {
    int j = 0;
    for (; j + 6 <= n; j += 6) key_block<D, 6>(k + j, qt + c, ld, st + j * ld + c);
    switch (n - j) {
      case 5: key_block<D, 5>(k + j, qt + c, ld, st + j * ld + c); break;
      case 4: key_block<D, 4>(k + j, qt + c, ld, st + j * ld + c); break;
      case 3: key_block<D, 3>(k + j, qt + c, ld, st + j * ld + c); break;
      case 2: key_block<D, 2>(k + j, qt + c, ld, st + j * ld + c); break;
      case 1: key_block<D, 1>(k + j, qt + c, ld, st + j * ld + c); break;
    }
  }
}

// O += P V for the first m query columns.
template <int D>
void tile_values(const float* p, int64_t ld, const float* const* v, int n, const float* rescale, float* o, int64_t m) {
  int64_t r = 0;
  for (; r + 6 <= m; r += 6) value_block<D, 6>(p + r, ld, v, n, rescale + r, o + r * D);
  switch (m - r) {
    case 5: value_block<D, 5>(p + r, ld, v, n, rescale + r, o + r * D); break;
    case 4: value_block<D, 4>(p + r, ld, v, n, rescale + r, o + r * D); break;
    case 3: value_block<D, 3>(p + r, ld, v, n, rescale + r, o + r * D); break;
    case 2: value_block<D, 2>(p + r, ld, v, n, rescale + r, o + r * D); break;
    case 1: value_block<D, 1>(p + r, ld, v, n, rescale + r, o + r * D); break;
  }
}

struct Task {
  int64_t chunk, kv_head, row0, rows, keys;  // query rows [row0, row0 + rows) of the chunk see `keys` keys at most
};

struct Scratch {
  std::vector<float> qt, o, st, max, sum, rescale, pos;
  std::vector<const float*> k, v;
};

// Query column m of a task is (query row m / G, head m % G).
template <int D>
void prefill_task(const Task& t, const float* qp, int64_t q_stride, const float* kp, const float* vp,
                  const int64_t* table, int64_t bs, int64_t Hkv, int64_t G, int64_t first_pos, float scale,
                  float* op, int64_t o_stride, Scratch& w) {
  const int64_t M = t.rows * G, ld = (M + 15) / 16 * 16;
  const int64_t row_stride = Hkv * D;  // floats between consecutive tokens of a block
  float* qt = w.qt.data();
  std::fill(qt, qt + D * ld, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* src = qp + (t.row0 + m / G) * q_stride + (t.kv_head * G + m % G) * D;
    for (int d = 0; d < D; ++d) qt[d * ld + m] = src[d] * scale;
  }
  for (int64_t m = 0; m < ld; ++m) {
    w.pos[m] = static_cast<float>(first_pos + t.row0 + std::min(m, M - 1) / G);
    w.max[m] = kMasked;
    w.sum[m] = 0.f;
  }
  std::fill(w.o.begin(), w.o.begin() + M * D, 0.f);
  const int64_t first_row_pos = first_pos + t.row0, last_pos = first_row_pos + t.rows - 1;
  float* st = w.st.data();
  for (int64_t k0 = 0; k0 <= last_pos; k0 += kKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kKeys, last_pos + 1 - k0));
    for (int j = 0; j < n; ++j) {
      const int64_t pos = k0 + j;
      const int64_t off = (table[pos / bs] * bs + pos % bs) * row_stride + t.kv_head * D;
      w.k[j] = kp + off;
      w.v[j] = vp + off;
    }
    tile_scores<D>(w.k.data(), n, qt, ld, st);
    if (k0 + n - 1 > first_row_pos) {  // the tile crosses the diagonal: mask keys after each query
      for (int j = 0; j < n; ++j) {
        const float key_pos = static_cast<float>(k0 + j);
        float* row = st + j * ld;
#pragma omp simd
        for (int64_t m = 0; m < ld; ++m) row[m] = key_pos > w.pos[m] ? kMasked : row[m];
      }
    }
    // Online softmax down the columns.
    float* mx = w.max.data();  // the running max, raised to this tile's
    float* f = w.rescale.data();  // how much the old sum and outputs shrink
    float* sum = w.sum.data();
#pragma omp simd
    for (int64_t m = 0; m < ld; ++m) f[m] = mx[m];
    for (int j = 0; j < n; ++j) {
      const float* row = st + j * ld;
#pragma omp simd
      for (int64_t m = 0; m < ld; ++m) mx[m] = row[m] > mx[m] ? row[m] : mx[m];
    }
#pragma omp simd
    for (int64_t m = 0; m < ld; ++m) {
      f[m] = std::exp(f[m] - mx[m]);
      sum[m] *= f[m];
    }
    for (int j = 0; j < n; ++j) {
      float* row = st + j * ld;
#pragma omp simd
      for (int64_t m = 0; m < ld; ++m) {
        row[m] = std::exp(row[m] - mx[m]);
        sum[m] += row[m];
      }
    }
    tile_values<D>(st, ld, w.v.data(), n, w.rescale.data(), w.o.data(), M);
  }
  for (int64_t m = 0; m < M; ++m) {
    const float inv = 1.f / w.sum[m];
    float* dst = op + (t.row0 + m / G) * o_stride + (t.kv_head * G + m % G) * D;
    const float* src = w.o.data() + m * D;
    for (int d = 0; d < D; ++d) dst[d] = src[d] * inv;
  }
}

}  // namespace

// Chunk i's query rows are q[query_start[i] : query_start[i] + query_lens[i]], at positions
// seq_lens[i] - query_lens[i] onwards; their K/V are already in the pool. Writes into out.
void paged_prefill_attention(torch::Tensor q,             // [T, H, D] float32, rows may be strided
                             torch::Tensor k_cache,       // [num_blocks, block_size, Hkv, D]
                             torch::Tensor v_cache,       // same
                             torch::Tensor block_tables,  // [num_chunks, max_blocks] int64
                             torch::Tensor query_start,   // [num_chunks] int64
                             torch::Tensor query_lens,    // [num_chunks] int64
                             torch::Tensor seq_lens,      // [num_chunks] int64
                             double scale, torch::Tensor out) {  // [T, H, D] float32, rows may be strided
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "paged_prefill_attention: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous K/V pools");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "q and out: heads of a row must be contiguous");
  const int64_t H = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2), G = H / Hkv;
  TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128 || D == 256, "head_dim must be 16, 32, 64, 128 or 256");
  auto tables = block_tables.contiguous();
  auto starts = query_start.contiguous(), qlens = query_lens.contiguous(), lens = seq_lens.contiguous();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* qlp = qlens.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t num_chunks = tables.size(0), max_blocks = tables.size(1);
  // About 64 query columns per task: enough to reuse each key and value row, small enough that
  // the task's queries and outputs stay in L1/L2 and long chunks split over the threads.
  const int64_t tile_rows = std::max<int64_t>(4, 64 / G);
  std::vector<Task> tasks;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t first_pos = lp[c] - qlp[c];
    for (int64_t r0 = 0; r0 < qlp[c]; r0 += tile_rows)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t rows = std::min(tile_rows, qlp[c] - r0);
        tasks.push_back({c, h, r0, rows, first_pos + r0 + rows});
      }
  }
  // Most keys first (see task_queue.h).
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.keys > b.keys; });
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const int64_t ld = (tile_rows * G + 15) / 16 * 16;
  const auto make_scratch = [&] {
    return Scratch{std::vector<float>(D * ld), std::vector<float>(ld * D), std::vector<float>(kKeys * ld),
                   std::vector<float>(ld), std::vector<float>(ld), std::vector<float>(ld), std::vector<float>(ld),
                   std::vector<const float*>(kKeys), std::vector<const float*>(kKeys)};
  };
  run_tasks_in_order(static_cast<int64_t>(tasks.size()), make_scratch, [&](Scratch& w, int64_t i) {
    const Task& t = tasks[i];
    const int64_t first_pos = lp[t.chunk] - qlp[t.chunk];
    const float* qc = qp + sp[t.chunk] * q_stride;
    float* oc = op + sp[t.chunk] * o_stride;
    const int64_t* table = tp + t.chunk * max_blocks;
    const float s = static_cast<float>(scale);
    switch (D) {
      case 16: prefill_task<16>(t, qc, q_stride, kp, vp, table, bs, Hkv, G, first_pos, s, oc, o_stride, w); break;
      case 32: prefill_task<32>(t, qc, q_stride, kp, vp, table, bs, Hkv, G, first_pos, s, oc, o_stride, w); break;
      case 64: prefill_task<64>(t, qc, q_stride, kp, vp, table, bs, Hkv, G, first_pos, s, oc, o_stride, w); break;
      case 128: prefill_task<128>(t, qc, q_stride, kp, vp, table, bs, Hkv, G, first_pos, s, oc, o_stride, w); break;
      default: prefill_task<256>(t, qc, q_stride, kp, vp, table, bs, Hkv, G, first_pos, s, oc, o_stride, w);
    }
  });
}
