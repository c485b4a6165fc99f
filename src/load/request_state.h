// Internal: what a RequestHandle holds for each kind of request (Note
// [Requests] in request.h), shared by session.cc, which starts requests, and
// request.cc, which answers the handle.
#pragma once

#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <vector>

#include "pinload/batch.h"
#include "pinload/loader.h"
#include "pinload/prefetch.h"
#include "pinload/request.h"
#include "pinload/shard.h"

namespace pinload {

namespace detail {

// A session's prefetch, until a request adopts it; the lock guards the
// Prefetch object (moved out by the adopting request), never a wait.
struct PrefetchSlot {
  std::mutex mu;
  Prefetch prefetch;
};

}  // namespace detail

struct RequestHandle::State {
  RequestKind kind = RequestKind::kWhole;
  std::optional<LoadHandle> load;                        // kWhole, kStream
  std::shared_ptr<detail::PrefetchSlot> prefetch;        // kPrefetch
  std::unique_ptr<ShardLoad> shard;                      // kShard
  std::future<std::vector<BatchItem>> batch;             // kBatch
  std::future<StateDict> cached;                         // kCached
  std::stop_source stop;                                 // kBatch, kCached: cancel()
  bool handed_out = false;                               // kCached: next() returned the tensors
  std::optional<StateDict> cached_result;                // kCached, once waited for
};

}  // namespace pinload
