// Internal: the first touch of fresh pool memory, with the page size this
// process measured faster.
//
// Note [Page size of fresh memory]
// A fresh pool's pages cost their first touch: the kernel zeroes each one,
// and in a VM whose host has taken the guest's free memory back (free page
// reporting), the host faults it in again underneath. Which page size arrives
// faster depends on the machine. On bare metal transparent huge pages (THP)
// do. On the 2-vCPU VM of docs/benchmarks.md, once the host has reclaimed,
// 2 MiB pages arrived at 0.25-0.33 GB/s and 4 KiB pages at 1.1-2.2 GB/s, and
// a fresh process's 7.8 GB load ran 2.4x faster in 4 KiB pages. A kept pool
// wants THP: fewer TLB misses in warm copies, and direct reads that virtio
// does not split at its 254 segments.
//
// So the readers fault each fresh destination in themselves, just before
// they write it (MADV_POPULATE_WRITE, which costs what the write's own faults
// would), and time it. The page size is chosen per chunk:
//   - THP (the pool's MADV_HUGEPAGE) while it arrives at kSlowHugePages or
//     faster, or before it has been measured;
//   - below that, 4 KiB pages (MADV_NOHUGEPAGE on the chunk) while they
//     measure faster than THP last did, and back to THP when they do not.
// Each populate that ends counts its bytes over the time since the previous
// one ended (or since it began, when none ran): with many readers faulting at
// once, that is the rate at which memory arrives, however many share the
// CPUs. Rates are decayed sums, so a few fast chunks (memory the host had not
// reclaimed yet, handed out first) do not settle the choice.
// Memory already present (a kept pool, a re-used block, pinned or locked
// memory) is left as it is and costs one mincore(2). Where the kernel lacks
// MADV_POPULATE_WRITE (before 5.14), nothing is done and the writes fault the
// pages in as before.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <optional>

#include "pinload/env.h"
#include "pinload/pool.h"

namespace pinload::detail {

class FirstTouch {
 public:
  enum class PageSize { kHuge, kSmall };

  // PINLOAD_FRESH_PAGES: auto (measured, the default), huge or small.
  static constexpr const char* kPagesVariable = "PINLOAD_FRESH_PAGES";
  FirstTouch();

  // THP first touch slower than this explores 4 KiB pages.
  static constexpr double kSlowHugePages = 1e9;  // bytes per second
  // Chunks smaller than this are populated but not measured.
  static constexpr std::size_t kMeasuredBytes = 1u << 20;

  // The page size for the next fresh chunk.
  PageSize choice() const;
  // A measured first touch: `bytes` in `seconds`.
  void record(PageSize size, std::size_t bytes, double seconds);
  // Bytes per second measured for `size` (decayed), 0 before any.
  double rate(PageSize size) const;

  // Faults in [data, data + bytes), which lies in `block`, where its first
  // page is not present yet, through `env` (mincore, madvise), and records
  // it. Locked blocks are left alone. Choosing 4 KiB pages advises the whole
  // block once (MADV_NOHUGEPAGE takes the address space's write lock, which
  // every fault waits for). Never throws; a refusal leaves the pages to the
  // writes.
  void fault_in(Env* env, const Block& block, std::byte* data, std::size_t bytes) noexcept;

  // Whether idle blocks faulted in 4 KiB pages are collapsed into huge pages
  // (Note [Huge pages for a kept pool]): not where PINLOAD_FRESH_PAGES=small.
  bool collapses_idle_memory() const noexcept { return forced_ != PageSize::kSmall; }

  // The process's policy, shared by every load.
  static FirstTouch& process();

 private:
  static PageSize decide(double huge, double small);
  double rate_locked(PageSize size) const;  // mu_ held
  PageSize choice_locked() const;           // mu_ held; ignores forced_

  std::optional<PageSize> forced_;  // by PINLOAD_FRESH_PAGES
  mutable std::mutex mu_;
  double bytes_[2] = {0, 0};
  double seconds_[2] = {0, 0};
  using Clock = std::chrono::steady_clock;
  unsigned populating_ = 0;  // under mu_
  Clock::time_point mark_;   // under mu_: when the last populate ended
  std::atomic<bool> unsupported_{false};
};

}  // namespace pinload::detail
