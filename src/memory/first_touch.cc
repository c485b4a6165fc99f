#include "memory/first_touch.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "base/log.h"
#include "base/madvise.h"

namespace pinload::detail {
namespace {

// Each record weighs the older ones by this: a rate follows the last few chunks.
constexpr double kDecay = 0.75;

int index(FirstTouch::PageSize size) { return size == FirstTouch::PageSize::kHuge ? 0 : 1; }

std::uintptr_t page_bytes() {
  static const std::uintptr_t page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

FirstTouch::PageSize FirstTouch::decide(double huge, double small) {
  if (huge == 0 || huge >= kSlowHugePages) return PageSize::kHuge;
  if (small == 0) return PageSize::kSmall;  // THP is slow: try 4 KiB pages
  return small > huge ? PageSize::kSmall : PageSize::kHuge;
}

FirstTouch::FirstTouch() {
  const char* v = std::getenv(kPagesVariable);
  const std::string_view mode = v != nullptr ? v : "";
  if (mode == "huge") forced_ = PageSize::kHuge;
  else if (mode == "small") forced_ = PageSize::kSmall;
  else if (!mode.empty() && mode != "auto") log::warn("{}={}: not auto, huge or small; using auto", kPagesVariable, mode);
}

double FirstTouch::rate_locked(PageSize size) const {
  const int i = index(size);
  return seconds_[i] > 0 ? bytes_[i] / seconds_[i] : 0;
}

FirstTouch::PageSize FirstTouch::choice_locked() const {
  return decide(rate_locked(PageSize::kHuge), rate_locked(PageSize::kSmall));
}

FirstTouch::PageSize FirstTouch::choice() const {
  if (forced_) return *forced_;
  std::lock_guard lock(mu_);
  return choice_locked();
}

double FirstTouch::rate(PageSize size) const {
  std::lock_guard lock(mu_);
  return rate_locked(size);
}

void FirstTouch::record(PageSize size, std::size_t bytes, double seconds) {
  if (seconds <= 0) seconds = 1e-9;
  const int i = index(size);
  std::lock_guard lock(mu_);
  const PageSize before = choice_locked();
  bytes_[i] = bytes_[i] * kDecay + static_cast<double>(bytes);
  seconds_[i] = seconds_[i] * kDecay + seconds;
  if (const PageSize now = choice_locked(); now != before) {
    log::debug("first touch of fresh memory: huge pages {:.2f} GB/s, 4 KiB pages {:.2f} GB/s; now {}",
               rate_locked(PageSize::kHuge) / 1e9, rate_locked(PageSize::kSmall) / 1e9,
               now == PageSize::kHuge ? "huge pages" : "4 KiB pages");
  }
}

void FirstTouch::fault_in(Env* env, const Block& block, std::byte* data, std::size_t bytes) noexcept {
  if (bytes == 0 || block.locked() || unsupported_.load(std::memory_order_relaxed)) return;
  const std::uintptr_t page = page_bytes();
  const std::uintptr_t begin = reinterpret_cast<std::uintptr_t>(data) & ~(page - 1);
  const std::uintptr_t end = (reinterpret_cast<std::uintptr_t>(data) + bytes + page - 1) & ~(page - 1);
  auto* start = reinterpret_cast<void*>(begin);
  const std::size_t length = end - begin;
  if (env->page_resident(start) != 0) return;  // present, or unknown: left to the writes
  const PageSize size = block.small_pages_.load(std::memory_order_relaxed) ? PageSize::kSmall : choice();
  if (size == PageSize::kSmall && !block.small_pages_.exchange(true)) {
    // Pages already faulted in keep their size.
    (void)env->advise(block.data(), block.capacity(), MADV_NOHUGEPAGE);
  }
  {
    std::lock_guard lock(mu_);
    if (populating_++ == 0) mark_ = Clock::now();
  }
  const int rc = env->advise(start, length, kMadvPopulateWrite);
  double seconds = 0;
  {
    // The time since the last populate ended (or since this one began, when
    // none ran): over many readers, bytes over it is the memory's rate.
    std::lock_guard lock(mu_);
    --populating_;
    const Clock::time_point now = Clock::now();
    seconds = std::chrono::duration<double>(now - mark_).count();
    mark_ = now;
  }
  if (rc == -EINVAL || rc == -ENOSYS) {
    if (!unsupported_.exchange(true)) log::debug("MADV_POPULATE_WRITE unavailable ({}): writes fault memory in", rc);
    return;
  }
  if (rc != 0 || length < kMeasuredBytes) return;  // a failure shows again, and is reported, at the write
  record(size, length, seconds);
}

FirstTouch& FirstTouch::process() {
  static FirstTouch* policy = new FirstTouch();  // never destroyed: used by threads until exit
  return *policy;
}

}  // namespace pinload::detail
