// parallel_for over XLA's intra-op thread pool (the FFI context's ThreadPool).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace mjn {

using ThreadPoolRef = xla::ffi::ThreadPool&;

// Runs fn(i) for i in [0, n): the calling thread and up to pool.num_threads() - 1 tasks
// scheduled on XLA's pool claim items from one counter, so the caller alone finishes the
// work if no pool thread is free (no deadlock, no second pool). Returns when all n are done;
// tasks that start late find no item and exit (the shared state outlives the call).
inline void parallel_for(ThreadPoolRef pool, int64_t n, std::function<void(int64_t)> fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    int64_t n;
    std::function<void(int64_t)> fn;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto s = std::make_shared<State>();
  s->n = n;
  s->fn = std::move(fn);
  auto work = [](const std::shared_ptr<State>& s) {
    int64_t finished = 0;
    for (int64_t i; (i = s->next.fetch_add(1)) < s->n; ++finished) s->fn(i);
    if (finished && s->done.fetch_add(finished) + finished == s->n) {
      std::lock_guard<std::mutex> lock(s->mu);
      s->cv.notify_all();
    }
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([s, work] { work(s); });
  work(s);
  std::unique_lock<std::mutex> lock(s->mu);
  s->cv.wait(lock, [&] { return s->done.load() == s->n; });
}

}  // namespace mjn
