// pinload/host_memory.h: where the pool's slabs come from.
//
// A HostMemoryBackend reserves and releases large, page-aligned host ranges.
// The pool calls it rarely (once per slab) and never while holding its lock.
// Backends: locked (mmap + mlock, here), CUDA pinned (cuda_memory.h).
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "pinload/env.h"

namespace pinload {

struct HostRange {
  void* data = nullptr;
  std::size_t bytes = 0;
  bool locked = false;      // page-locked (mlock'ed or CUDA pinned)
  bool huge_pages = false;  // backed by explicit huge pages (MAP_HUGETLB)
};

class HostMemoryBackend {
 public:
  virtual ~HostMemoryBackend() = default;
  // Reserves `bytes` (a multiple of alignment()). Throws OutOfMemoryError.
  virtual HostRange reserve(std::size_t bytes) = 0;
  // Returns a range from reserve(). Never throws.
  virtual void release(const HostRange& range) noexcept = 0;
  virtual std::size_t alignment() const noexcept = 0;
  virtual std::string_view name() const noexcept = 0;
};

enum class HugePages {
  kOff,          // plain pages
  kTransparent,  // madvise(MADV_HUGEPAGE): the kernel may back with THP
  kExplicit,     // MAP_HUGETLB first, falling back to kTransparent
};

struct LockedMemoryOptions {
  HugePages huge_pages = HugePages::kTransparent;
  // mlock each range. Where RLIMIT_MEMLOCK refuses, fall back to unlocked
  // memory and warn once.
  bool lock = true;
  // >= 0: each range prefers this NUMA node (Env::bind_memory), bound before
  // any of its pages is touched or locked. Where the kernel refuses, pages go
  // where the OS puts them, with one warning. -1: no binding, no Env call.
  int numa_node = -1;
};

// mmap-backed memory, mlock'ed where the limit allows. `env` must outlive it.
std::unique_ptr<HostMemoryBackend> make_locked_memory_backend(Env* env, LockedMemoryOptions options = {});

// Note [Locking host pools]
// Pools for host-only loads (the Loader's own pool without a device,
// Pool::create_default, the Python "cpu" pool) are THP-backed and not locked:
// nothing DMAs from them through a device (torch copies them as pageable
// memory), and locking THP memory as it is faulted in made the first load of a
// fresh process 1.6-1.8x slower (docs/tuning.md, "Locking and the first
// load"). Pools for a device are pinned by the device's own backend. A host
// pool that must stay in RAM whatever swap does takes LockedMemoryOptions{}.
inline constexpr LockedMemoryOptions kHostPoolMemory{.lock = false};

}  // namespace pinload
