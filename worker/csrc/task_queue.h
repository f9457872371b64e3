// Hands tasks 0..n-1 to the torch threads in order, one at a time, from a shared counter. The
// attention kernels sort their tasks longest first, so the threads finish together: a static
// split of mixed lengths leaves one thread idle while the other works through its long tasks.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

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
