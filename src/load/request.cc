#include "pinload/request.h"

#include <chrono>
#include <thread>

#include "load/request_state.h"
#include "pinload/error.h"

namespace pinload {

const char* request_kind_name(RequestKind kind) noexcept {
  switch (kind) {
    case RequestKind::kWhole: return "whole";
    case RequestKind::kStream: return "stream";
    case RequestKind::kPrefetch: return "prefetch";
    case RequestKind::kBatch: return "batch";
    case RequestKind::kShard: return "shard";
    case RequestKind::kCached: return "cached";
  }
  return "?";
}

RequestHandle::RequestHandle(std::unique_ptr<State> state) : state_(std::move(state)) {}
RequestHandle::RequestHandle(RequestHandle&&) noexcept = default;
RequestHandle& RequestHandle::operator=(RequestHandle&& other) noexcept {
  if (this != &other) {
    RequestHandle dropped(std::move(*this));  // goes as a dropped handle goes
    state_ = std::move(other.state_);
  }
  return *this;
}

RequestHandle::~RequestHandle() {
  if (!state_) return;
  if (state_->kind == RequestKind::kPrefetch) return;  // the session keeps it for a later request
  cancel();
  // Futures of std::async join in their destructors; a LoadHandle and a
  // ShardLoad stop and join in theirs.
}

RequestKind RequestHandle::kind() const noexcept { return state_->kind; }

namespace {

// Waits for a session prefetch without holding its slot's lock while it
// reads, so that a request adopting it never waits on this handle.
void wait_for_prefetch(detail::PrefetchSlot& slot) {
  for (;;) {
    {
      std::lock_guard lock(slot.mu);
      if (slot.prefetch.done()) return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace

std::vector<Tensor> RequestHandle::next() {
  State& s = *state_;
  switch (s.kind) {
    case RequestKind::kWhole:
    case RequestKind::kStream:
      return s.load->next_ready();
    case RequestKind::kShard: {
      const StateDict batch = s.shard->next();
      return std::vector<Tensor>(batch.begin(), batch.end());
    }
    case RequestKind::kCached: {
      if (s.handed_out) return {};
      if (!s.cached_result) s.cached_result = s.cached.get();
      s.handed_out = true;
      return std::vector<Tensor>(s.cached_result->begin(), s.cached_result->end());
    }
    case RequestKind::kPrefetch:
    case RequestKind::kBatch:
      return {};
  }
  return {};
}

StateDict RequestHandle::wait() {
  State& s = *state_;
  switch (s.kind) {
    case RequestKind::kWhole:
    case RequestKind::kStream:
      return s.load->wait();
    case RequestKind::kShard: {
      std::vector<Tensor> tensors;
      for (StateDict batch = s.shard->next(); !batch.empty(); batch = s.shard->next()) {
        tensors.insert(tensors.end(), batch.begin(), batch.end());
      }
      return StateDict(std::move(tensors));
    }
    case RequestKind::kCached:
      if (!s.cached_result) s.cached_result = s.cached.get();
      return *s.cached_result;
    case RequestKind::kPrefetch:
      wait_for_prefetch(*s.prefetch);
      return {};
    case RequestKind::kBatch:
      throw InvalidArgumentError("a batch request's results are its items: wait_batch()");
  }
  return {};
}

std::vector<BatchItem> RequestHandle::wait_batch() {
  State& s = *state_;
  if (s.kind != RequestKind::kBatch) {
    throw InvalidArgumentError(std::string("wait_batch() is a batch request's; this one is a ") +
                               request_kind_name(s.kind) + " request: wait()");
  }
  return s.batch.get();
}

void RequestHandle::cancel() noexcept {
  if (!state_) return;
  State& s = *state_;
  if (s.load) s.load->cancel();
  if (s.prefetch) {
    std::lock_guard lock(s.prefetch->mu);
    s.prefetch->prefetch.cancel();
  }
  s.stop.request_stop();
  if (s.kind == RequestKind::kShard) s.shard.reset();  // stops its reader and joins
}

bool RequestHandle::done() const noexcept {
  const State& s = *state_;
  switch (s.kind) {
    case RequestKind::kWhole:
    case RequestKind::kStream:
      return s.load->done();
    case RequestKind::kPrefetch: {
      std::lock_guard lock(s.prefetch->mu);
      return s.prefetch->prefetch.done();
    }
    case RequestKind::kShard:
      return !s.shard;
    case RequestKind::kBatch:
      return !s.batch.valid() || s.batch.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    case RequestKind::kCached:
      return s.cached_result.has_value() || s.cached.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  return true;
}

LoadProgress RequestHandle::progress() const noexcept {
  const State& s = *state_;
  switch (s.kind) {
    case RequestKind::kWhole:
    case RequestKind::kStream:
      return s.load->progress();
    case RequestKind::kPrefetch: {
      std::lock_guard lock(s.prefetch->mu);
      return s.prefetch->prefetch.progress();
    }
    case RequestKind::kShard: {
      LoadProgress p;
      if (s.shard) {
        p.bytes_done = s.shard->bytes_read();
        p.bytes_total = s.shard->plan().read_bytes;
      }
      return p;
    }
    case RequestKind::kBatch:
    case RequestKind::kCached:
      return {};
  }
  return {};
}

}  // namespace pinload
