#include "pinload/pool.h"

#include <algorithm>
#include <bit>
#include <condition_variable>
#include <cstdio>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <vector>

#include "memory/first_touch.h"
#include "memory/huge_page_collapse.h"
#include "pinload/error.h"

namespace pinload {
namespace {

constexpr std::size_t kGranule = 4096;
constexpr std::size_t kSmallLimit = 64 * 1024;
constexpr std::size_t kReuseSlackNum = 5, kReuseSlackDen = 4;  // reuse a class <= 1.25x
constexpr std::size_t kMaxRequest = std::size_t{1} << 62;  // more than any host has

std::size_t round_up(std::size_t n, std::size_t align) { return (n + align - 1) / align * align; }

// "6 MiB", "64 KiB", "1.5 GiB": for messages.
std::string human(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  const bool whole = value == static_cast<double>(static_cast<std::uint64_t>(value));
  char out[32];
  std::snprintf(out, sizeof out, whole ? "%.0f %s" : "%.1f %s", value, kUnits[unit]);
  return out;
}

}  // namespace

struct Slab {
  HostRange range;
  std::size_t block_class = 0;  // size class of its blocks
  std::size_t blocks_total = 0;
  std::size_t blocks_free = 0;
};

struct Pool::State {
  std::unique_ptr<HostMemoryBackend> backend;
  PoolOptions options;
  mutable std::mutex mu;
  std::condition_variable_any returned;
  // Bumped (with a notify) whenever memory may have come free: a block
  // returned, budget given back, a slab with spare blocks added. Waiters wait
  // for a change, not for a level, which a take-and-return would hide.
  std::uint64_t events = 0;
  // Reservations counted in the budget whose backend call has not returned:
  // a request that finds the budget full waits for them, even under kFail
  // (their spare blocks may serve it), rather than fail.
  std::size_t reserving = 0;
  std::list<Slab> slabs;  // stable addresses
  std::map<std::size_t, std::vector<std::pair<std::byte*, Slab*>>> free_lists;  // by class
  PoolStats stats;
  // Idle blocks first touched in 4 KiB pages, to collapse into huge pages
  // (Note [Huge pages for a kept pool] in memory/huge_page_collapse.h).
  const std::shared_ptr<detail::IdleBlocks> idle = std::make_shared<detail::IdleBlocks>();

  ~State() {
    idle->close();
    for (Slab& slab : slabs) backend->release(slab.range);
  }

  // Returns evicted reservations to the OS (unlocked), once no collapse
  // step is on them.
  void release(const std::vector<HostRange>& evicted) {
    for (const HostRange& r : evicted) {
      auto* begin = static_cast<const std::byte*>(r.data);
      idle->forget(begin, begin + r.bytes);
      backend->release(r);
    }
  }

  // A reservation of its own for class `cls`: whole backend alignment units,
  // so it may hold a few blocks of a small class.
  std::size_t own_reservation(std::size_t cls) const { return round_up(cls, backend->alignment()); }
  // The preferred reservation: a shared slab for small classes.
  std::size_t reservation_for(std::size_t cls) const {
    return cls <= options.slab_bytes / 4 ? options.slab_bytes : own_reservation(cls);
  }
  bool fits_budget(std::size_t reservation) const {
    return options.capacity_bytes == 0 || stats.reserved_bytes + reservation <= options.capacity_bytes;
  }

  // Takes a free block of class `cls` (or one at most 25% larger). Locked.
  bool take_free(std::size_t cls, std::byte** data, Slab** slab) {
    auto it = free_lists.lower_bound(cls);
    const bool large = cls > options.slab_bytes / 4;
    for (; it != free_lists.end(); ++it) {
      if (it->first != cls && (!large || it->first > cls / kReuseSlackDen * kReuseSlackNum)) break;
      if (it->second.empty()) continue;
      std::tie(*data, *slab) = it->second.back();
      it->second.pop_back();
      (*slab)->blocks_free--;
      return true;
    }
    return false;
  }

  // Unlinks idle slabs until `needed` more bytes fit the budget (or all idle
  // ones if needed == SIZE_MAX). Locked; the caller releases the returned
  // ranges after unlocking.
  std::vector<HostRange> evict_idle(std::uint64_t needed) {
    std::vector<HostRange> evicted;
    auto fits = [&] {
      return needed != UINT64_MAX && (options.capacity_bytes == 0 || stats.reserved_bytes + needed <= options.capacity_bytes);
    };
    for (auto it = slabs.begin(); it != slabs.end() && !fits();) {
      if (it->blocks_free != it->blocks_total) {
        ++it;
        continue;
      }
      auto& list = free_lists[it->block_class];
      Slab* slab = &*it;
      list.erase(std::remove_if(list.begin(), list.end(), [&](const auto& e) { return e.second == slab; }), list.end());
      stats.reserved_bytes -= it->range.bytes;
      events++;
      stats.os_releases++;
      evicted.push_back(it->range);
      it = slabs.erase(it);
    }
    return evicted;
  }

  void release_block(std::byte* data, std::size_t cls, Slab* slab) noexcept {
    {
      std::lock_guard lock(mu);
      free_lists[cls].emplace_back(data, slab);
      slab->blocks_free++;
      stats.in_use_bytes -= cls;
      stats.live_blocks--;
      events++;
    }
    returned.notify_all();
  }
};

std::size_t Pool::size_class(std::size_t bytes) noexcept {
  if (bytes <= kSmallLimit) return std::max<std::size_t>(kGranule, round_up(bytes, kGranule));
  const std::size_t p = std::bit_floor(bytes - 1);
  const std::size_t step = std::max<std::size_t>(kGranule, p / 8);
  if (bytes > std::numeric_limits<std::size_t>::max() - (step - 1)) return std::numeric_limits<std::size_t>::max();
  return round_up(bytes, step);
}

std::shared_ptr<Pool> Pool::create(std::unique_ptr<HostMemoryBackend> backend, PoolOptions options) {
  auto state = std::make_shared<State>();
  const std::size_t align = backend->alignment();
  options.slab_bytes = std::max<std::size_t>(align, (options.slab_bytes + align - 1) / align * align);
  state->backend = std::move(backend);
  state->options = options;
  state->stats.capacity_bytes = options.capacity_bytes;
  return std::shared_ptr<Pool>(new Pool(std::move(state)));
}

std::shared_ptr<Pool> Pool::create_default(PoolOptions options) {
  return create(make_locked_memory_backend(default_env(), kHostPoolMemory), options);
}

Pool::Pool(std::shared_ptr<State> state) : state_(std::move(state)) {}

Pool::~Pool() { trim(); }

std::size_t Pool::own_reservation_for(std::size_t bytes) const noexcept {
  const std::size_t cls = size_class(bytes);
  return cls == SIZE_MAX ? SIZE_MAX : state_->own_reservation(cls);
}

std::size_t Pool::blocks_available(std::size_t bytes) const {
  const State& s = *state_;
  const std::uint64_t capacity = s.options.capacity_bytes;
  const std::size_t cls = size_class(std::max<std::size_t>(bytes, 1));
  if (cls == SIZE_MAX) return 0;
  if (capacity == 0) return SIZE_MAX;
  std::lock_guard lock(s.mu);
  std::size_t blocks = 0;
  if (const auto it = s.free_lists.find(cls); it != s.free_lists.end()) blocks = it->second.size();
  std::uint64_t room = capacity - std::min<std::uint64_t>(capacity, s.stats.reserved_bytes);
  for (const Slab& slab : s.slabs) {
    if (slab.block_class != cls && slab.blocks_free == slab.blocks_total) room += slab.range.bytes;
  }
  // New reservations: shared slabs first where the class takes them, then
  // reservations of its own (Note [Size classes]).
  const std::size_t preferred = s.reservation_for(cls), own = s.own_reservation(cls);
  if (preferred != own) {
    blocks += static_cast<std::size_t>(room / preferred) * (preferred / cls);
    room %= preferred;
  }
  return blocks + static_cast<std::size_t>(room / own) * (own / cls);
}

const PoolOptions& Pool::options() const noexcept { return state_->options; }
std::string_view Pool::backend_name() const noexcept { return state_->backend->name(); }

PoolStats Pool::stats() const {
  std::lock_guard lock(state_->mu);
  PoolStats stats = state_->stats;
  stats.collapsed_bytes = state_->idle->collapsed_bytes();
  return stats;
}

void Pool::trim() {
  std::vector<HostRange> evicted;
  {
    std::lock_guard lock(state_->mu);
    evicted = state_->evict_idle(UINT64_MAX);
  }
  state_->release(evicted);
  if (!evicted.empty()) state_->returned.notify_all();
}

std::shared_ptr<Block> Pool::allocate(std::size_t bytes, std::stop_token stop) {
  if (bytes == 0) bytes = 1;
  State& s = *state_;
  if (bytes > kMaxRequest) {
    throw OutOfMemoryError("request of " + std::to_string(bytes) + " bytes exceeds any host memory");
  }
  const std::size_t cls = size_class(bytes);
  // A small class prefers a shared slab; where that does not fit the budget,
  // it takes a reservation of its own rather than fail or wait.
  const std::size_t preferred = s.reservation_for(cls);
  const std::size_t own = s.own_reservation(cls);
  const std::uint64_t capacity = s.options.capacity_bytes;
  if (capacity != 0 && own > capacity) {
    throw OutOfMemoryError("request of " + std::to_string(bytes) + " bytes (class " + human(cls) +
                           ") exceeds the pool budget of " + human(capacity));
  }
  const auto deadline = std::chrono::steady_clock::now() + s.options.wait_timeout;

  std::byte* data = nullptr;
  Slab* slab = nullptr;
  std::unique_lock lock(s.mu);
  bool waited = false;
  bool fresh_reservation = false;
  while (!s.take_free(cls, &data, &slab)) {
    if (!s.fits_budget(own)) {
      std::vector<HostRange> evicted = s.evict_idle(own);
      if (!evicted.empty()) {
        lock.unlock();
        s.release(evicted);
        s.returned.notify_all();  // what this request leaves may fit a waiter
        lock.lock();
        continue;  // a block may have come back meanwhile
      }
    }
    if (s.fits_budget(own)) {
      const std::size_t reservation = s.fits_budget(preferred) ? preferred : own;
      // Reserve the budget, then call the backend unlocked.
      s.stats.reserved_bytes += reservation;
      s.reserving++;
      lock.unlock();
      HostRange range;
      try {
        range = s.backend->reserve(reservation);
      } catch (...) {
        lock.lock();
        s.stats.reserved_bytes -= reservation;
        s.reserving--;
        s.events++;
        lock.unlock();
        s.returned.notify_all();  // waiters may fit now
        throw;
      }
      lock.lock();
      s.reserving--;
      s.stats.os_reservations++;
      s.stats.peak_reserved_bytes = std::max(s.stats.peak_reserved_bytes, s.stats.reserved_bytes);
      Slab& fresh = s.slabs.emplace_back();
      fresh.range = range;
      fresh.block_class = cls;
      fresh.blocks_total = reservation / cls;
      fresh.blocks_free = fresh.blocks_total;
      auto& list = s.free_lists[cls];
      auto* base = static_cast<std::byte*>(range.data);
      for (std::size_t i = fresh.blocks_total; i-- > 0;) list.emplace_back(base + i * cls, &fresh);
      // Spare blocks a waiter of this class can take; or, under kFail, a
      // waiter that only waited for this reservation fails now.
      s.events++;
      s.returned.notify_all();
      fresh_reservation = true;
      continue;
    }
    if (s.options.when_full == WhenFull::kFail && s.reserving == 0) {
      throw OutOfMemoryError("pool budget of " + human(capacity) + " exhausted: " + human(s.stats.in_use_bytes) +
                             " in use, " + std::to_string(bytes) + " bytes requested");
    }
    if (!waited) {
      s.stats.budget_waits++;
      waited = true;
    }
    const std::uint64_t seen = s.events;
    const bool woke = s.returned.wait_until(lock, stop, deadline, [&] { return s.events != seen; });
    if (stop.stop_requested()) throw CancelledError("cancelled while waiting for pool memory");
    if (!woke) {
      throw OutOfMemoryError("pool budget of " + human(capacity) + " still exhausted after waiting " +
                             std::to_string(s.options.wait_timeout.count()) + " ms: " +
                             human(s.stats.in_use_bytes) + " in use, " + std::to_string(bytes) +
                             " bytes requested");
    }
  }
  const std::size_t block_class = slab->block_class;
  if (!fresh_reservation) s.stats.free_list_hits++;
  s.stats.allocations++;
  s.stats.live_blocks++;
  s.stats.in_use_bytes += block_class;
  s.stats.peak_in_use_bytes = std::max(s.stats.peak_in_use_bytes, s.stats.in_use_bytes);
  const bool locked = slab->range.locked;
  // Memory still in 4 KiB pages, its collapse not finished: marked again.
  const bool small_pages = s.idle->take(data);
  lock.unlock();

  std::shared_ptr<State> keep = state_;
  Block* block = new Block(data, bytes, block_class, locked, slab);
  block->small_pages_.store(small_pages, std::memory_order_relaxed);
  return std::shared_ptr<Block>(block, [keep = std::move(keep)](Block* b) {
    if (b->small_pages_.load(std::memory_order_relaxed) && detail::FirstTouch::process().collapses_idle_memory()) {
      detail::IdleBlocks::collapse_later(keep->idle, b->data(), b->capacity());
    }
    keep->release_block(b->data(), b->capacity(), static_cast<Slab*>(b->slab_));
    delete b;
  });
}

}  // namespace pinload
