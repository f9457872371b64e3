// Paged prefill attention on CPU: every query row of a prefill chunk attends causally over its
// sequence's context (earlier chunks and cached prefix blocks included), read from the block pool
// through the block table, with a one-pass (online) softmax.
//
// A task is (chunk, KV head, tile of query rows). Its G query heads x tile rows are M query
// columns, transposed once per task (Qt, [D][M]), so each 64-key tile is two small matrix
// products read straight from the pool: S^T = K Qt, then O += P V, both in register tiles of
// kTileRows rows x 2 vectors (vec.h: 12 x 32 with AVX-512, 6 x 16 with AVX2). The softmax runs
// down S^T's columns, so its max, exp and sums are plain vector ops with no horizontal
// reductions; the causal mask and the tile's column max are applied to the score tiles while they
// are still in registers, and exp is an inline polynomial (libm's vector expf is a call per
// vector, with a slow path for the masked scores). Only tiles that cross the diagonal are
// masked, and tiles past it are never read, so a causal chunk costs half the products of a full
// one. On the throughput workload's 64 prompts (SmolLM2 shapes, 2-core Zen 4): torch's flash
// kernel (SDPA) runs at 53-98 GFLOPS, the AVX2 tiles with libm's exp at 94, these at 137.
//
// With a sliding window a task's key tiles start at the first key its first query row sees, and
// a tile that some row's window has left is masked below too. Such tiles, and every tile when
// scores are soft-capped (the cap comes before the mask), are finished in a pass over the stored
// score rows (finish_tile) instead of in registers: the plain causal tiles stay as they were.
//
// A bfloat16 pool (--kv-cache-dtype bfloat16) is widened tile by tile into float32 rows of the
// task's scratch (exact), which the tiles then read as they read a float32 pool's rows: the
// output is the float32 kernel's on a pool of the same rounded values.
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "task_queue.h"
#include "vec.h"

namespace {

using vec::kTileRows;
using vec::Vec;
constexpr int kKeys = 64;                // keys per tile
constexpr int kCols = 2 * Vec::kWidth;   // query columns per register tile
constexpr float kMasked = -1e30f;        // a masked score: finite, and exp() of it is 0

// S^T rows of R keys against kCols query columns: st[j * ld + c] = k_j . qt[:, c]. With kMask,
// key j (position key_pos + j) is masked for the queries before it (positions pos[c]). Raises
// tmax[c] to the column's largest score.
template <int D, int R, bool kMask>
inline void key_block(const float* const* k, const float* qt, int64_t ld, float* st, const float* pos, float key_pos,
                      float* tmax) {
  typename Vec::T a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = Vec::zero();
  for (int d = 0; d < D; ++d) {
    const auto q0 = Vec::load(qt + d * ld), q1 = Vec::load(qt + d * ld + Vec::kWidth);
    for (int r = 0; r < R; ++r) {
      const auto kv = Vec::broadcast(k[r] + d);
      a0[r] = Vec::fma(kv, q0, a0[r]);
      a1[r] = Vec::fma(kv, q1, a1[r]);
    }
  }
  if constexpr (kMask) {
    const auto p0 = Vec::load(pos), p1 = Vec::load(pos + Vec::kWidth), fill = Vec::set1(kMasked);
    for (int r = 0; r < R; ++r) {
      const auto kp = Vec::set1(key_pos + r);
      a0[r] = Vec::keep_if_le(a0[r], kp, p0, fill);
      a1[r] = Vec::keep_if_le(a1[r], kp, p1, fill);
    }
  }
  auto m0 = Vec::load(tmax), m1 = Vec::load(tmax + Vec::kWidth);
  for (int r = 0; r < R; ++r) {
    Vec::store(st + r * ld, a0[r]);
    Vec::store(st + r * ld + Vec::kWidth, a1[r]);
    m0 = Vec::max(m0, a0[r]);
    m1 = Vec::max(m1, a1[r]);
  }
  Vec::store(tmax, m0);
  Vec::store(tmax + Vec::kWidth, m1);
}

// Key blocks of R rows and the remainder of fewer, for one group of kCols columns.
template <int D, int R, bool kMask>
void key_rows(const float* const* k, int n, const float* qt, int64_t ld, float* st, const float* pos, float key_pos,
              float* tmax) {
  int j = 0;
  for (; j + R <= n; j += R) key_block<D, R, kMask>(k + j, qt, ld, st + j * ld, pos, key_pos + j, tmax);
  if constexpr (R > 1) {
    if (j < n) key_rows<D, R - 1, kMask>(k + j, n - j, qt, ld, st + j * ld, pos, key_pos + j, tmax);
  }
}

// S^T for n keys (rows, the first at position key_pos) and ld query columns (a multiple of kCols).
template <int D>
void tile_scores(const float* const* k, int n, const float* qt, int64_t ld, float* st, const float* pos,
                 float key_pos, bool mask, float* tmax) {
  for (int64_t c = 0; c < ld; c += kCols) {
    if (mask)
      key_rows<D, kTileRows, true>(k, n, qt + c, ld, st + c, pos + c, key_pos, tmax + c);
    else
      key_rows<D, kTileRows, false>(k, n, qt + c, ld, st + c, pos + c, key_pos, tmax + c);
  }
}

// Vectors of head dims per value tile row: 4 where AVX-512's registers hold 4 x 6 accumulators
// (each value row is then loaded once per 6 query columns), else 2.
template <int D>
constexpr int value_vectors() {
  constexpr int most = Vec::kWidth == 16 ? 4 : 2;
  return D / Vec::kWidth < most ? D / Vec::kWidth : most;
}
template <int D>
constexpr int value_rows() { return 2 * kTileRows / value_vectors<D>(); }

// o[m] = o[m] * rescale[m] + sum_j p[j * ld + m] * v_j for R query columns, over n keys.
template <int D, int R>
inline void value_block(const float* p, int64_t ld, const float* const* v, int n, const float* rescale, float* o) {
  constexpr int NV = value_vectors<D>();
  constexpr int kChunk = NV * Vec::kWidth;
  static_assert(D % kChunk == 0, "head_dim must be a multiple of the value tile width");
  for (int c = 0; c < D; c += kChunk) {
    typename Vec::T a[NV][R];
    for (int r = 0; r < R; ++r) {
      const auto f = Vec::broadcast(rescale + r);
      for (int i = 0; i < NV; ++i) a[i][r] = Vec::mul(Vec::load(o + r * D + c + i * Vec::kWidth), f);
    }
    for (int j = 0; j < n; ++j) {
      typename Vec::T vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = Vec::load(v[j] + c + i * Vec::kWidth);
      for (int r = 0; r < R; ++r) {
        const auto w = Vec::broadcast(p + j * ld + r);
        for (int i = 0; i < NV; ++i) a[i][r] = Vec::fma(w, vv[i], a[i][r]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NV; ++i) Vec::store(o + r * D + c + i * Vec::kWidth, a[i][r]);
  }
}

// O += P V for the first m query columns.
template <int D, int R = value_rows<D>()>
void tile_values(const float* p, int64_t ld, const float* const* v, int n, const float* rescale, float* o, int64_t m) {
  int64_t r = 0;
  for (; r + R <= m; r += R) value_block<D, R>(p + r, ld, v, n, rescale + r, o + r * D);
  if constexpr (R > 1) {
    if (r < m) tile_values<D, R - 1>(p + r, ld, v, n, rescale + r, o + r * D, m - r);
  }
}

// Scores of n key rows (the first at position key_pos) that the fast path left unmasked: soft-capped
// when softcap > 0, masked after each query column's position (upper) and at or before its
// position - window (lower, low[c] = pos[c] - window + 1); tmax[c] becomes the column's largest.
void finish_tile(float* st, int n, int64_t ld, const float* pos, const float* low, float key_pos, bool upper,
                 bool lower, float softcap, float* tmax) {
  const auto fill = Vec::set1(kMasked);
  for (int64_t c = 0; c < ld; ++c) tmax[c] = kMasked;
  for (int j = 0; j < n; ++j) {
    float* row = st + j * ld;
    if (softcap > 0.f) {
      const float inv = 1.f / softcap;
#pragma omp simd
      for (int64_t c = 0; c < ld; ++c) row[c] = softcap * std::tanh(row[c] * inv);
    }
    const auto kp = Vec::set1(key_pos + j);
    for (int64_t c = 0; c < ld; c += Vec::kWidth) {
      auto a = Vec::load(row + c);
      if (upper) a = Vec::keep_if_le(a, kp, Vec::load(pos + c), fill);
      if (lower) a = Vec::keep_if_le(a, Vec::load(low + c), kp, fill);
      Vec::store(row + c, a);
      Vec::store(tmax + c, Vec::max(Vec::load(tmax + c), a));
    }
  }
}

struct Task {
  int64_t chunk, kv_head, row0, rows, keys;  // query rows [row0, row0 + rows) of the chunk see `keys` keys at most
};

struct Scratch {
  std::vector<float> qt, o, st, max, sum, rescale, pos, low, tmax;
  std::vector<const float*> k, v;
  std::vector<float> kw, vw;  // a bfloat16 tile's rows widened to float32 ([kKeys, D] each); unused for float32
};

// The first key that the query at position pos sees.
inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Query column m of a task is (query row m / G, head m % G).
template <int D, class KV>
void prefill_task(const Task& t, const float* qp, int64_t q_stride, const KV* kp, const KV* vp,
                  const int64_t* table, int64_t bs, int64_t Hkv, int64_t G, int64_t first_pos, float scale,
                  int64_t window, float softcap, float* op, int64_t o_stride, Scratch& w) {
  const int64_t M = t.rows * G, ld = (M + kCols - 1) / kCols * kCols;
  const int64_t row_stride = Hkv * D;  // floats between consecutive tokens of a block
  float* qt = w.qt.data();
  std::fill(qt, qt + D * ld, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* src = qp + (t.row0 + m / G) * q_stride + (t.kv_head * G + m % G) * D;
    for (int d = 0; d < D; ++d) qt[d * ld + m] = src[d] * scale;
  }
  for (int64_t m = 0; m < ld; ++m) {
    w.pos[m] = static_cast<float>(first_pos + t.row0 + std::min(m, M - 1) / G);
    w.low[m] = w.pos[m] - static_cast<float>(window) + 1.f;
    w.max[m] = kMasked;
    w.sum[m] = 0.f;
  }
  std::fill(w.o.begin(), w.o.begin() + M * D, 0.f);
  const int64_t first_row_pos = first_pos + t.row0, last_pos = first_row_pos + t.rows - 1;
  float* st = w.st.data();
  // A column whose row's window starts past a tile has only masked scores there: exp(0) = 1 each
  // in its sum and output, until the first key it sees raises its max and the shrink factor
  // exp(kMasked - max) = 0 clears them (every row sees its own key, in the task's last tile at the latest).
  for (int64_t k0 = first_key(first_row_pos, window); k0 <= last_pos; k0 += kKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kKeys, last_pos + 1 - k0));
    for (int j = 0; j < n; ++j) {
      const int64_t pos = k0 + j;
      const int64_t off = (table[pos / bs] * bs + pos % bs) * row_stride + t.kv_head * D;
      w.k[j] = vec::as_floats(kp + off, D, w.kw.data() + j * D);
      w.v[j] = vec::as_floats(vp + off, D, w.vw.data() + j * D);
    }
    float* tmax = w.tmax.data();
    std::fill(tmax, tmax + ld, kMasked);
    // Only a tile that crosses the diagonal masks keys after each query; only one that reaches
    // before the last row's window, keys before it.
    const bool upper = k0 + n - 1 > first_row_pos, lower = window > 0 && k0 <= last_pos - window;
    if (lower || softcap > 0.f) {
      tile_scores<D>(w.k.data(), n, qt, ld, st, w.pos.data(), static_cast<float>(k0), false, tmax);
      finish_tile(st, n, ld, w.pos.data(), w.low.data(), static_cast<float>(k0), upper, lower, softcap, tmax);
    } else {
      tile_scores<D>(w.k.data(), n, qt, ld, st, w.pos.data(), static_cast<float>(k0), upper, tmax);
    }
    // Online softmax down the columns: raise each column's max to this tile's, shrink the old sum
    // and outputs by exp(old max - new max), then exponentiate the tile and add it to the sums.
    float* mx = w.max.data();
    float* f = w.rescale.data();
    float* sum = w.sum.data();
    for (int64_t m = 0; m < ld; m += Vec::kWidth) {
      const auto old_max = Vec::load(mx + m), new_max = Vec::max(old_max, Vec::load(tmax + m));
      const auto shrink = Vec::exp(Vec::sub(old_max, new_max));
      Vec::store(f + m, shrink);
      Vec::store(mx + m, new_max);
      auto total = Vec::mul(Vec::load(sum + m), shrink);
      for (int j = 0; j < n; ++j) {
        float* row = st + j * ld + m;
        const auto e = Vec::exp(Vec::sub(Vec::load(row), new_max));
        Vec::store(row, e);
        total = Vec::add(total, e);
      }
      Vec::store(sum + m, total);
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

// Runs every task over a pool of KV (float or BFloat16).
template <class KV>
void prefill_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* tp,
                 const int64_t* sp, const int64_t* qlp, const int64_t* lp, int64_t max_blocks,
                 const std::vector<Task>& tasks, int64_t tile_rows, int64_t G, float s, int64_t sliding_window,
                 float c, at::Tensor& out) {
  const int64_t D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  const float* qp = q.data_ptr<float>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  float* op = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const int64_t ld = (tile_rows * G + kCols - 1) / kCols * kCols;
  const auto task_fn = D == 16 ? prefill_task<16, KV> : D == 32 ? prefill_task<32, KV> : D == 64 ? prefill_task<64, KV>
                       : D == 128 ? prefill_task<128, KV> : prefill_task<256, KV>;
  const int64_t widened = std::is_same_v<KV, float> ? 0 : kKeys * D;
  const auto make_scratch = [&] {
    const std::vector<float> column(ld);
    return Scratch{std::vector<float>(D * ld), std::vector<float>(ld * D), std::vector<float>(kKeys * ld),
                   column, column, column, column, column, column,
                   std::vector<const float*>(kKeys), std::vector<const float*>(kKeys),
                   std::vector<float>(widened), std::vector<float>(widened)};
  };
  run_tasks_in_order(static_cast<int64_t>(tasks.size()), make_scratch, [&](Scratch& w, int64_t i) {
    const Task& t = tasks[i];
    const int64_t first_pos = lp[t.chunk] - qlp[t.chunk];
    const float* qc = qp + sp[t.chunk] * q_stride;
    float* oc = op + sp[t.chunk] * o_stride;
    const int64_t* table = tp + t.chunk * max_blocks;
    task_fn(t, qc, q_stride, kp, vp, table, bs, Hkv, G, first_pos, s, sliding_window, c, oc, o_stride, w);
  });
}

}  // namespace

// Chunk i's query rows are q[query_start[i] : query_start[i] + query_lens[i]], at positions
// seq_lens[i] - query_lens[i] onwards; their K/V are already in the pool. Writes into out.
void paged_prefill_attention(at::Tensor q,             // [T, H, D] float32, rows may be strided
                             at::Tensor k_cache,       // [num_blocks, block_size, Hkv, D] float32 or bfloat16
                             at::Tensor v_cache,       // same
                             at::Tensor block_tables,  // [num_chunks, max_blocks] int64
                             at::Tensor query_start,   // [num_chunks] int64
                             at::Tensor query_lens,    // [num_chunks] int64
                             at::Tensor seq_lens,      // [num_chunks] int64
                             double scale,
                             int64_t sliding_window,      // keys each query sees at most; 0: all
                             double softcap,              // 0: none
                             at::Tensor out) {         // [T, H, D] float32, rows may be strided
  const auto pool = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  (pool == at::kFloat || pool == at::kBFloat16) && v_cache.scalar_type() == pool,
              "paged_prefill_attention: float32 q and out, float32 or bfloat16 K/V pools");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous K/V pools");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "q and out: heads of a row must be contiguous");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(2), G = H / Hkv;
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
        tasks.push_back({c, h, r0, rows, first_pos + r0 + rows - first_key(first_pos + r0, sliding_window)});
      }
  }
  // Most keys first (see task_queue.h).
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.keys > b.keys; });
  const float s = static_cast<float>(scale), c = static_cast<float>(softcap);
  if (pool == at::kFloat)
    prefill_all<float>(q, k_cache, v_cache, tp, sp, qlp, lp, max_blocks, tasks, tile_rows, G, s, sliding_window, c,
                       out);
  else
    prefill_all<c10::BFloat16>(q, k_cache, v_cache, tp, sp, qlp, lp, max_blocks, tasks, tile_rows, G, s,
                               sliding_window, c, out);
}
