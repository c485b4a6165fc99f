#include "io/stream_budget.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>

#include "base/log.h"
#include "pinload/error.h"
#include "pinload/memory_limit.h"

namespace pinload::detail {

namespace {
// How often a waiting reader looks at the consumer (which has no way to
// notify it) to tell a stall from a slow consumer.
constexpr std::chrono::milliseconds kStallPoll{20};
}  // namespace

struct StreamBudget::State {
  std::shared_ptr<Pool> pool;
  std::uint64_t capacity = 0;
  std::function<bool()> consumer_starved;
  mutable std::mutex mu;
  std::condition_variable_any returned;
  std::uint64_t held = 0;  // by size class, as the pool counts in_use
  std::uint64_t peak = 0;
  std::uint64_t files_in_progress = 0;

  void release(std::uint64_t cls) noexcept {
    {
      std::lock_guard lock(mu);
      held -= cls;
    }
    returned.notify_all();
  }
};

StreamBudget::StreamBudget(std::shared_ptr<Pool> pool, std::uint64_t capacity_bytes,
                           std::function<bool()> consumer_starved)
    : state_(std::make_shared<State>()) {
  state_->pool = std::move(pool);
  state_->capacity = capacity_bytes;
  state_->consumer_starved = std::move(consumer_starved);
}

std::uint64_t StreamBudget::capacity() const noexcept { return state_->capacity; }

void StreamBudget::check_fits(std::uint64_t bytes, const std::string& path) const {
  const std::uint64_t cls = Pool::size_class(std::max<std::uint64_t>(bytes, 1));
  if (state_->capacity != 0 && cls > state_->capacity) {
    throw OutOfMemoryError("file needs a block of " + std::to_string(cls) + " bytes, more than the streaming budget of " +
                               std::to_string(state_->capacity) +
                               " bytes (a block holds a whole file: Note [Streaming within a budget])",
                           ErrorContext{path});
  }
}

std::shared_ptr<Block> StreamBudget::allocate(std::uint64_t bytes, const std::string& path, std::stop_token stop) {
  check_fits(bytes, path);
  State& s = *state_;
  const std::uint64_t cls = Pool::size_class(std::max<std::uint64_t>(bytes, 1));
  std::unique_lock lock(s.mu);
  bool waited = false;
  for (;;) {
    if (stop.stop_requested()) {
      throw CancelledError("load cancelled while waiting for its streaming budget", ErrorContext{path});
    }
    if (s.capacity == 0 || s.held + cls <= s.capacity) {
      const std::uint64_t held_before = s.held;
      s.held += cls;
      lock.unlock();
      std::shared_ptr<Block> inner;
      try {
        // Idle memory of other size classes goes back first (Note [Streaming
        // within a budget]).
        if (s.capacity != 0) {
          const PoolStats stats = s.pool->stats();
          if (stats.reserved_bytes + cls > s.capacity && stats.reserved_bytes > stats.in_use_bytes) s.pool->trim();
        }
        inner = s.pool->allocate(static_cast<std::size_t>(bytes), stop);
      } catch (const OutOfMemoryError&) {
        lock.lock();
        s.held -= cls;
        if (held_before == 0) throw;  // nothing of this load's to wait for: the pool is held by others
        // The pool is full of this load's blocks (or their slabs): wait for
        // one, or try again if one came back while the pool refused.
        if (s.held < held_before) continue;
      } catch (...) {
        lock.lock();
        s.held -= cls;
        throw;
      }
      if (inner) {
        lock.lock();
        s.peak = std::max(s.peak, s.held);
        lock.unlock();
        if (waited) log::debug("{}: streaming budget: waited for the consumer to drop blocks", path);
        std::shared_ptr<State> keep = state_;
        Block* raw = inner.get();
        return std::shared_ptr<Block>(raw, [keep = std::move(keep), inner = std::move(inner), cls](Block*) mutable {
          inner.reset();  // back to the pool first, then to the budget
          keep->release(cls);
        });
      }
    }
    // Nothing is being read or queued and the consumer waits for more while
    // holding the rest: no block can come back.
    if (s.files_in_progress == 0 && s.consumer_starved && s.consumer_starved()) {
      throw OutOfMemoryError("streaming load stalled: the consumer holds " + std::to_string(s.held) +
                                 " bytes of earlier tensors' blocks and waits for the next tensor, whose file needs " +
                                 std::to_string(cls) + " more; the budget is " + std::to_string(s.capacity) +
                                 " bytes, of which the pool has reserved " +
                                 std::to_string(s.pool->stats().reserved_bytes) +
                                 " (drop tensors before asking for more, or raise the budget)",
                             ErrorContext{path});
    }
    waited = true;
    const std::uint64_t seen = s.held;
    s.returned.wait_for(lock, stop, kStallPoll, [&] { return s.held < seen; });
  }
}

void StreamBudget::file_started() noexcept {
  std::lock_guard lock(state_->mu);
  state_->files_in_progress++;
}

void StreamBudget::file_finished() noexcept {
  {
    std::lock_guard lock(state_->mu);
    state_->files_in_progress--;
  }
  state_->returned.notify_all();
}

std::uint64_t StreamBudget::held_bytes() const noexcept {
  std::lock_guard lock(state_->mu);
  return state_->held;
}

std::uint64_t StreamBudget::peak_held_bytes() const noexcept {
  std::lock_guard lock(state_->mu);
  return state_->peak;
}

std::uint64_t streaming_budget_bytes(const Pool& pool) {
  std::uint64_t budget = pool.options().capacity_bytes;
  if (const std::optional<HostMemoryLimit> limit = read_host_memory_limit(default_env())) {
    const PoolStats stats = pool.stats();
    const std::uint64_t idle = stats.reserved_bytes > stats.in_use_bytes ? stats.reserved_bytes - stats.in_use_bytes : 0;
    const std::uint64_t room = std::max<std::uint64_t>((limit->available_bytes + idle) / 8 * 7, 1);
    budget = budget == 0 ? room : std::min(budget, room);
  }
  return budget;
}

}  // namespace pinload::detail
