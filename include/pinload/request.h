// pinload/request.h: one verb for every kind of load.
//
// Note [Requests]
// Session::start(request) starts any load a process makes; what differs
// between loads is the request's kind, not the entry point:
//   - kWhole: every tensor, through next() as files arrive and all of them
//     from wait() (Loader::load_async with HandOut::kWhole);
//   - kStream: tensors through next() only, each file's pool block going
//     back once its tensors are dropped (HandOut::kStream);
//   - kPrefetch: the reads start now, into the session's pool, and a later
//     kWhole or kStream request of the same device, paths and options adopts
//     them (prefetch.h): it reads only what is missing. wait() returns once
//     the reads are done (or adopted) and hands out nothing;
//   - kBatch: one state dict per path, a path's error failing only its own
//     item (load_batch in batch.h): wait_batch();
//   - kShard: this rank's parts of every tensor (shard.h), batch by batch
//     through next(), the rest merged by wait(); host only;
//   - kCached: through the session's model cache of the device (model_cache.h):
//     a hit reads nothing and a miss is loaded and kept, under cache_bytes.
// Every kind is cancelled by cancel() (or by dropping the handle, but for a
// prefetch, which the session keeps) and reports its bytes through
// progress() (a batch and a cached request report none). The older entry points
// (Loader::load_async, prefetch, load_batch, ShardLoad, ModelCache::get) stay
// as they are documented; a request is the way through a session.
//
// Thread safety: a handle is used from one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pinload/batch.h"
#include "pinload/loader.h"
#include "pinload/shard.h"
#include "pinload/state_dict.h"

namespace pinload {

enum class RequestKind : std::uint8_t { kWhole, kStream, kPrefetch, kBatch, kShard, kCached };

// "whole", "stream", "prefetch", "batch", "shard", "cached".
const char* request_kind_name(RequestKind kind) noexcept;

struct Request {
  RequestKind kind = RequestKind::kWhole;
  std::string device = "cpu";      // a device spec: "cpu", "sim:0", "cuda:1"
  std::vector<std::string> paths;  // as Loader::load takes them
  LoadOptions options;
  ShardSpec shard;                  // kShard: this rank's share
  std::uint64_t cache_bytes = 0;    // kCached: the device's cache budget (its first request sets it)
};

class RequestHandle {
 public:
  RequestHandle(RequestHandle&&) noexcept;
  RequestHandle& operator=(RequestHandle&&) noexcept;
  // Cancels what is still running and waits for it, except a prefetch,
  // which the session keeps reading for a later request to adopt.
  ~RequestHandle();

  RequestKind kind() const noexcept;
  // Tensors not returned before, once ready: a file's (kWhole, kStream), a
  // batch's (kShard), all of them at once (kCached); empty once every tensor
  // has been returned, and always for kPrefetch and kBatch. Throws what the
  // load threw.
  std::vector<Tensor> next();
  // The whole state dict (kWhole, kCached; kShard: what next() has not
  // returned); empty for kStream and kPrefetch (after the reads have ended).
  // Throws what the load threw, and InvalidArgumentError for kBatch.
  StateDict wait();
  // kBatch: one item per path, in order. Throws InvalidArgumentError for the
  // other kinds.
  std::vector<BatchItem> wait_batch();
  void cancel() noexcept;
  bool done() const noexcept;
  LoadProgress progress() const noexcept;

  struct State;
  explicit RequestHandle(std::unique_ptr<State> state);

 private:
  std::unique_ptr<State> state_;
};

}  // namespace pinload
