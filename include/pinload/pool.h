// pinload/pool.h: a two-level pool of (pinned) host memory reused across loads.
//
// Level 1: reservations ("slabs") taken from a HostMemoryBackend, rarely.
// Level 2: blocks carved from them by size class and recycled through free
// lists, so a re-load after an unload makes no new OS allocation.
//
// Note [Size classes]
// A request rounds up to its size class: 4 KiB granules up to 64 KiB, then 8
// classes per power of two (step = 2^floor(log2(n-1)) / 8), so a block is at
// most 12.5% larger than asked: a 4 GB request costs 4 GB (class 3.75 GiB,
// ~4.03e9 B), never 8. Classes up to slab_bytes/4 are carved from shared slabs
// of slab_bytes; larger classes, and small ones when a slab would not fit the
// budget, get a reservation of their own (rounded up to the backend's
// alignment). A free block of a larger class (at most 25% larger) may serve a
// request, so a 2.9 GB load reuses the block that a 2.8 GB one released.
// Requests above 2^62 bytes have no class and fail with OutOfMemoryError.
//
// Note [Budget]
// `capacity_bytes` caps what the pool reserves from the OS. When a request
// does not fit, idle reservations are released first; if that is not enough,
// allocate() either fails at once with OutOfMemoryError (WhenFull::kFail) or
// waits for blocks to come back (WhenFull::kWait), up to `wait_timeout`, and
// then fails the same way. Either waits while another thread's reservation
// is in flight (its budget counted, its backend call not returned): its
// spare blocks may serve the request, so concurrent first allocations into a
// fresh pool do not fail for memory that is on its way. Cancelling the
// stop_token ends a wait with CancelledError.
//
// Thread safety: all methods are safe to call concurrently. The lock is never
// held across a backend call.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stop_token>

#include "pinload/host_memory.h"

namespace pinload {

enum class WhenFull { kFail, kWait };

struct PoolOptions {
  std::uint64_t capacity_bytes = 0;  // 0: unlimited
  WhenFull when_full = WhenFull::kFail;
  std::chrono::milliseconds wait_timeout{std::chrono::minutes(10)};
  std::size_t slab_bytes = 64u << 20;  // level-1 reservation for small classes
};

struct PoolStats {
  std::uint64_t capacity_bytes = 0;     // 0: unlimited
  std::uint64_t reserved_bytes = 0;     // held from the OS now
  std::uint64_t in_use_bytes = 0;       // in live blocks (by size class)
  std::uint64_t peak_in_use_bytes = 0;
  std::uint64_t peak_reserved_bytes = 0;
  std::uint64_t allocations = 0;        // blocks handed out
  std::uint64_t free_list_hits = 0;     // ... of which reused a free block
  std::uint64_t os_reservations = 0;    // backend reserve() calls
  std::uint64_t os_releases = 0;        // backend release() calls
  std::uint64_t budget_waits = 0;       // allocations that had to wait
  std::uint64_t live_blocks = 0;
  // Idle memory first touched in 4 KiB pages, since collapsed into huge pages
  // (Note [Huge pages for a kept pool] in src/memory/huge_page_collapse.h).
  std::uint64_t collapsed_bytes = 0;
};

class Pool;

namespace detail {
class LeasedMapping;  // a file mapping handed out as a block (Note [Leased mappings])
class FirstTouch;     // faults fresh blocks in (Note [Page size of fresh memory])
class StoreMapping;   // a node-store entry mapped by a client (Note [The node store] in store.h)
}

// A contiguous piece of pool memory. Shared through std::shared_ptr<Block>;
// the memory returns to the pool's free list when the last owner lets go.
// (A zero-copy load's block is a file mapping instead: Note [Zero-copy loads]
// in loader.h.)
class Block {
 public:
  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }          // as requested
  std::size_t capacity() const noexcept { return capacity_; }  // its size class
  bool locked() const noexcept { return locked_; }

 private:
  friend class Pool;
  friend class detail::LeasedMapping;
  friend class detail::FirstTouch;
  friend class detail::StoreMapping;
  Block(std::byte* data, std::size_t size, std::size_t capacity, bool locked, void* slab)
      : data_(data), size_(size), capacity_(capacity), locked_(locked), slab_(slab) {}
  std::byte* data_;
  std::size_t size_;
  std::size_t capacity_;
  bool locked_;
  void* slab_;
  // In 4 KiB pages: advised MADV_NOHUGEPAGE by FirstTouch, or its collapse
  // not finished (Note [Huge pages for a kept pool]).
  mutable std::atomic<bool> small_pages_{false};
};

class Pool {
 public:
  // The pool owns `backend`.
  static std::shared_ptr<Pool> create(std::unique_ptr<HostMemoryBackend> backend, PoolOptions options = {});
  // A pool for host-only loads, on default_env(): THP-backed, not locked
  // (Note [Locking host pools] in host_memory.h).
  static std::shared_ptr<Pool> create_default(PoolOptions options = {});
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // A block of at least `bytes` (> 0) bytes, page-aligned, contents
  // unspecified. Throws OutOfMemoryError (budget or OS), CancelledError.
  std::shared_ptr<Block> allocate(std::size_t bytes, std::stop_token stop = {});

  PoolStats stats() const;
  // Returns every idle reservation to the OS.
  void trim();
  const PoolOptions& options() const noexcept;
  std::string_view backend_name() const noexcept;

  // The size class of a request (Note [Size classes]); SIZE_MAX where the
  // request is too large for any class.
  static std::size_t size_class(std::size_t bytes) noexcept;
  // What a request of `bytes` in a reservation of its own takes of the
  // budget: its size class rounded up to the backend's alignment.
  std::size_t own_reservation_for(std::size_t bytes) const noexcept;
  // How many blocks of `bytes` the pool could hand out now without waiting:
  // free ones of their class, and those new reservations hold within the
  // budget that is neither reserved nor in idle reservations of other
  // classes (which it would release first). SIZE_MAX without a budget.
  std::size_t blocks_available(std::size_t bytes) const;

  struct State;

 private:
  explicit Pool(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace pinload
