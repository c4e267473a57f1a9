// Large f32 scratch buffers ([R, d] rows) reused across calls: a fresh allocation of tens of
// MB is mmap'd, page-faulted in and unmapped on every call (measured: about a tenth of the
// kernel's time in the kernel's page-fault and unmap paths).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace mjn {

class BufferCache {
 public:
  // A buffer of at least n floats (contents undefined) and its capacity.
  std::pair<std::unique_ptr<float[]>, int64_t> take(int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].second >= n) {
        auto out = std::move(free_[i]);
        free_.erase(free_.begin() + i);
        return out;
      }
    }
    return {std::unique_ptr<float[]>(new float[n]), n};
  }

  // Keeps the buffer for a later call; at most kKeep are kept (the largest).
  void give(std::pair<std::unique_ptr<float[]>, int64_t> buf) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(buf));
    if (free_.size() > kKeep) {
      auto smallest = free_.begin();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->second < smallest->second) smallest = it;
      free_.erase(smallest);
    }
  }

 private:
  static constexpr size_t kKeep = 2;
  std::mutex mu_;
  std::vector<std::pair<std::unique_ptr<float[]>, int64_t>> free_;
};

// A scratch buffer of n floats from the process's cache, returned to it when destroyed.
class Scratch {
 public:
  explicit Scratch(int64_t n) : buf_(cache().take(n)) {}
  ~Scratch() { cache().give(std::move(buf_)); }
  float* get() const { return buf_.first.get(); }

 private:
  static BufferCache& cache() {
    static BufferCache* c = new BufferCache();  // never destroyed: safe at exit
    return *c;
  }
  std::pair<std::unique_ptr<float[]>, int64_t> buf_;
};

}  // namespace mjn
