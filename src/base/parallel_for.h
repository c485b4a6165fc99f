// Internal: the one parallel loop of the tools that fan a list of items out
// over threads (a batch's files, a conversion's pieces, a store entry's
// chunks).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace pinload::detail {

// Runs fn(i) for i in [0, n) on up to `threads` threads, the caller's one of
// them. The first exception stops the others taking new items and is
// rethrown once every thread has joined. Where the OS refuses a thread, the
// ones started and the caller do it all.
template <class Fn>
void parallel_for(std::size_t n, unsigned threads, Fn&& fn) {
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::exception_ptr error;
  auto worker = [&] {
    for (std::size_t i; !failed.load(std::memory_order_relaxed) && (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard lock(mu);
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
  };
  {
    const std::size_t count = std::min<std::size_t>(std::max(threads, 1u), std::max<std::size_t>(n, 1));
    std::vector<std::jthread> workers;
    for (std::size_t t = 1; t < count; ++t) {
      try {
        workers.emplace_back(worker);
      } catch (const std::system_error&) {
        break;
      }
    }
    worker();
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace pinload::detail
