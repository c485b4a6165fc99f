#include "pinload/copy_engine.h"

#include <algorithm>
#include <atomic>
#include <string>

#include "base/log.h"
#include "pinload/error.h"

namespace pinload {

namespace detail {
// One submit. `host`, `dst`, `events`, `bytes`, `chunks` and `enqueue_error`
// are written by submit() before the state is queued and afterwards touched
// by the reaper alone; `error` and `done` are guarded by `mu`.
struct TicketState {
  std::shared_ptr<Block> host;
  std::shared_ptr<DeviceBuffer> dst;
  std::vector<Event> events;
  std::size_t bytes = 0;
  std::size_t chunks = 0;
  std::exception_ptr enqueue_error;

  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;
  std::atomic<bool> done{false};
};
}  // namespace detail

namespace {

void check_range(const char* what, std::size_t offset, std::size_t bytes, std::size_t size) {
  if (offset > size || bytes > size - offset) {
    throw InvalidArgumentError(std::string("copy of ") + std::to_string(bytes) + " bytes at offset " +
                           std::to_string(offset) + " leaves the " + what + " of " + std::to_string(size) + " bytes");
  }
}

}  // namespace

std::vector<CopyChunk> plan_copy(std::size_t host_offset, std::size_t device_offset, std::size_t bytes,
                                 std::size_t chunk_bytes, std::size_t streams, std::size_t first_stream) {
  if (chunk_bytes == 0) throw InvalidArgumentError("copy chunk size must be positive");
  if (streams == 0) throw InvalidArgumentError("copy stream count must be positive");
  std::vector<CopyChunk> plan;
  plan.reserve(bytes / chunk_bytes + 1);
  for (std::size_t done = 0, i = 0; done < bytes; ++i) {
    const std::size_t n = std::min(chunk_bytes, bytes - done);
    plan.push_back(CopyChunk{host_offset + done, device_offset + done, n, (first_stream + i) % streams});
    done += n;
  }
  return plan;
}

bool CopyTicket::done() const noexcept { return !state_ || state_->done.load(std::memory_order_acquire); }

void CopyTicket::wait() const {
  if (!state_) return;
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done.load(std::memory_order_relaxed); });
  if (state_->error) std::rethrow_exception(state_->error);
}

std::size_t CopyTicket::bytes() const noexcept { return state_ ? state_->bytes : 0; }
std::size_t CopyTicket::chunks() const noexcept { return state_ ? state_->chunks : 0; }

CopyEngine::CopyEngine(Device& device, CopyOptions options) : device_(device), options_(options) {
  // plan_copy's checks, before any stream exists.
  (void)plan_copy(0, 0, 0, options_.chunk_bytes, options_.streams);
  streams_.reserve(options_.streams);
  for (std::size_t i = 0; i < options_.streams; ++i) streams_.push_back(device_.create_stream());
  reaper_ = std::thread([this] { reap(); });
}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  changed_.notify_all();
  reaper_.join();  // it drains pending_ first
  streams_.clear();
}

CopyTicket CopyEngine::submit(std::shared_ptr<Block> host_block, std::size_t host_offset,
                              const std::shared_ptr<DeviceBuffer>& dst, std::size_t dst_offset, std::size_t bytes) {
  if (!host_block) throw InvalidArgumentError("copy submitted without a host block");
  if (!dst) throw InvalidArgumentError("copy submitted without a device buffer");
  if (dst->device_id() != device_.id()) {
    throw InvalidArgumentError("copy submitted with a DeviceBuffer of another device than " + device_.name());
  }
  check_range("host block", host_offset, bytes, host_block->size());
  check_range("device buffer", dst_offset, bytes, dst->size());
  if (bytes == 0) return CopyTicket();

  auto state = std::make_shared<detail::TicketState>();
  state->bytes = bytes;
  std::vector<CopyChunk> plan;
  {
    std::unique_lock lock(mu_);
    if (options_.max_in_flight_bytes != 0) {
      bool stalled = false;
      while (stats_.in_flight_bytes != 0 && stats_.in_flight_bytes + bytes > options_.max_in_flight_bytes) {
        if (!stalled) stats_.stalls++;
        stalled = true;
        changed_.wait(lock);
      }
    }
    plan = plan_copy(host_offset, dst_offset, bytes, options_.chunk_bytes, streams_.size(), next_stream_);
    next_stream_ = (next_stream_ + plan.size()) % streams_.size();
    stats_.in_flight_bytes += bytes;  // from here on, the reaper gives it back
    stats_.peak_in_flight_bytes = std::max(stats_.peak_in_flight_bytes, stats_.in_flight_bytes);
  }

  // Queue the chunks, then one event on each stream used.
  std::vector<bool> used(streams_.size(), false);
  std::exception_ptr error;
  std::size_t queued = 0;
  try {
    for (const CopyChunk& c : plan) {
      device_.copy_to_device_async(*dst, c.device_offset, host_block->data() + c.host_offset, c.bytes,
                                   streams_[c.stream]);
      used[c.stream] = true;
      ++queued;
    }
  } catch (...) {
    error = std::current_exception();
  }
  bool events_ok = true;
  for (std::size_t s = 0; s < streams_.size(); ++s) {
    if (!used[s]) continue;
    try {
      state->events.push_back(device_.record(streams_[s]));
    } catch (...) {
      events_ok = false;
      if (!error) error = std::current_exception();
    }
  }
  if (!events_ok) {
    // Without events, wait for the streams instead; if even that fails, no
    // one knows when the DMA engines stop reading the block: never free it.
    state->events.clear();
    bool drained = true;
    for (std::size_t s = 0; s < streams_.size(); ++s) {
      if (!used[s]) continue;
      try {
        streams_[s].synchronize();
      } catch (...) {
        drained = false;
      }
    }
    if (!drained) {
      log::warn("copy engine on {}: the device failed with copies in flight; leaking a host block of {} bytes",
                device_.name(), host_block->capacity());
      new std::shared_ptr<Block>(host_block);  // NOLINT: deliberate leak, see copy_engine.h
      new std::shared_ptr<DeviceBuffer>(dst);  // NOLINT
    }
  }
  state->host = std::move(host_block);
  state->dst = dst;
  state->chunks = queued;
  state->enqueue_error = error;
  {
    std::lock_guard lock(mu_);
    stats_.tickets_submitted++;
    stats_.bytes_submitted += bytes;
    stats_.chunks += queued;
    stats_.events += state->events.size();
    pending_.push_back(state);
  }
  changed_.notify_all();
  if (error) std::rethrow_exception(error);
  return CopyTicket(std::move(state));
}

void CopyEngine::reap() {
  std::unique_lock lock(mu_);
  for (;;) {
    changed_.wait(lock, [&] { return stop_ || !pending_.empty(); });
    if (pending_.empty()) return;  // stop_, and every copy has completed
    std::shared_ptr<detail::TicketState> state = pending_.front();
    lock.unlock();
    std::exception_ptr error = state->enqueue_error;
    for (Event& event : state->events) {
      try {
        event.synchronize();
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    finish(state, error);
    lock.lock();
  }
}

// Lets go of the ticket's references (a pool block returns to its free list
// here), then marks it done, all before wait_all() can see it gone.
void CopyEngine::finish(const std::shared_ptr<detail::TicketState>& state, std::exception_ptr error) {
  state->events.clear();
  state->host.reset();
  state->dst.reset();
  {
    std::lock_guard lock(mu_);
    pending_.pop_front();
    stats_.tickets_completed++;
    stats_.bytes_completed += state->bytes;
    stats_.in_flight_bytes -= state->bytes;
    if (error) {
      stats_.tickets_failed++;
      if (!first_error_) first_error_ = error;
    }
    std::lock_guard ticket_lock(state->mu);
    state->error = error;
    state->done.store(true, std::memory_order_release);
  }
  state->cv.notify_all();
  changed_.notify_all();
}

void CopyEngine::wait_all() {
  std::unique_lock lock(mu_);
  changed_.wait(lock, [&] { return pending_.empty() && stats_.in_flight_bytes == 0; });
  if (first_error_) std::rethrow_exception(first_error_);
}

CopyStats CopyEngine::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

}  // namespace pinload
