// Internal to the loading stage: a load's live counters (Loader::Counters)
// and the queue of tensors handed out as they arrive (Note [Ready tensors]
// in loader.h). The reader (io/read_session.h) sees only the ReadCounters
// part.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "io/read_counters.h"
#include "pinload/loader.h"

namespace pinload {

namespace detail {

// Tensors of a load in flight that are ready to hand out, until the load ends.
// Thread-safe.
class ReadyQueue {
 public:
  void push(std::vector<Tensor> tensors) {
    if (tensors.empty()) return;
    {
      std::lock_guard lock(mu_);
      if (closed_) return;
      for (Tensor& t : tensors) ready_.push_back(std::move(t));
    }
    cv_.notify_all();
  }
  // The load has ended: nothing more comes. A failed load drops what was not
  // taken, so that a partial result is never handed out after the failure.
  void close(bool failed) {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
      if (failed) ready_.clear();
    }
    cv_.notify_all();
  }
  // True once take() would not block.
  bool wait_for(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    ++waiting_;
    const bool ready = cv_.wait_for(lock, timeout, [&] { return closed_ || !ready_.empty(); });
    --waiting_;
    return ready;
  }
  // Waits for tensors or for the end; empty at the end.
  std::vector<Tensor> take() {
    std::unique_lock lock(mu_);
    ++waiting_;
    cv_.wait(lock, [&] { return closed_ || !ready_.empty(); });
    --waiting_;
    return std::exchange(ready_, {});
  }
  // True while the consumer waits and nothing is queued (Note [Streaming
  // within a budget] in io/stream_budget.h).
  bool starved() {
    std::lock_guard lock(mu_);
    return waiting_ > 0 && ready_.empty() && !closed_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Tensor> ready_;
  bool closed_ = false;
  int waiting_ = 0;  // consumers in wait_for() or take()
};

}  // namespace detail

// The reader's counters, the bytes copied to the device, and where ready
// tensors go (load_async only).
struct Loader::Counters : detail::ReadCounters {
  std::atomic<std::uint64_t> bytes_copied{0};
  std::atomic<std::uint64_t> files_zero_copy{0};  // Note [Zero-copy loads]
  std::atomic<std::uint64_t> files_store{0};      // Note [Store clients] in store.h
  detail::ReadyQueue* ready = nullptr;  // set by load_async
  bool stream = false;                  // HandOut::kStream: keep nothing handed out

  LoadProgress snapshot() const noexcept {
    LoadProgress p;
    p.bytes_done = bytes_done.load(std::memory_order_relaxed);
    p.bytes_total = bytes_total.load(std::memory_order_relaxed);
    p.files_direct = files_direct.load(std::memory_order_relaxed);
    p.files_buffered = files_buffered.load(std::memory_order_relaxed);
    p.files_mapped = files_mapped.load(std::memory_order_relaxed);
    p.bytes_copied = bytes_copied.load(std::memory_order_relaxed);
    p.files_zero_copy = files_zero_copy.load(std::memory_order_relaxed);
    p.files_store = files_store.load(std::memory_order_relaxed);
    return p;
  }
};

}  // namespace pinload
