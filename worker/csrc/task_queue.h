// Two ways to share a kernel's independent tasks between the torch threads, both dynamic: a
// thread that finishes early takes what is left, so one that was given longer tasks or was
// preempted by the OS does not keep the other waiting at the end of the call.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

// Hands tasks 0..n-1 to the torch threads in order, one at a time, from a shared counter. The
// attention kernels sort their tasks longest first, so the threads finish together: a static
// split of mixed lengths leaves one thread idle while the other works through its long tasks.

// make_scratch() is called once per thread; run(scratch, i) once per task.
template <class MakeScratch, class Run>
void run_tasks_in_order(int64_t n, MakeScratch make_scratch, Run run) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    auto scratch = make_scratch();
    for (int64_t i = next++; i < n; i = next++) run(scratch, i);
  });
}

// run(begin, end) over [0, n) in chunks of up to `chunk` items. Each thread owns the contiguous
// run a static split would give it (so its weight stream stays sequential) and takes its own
// chunks first, then chunks left in the other threads' runs. Results are unchanged (each chunk's
// outputs are its own); measured on a 2-core Zen 5, the same or a few percent faster than the
// static split (benchmarks/README.md, "The service path on 2 cores").
template <class Run>
void run_chunks_shared(int64_t n, int64_t chunk, Run run) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t b = 0; b < n; b += chunk) run(b, std::min(n, b + chunk));
    return;
  }
  struct alignas(64) Cursor {
    std::atomic<int64_t> next;
  };
  const int64_t per = (n + threads - 1) / threads;
  std::unique_ptr<Cursor[]> cursors(new Cursor[threads]);
  for (int64_t t = 0; t < threads; ++t) cursors[t].next.store(t * per, std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t) {
    for (int64_t k = 0; k < threads; ++k) {
      const int64_t owner = (t0 + k) % threads, end = std::min(n, (owner + 1) * per);
      std::atomic<int64_t>& next = cursors[owner].next;
      for (int64_t b = next.fetch_add(chunk); b < end; b = next.fetch_add(chunk)) run(b, std::min(end, b + chunk));
    }
  });
}
