// Internal: what a read session counts while it runs, readable from other
// threads (relaxed atomics: progress, not synchronization).
#pragma once

#include <atomic>
#include <cstdint>

namespace pinload::detail {

struct ReadCounters {
  std::atomic<std::uint64_t> bytes_done{0};
  std::atomic<std::uint64_t> bytes_total{0};
  std::atomic<std::uint64_t> files_direct{0};
  std::atomic<std::uint64_t> files_buffered{0};
  std::atomic<std::uint64_t> files_mapped{0};
};

}  // namespace pinload::detail
