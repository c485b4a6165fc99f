// Internal: picks, chunk by chunk, the faster way to copy a file that is in
// the page cache (Note [Mapped reads] in loader.h).
//
// Copying from a mapping wins by about 1.4x where the page cache holds large
// folios and runs at about 0.6-0.7x pread where it holds 4 KiB pages (each then costs
// a page-table entry to populate and to tear down); which one a machine has
// depends on how and when the file was read in. So under CachedRead::kAuto
// the first chunks alternate between the two, and after that each chunk takes
// the one with the lower time per byte so far, except every kExploreEvery-th,
// which takes the other so that a change is noticed.
//
// Plain data and atomics: workers call next() and record() concurrently.
#pragma once

#include <atomic>
#include <cstdint>

namespace pinload::detail {

class CachedReadChooser {
 public:
  enum Method : unsigned { kMap = 0, kPread = 1 };
  static constexpr std::uint64_t kWarmup = 8;         // chunks that alternate
  static constexpr std::uint64_t kExploreEvery = 32;  // then one in this many takes the slower

  // The method for the next chunk.
  Method next() noexcept { return choose(count_.fetch_add(1, std::memory_order_relaxed)); }

  // The method for chunk number `n` (0-based, in the order next() hands them out).
  Method choose(std::uint64_t n) const noexcept {
    if (n < kWarmup) return n % 2 == 0 ? kMap : kPread;
    const Method best = faster();
    if (n % kExploreEvery == 0) return best == kMap ? kPread : kMap;
    return best;
  }

  // A chunk of `bytes` took `nanoseconds` with `m`.
  void record(Method m, std::uint64_t bytes, std::uint64_t nanoseconds) noexcept {
    bytes_[m].fetch_add(bytes, std::memory_order_relaxed);
    nanoseconds_[m].fetch_add(nanoseconds, std::memory_order_relaxed);
  }

  // Bytes per second so far with `m`; 0 before any measurement.
  double bytes_per_second(Method m) const noexcept {
    const auto ns = nanoseconds_[m].load(std::memory_order_relaxed);
    return ns == 0 ? 0 : static_cast<double>(bytes_[m].load(std::memory_order_relaxed)) * 1e9 / static_cast<double>(ns);
  }
  std::uint64_t chunks() const noexcept { return count_.load(std::memory_order_relaxed); }

  // The method with the lower time per byte so far; kMap until both have a
  // measurement.
  Method faster() const noexcept {
    const double map_bytes = static_cast<double>(bytes_[kMap].load(std::memory_order_relaxed));
    const double pread_bytes = static_cast<double>(bytes_[kPread].load(std::memory_order_relaxed));
    if (map_bytes == 0 || pread_bytes == 0) return kMap;
    const double map_ns = static_cast<double>(nanoseconds_[kMap].load(std::memory_order_relaxed));
    const double pread_ns = static_cast<double>(nanoseconds_[kPread].load(std::memory_order_relaxed));
    return map_ns / map_bytes <= pread_ns / pread_bytes ? kMap : kPread;
  }

 private:
  std::atomic<std::uint64_t> count_{0};
  std::atomic<std::uint64_t> bytes_[2] = {0, 0};
  std::atomic<std::uint64_t> nanoseconds_[2] = {0, 0};
};

}  // namespace pinload::detail
