// Internal: a cap on the pool memory one streaming load holds at once.
//
// Note [Streaming within a budget]
// A host load that hands its tensors out and keeps none (HandOut::kStream,
// pinload.iter_tensors) needs a file's block only from its first read until
// the consumer has dropped the file's tensors. With a StreamBudget in its
// read session, the reader does not reserve every block when the load
// starts: the worker that claims a file's first chunk reserves that file's
// block (files in order, so a later file never takes what an earlier one
// waits for), and waits while the blocks the load still holds (being read,
// queued, or kept alive only by the consumer's tensors) would pass the
// budget. Each block counts until its last owner lets go, whoever that is.
// The plan reads one file at a time (files_in_flight 1), so the files being
// read always have their blocks and their remaining chunks are claimed by
// readers that are not waiting.
//   - A file whose block alone exceeds the budget fails the load at once with
//     OutOfMemoryError naming the file (a block holds a whole file: the budget
//     must hold the largest shard, not only the largest tensor).
//   - A wait ends when blocks come back, with CancelledError when the load is
//     cancelled, or with OutOfMemoryError ("stalled") when it can never end:
//     no file is being read or still held by a reader (a file is in progress
//     until every reader of its chunks has let go of its block), no tensor is
//     queued, and the consumer is itself waiting for the next tensor while
//     holding what the budget needs. A block that comes back while the pool
//     refuses a reservation means a retry, not a stall. So a
//     consumer that keeps every tensor gets an error, not a hang. A consumer
//     that drops tensors from another thread while one thread waits is waited
//     for; that wait is cancellable.
//   - A Python `for name, t in iter_tensors(...)` loop holds `t` while it asks
//     for the next one; under a budget of one block, the last tensor of a
//     file then holds that file's block and the load stalls. `del t` in the
//     loop body, or a budget of two blocks, lets it stream.
// The budget is the pool's (PoolOptions::capacity_bytes: --pool-bytes,
// pool_bytes=), and under a memory limit (memory_limit.h) at most 7/8 of what
// the limit leaves when the load starts (plus the pool's idle memory): the
// rest is left to the process. Before it reserves past the budget, the pool's
// idle reservations go back to the OS (Pool::trim), so memory freed in one
// size class is not kept while another is reserved.
//
// Other entry points that stream many files (batches, LoRA adapters) get the
// same behaviour by reading through a session with a StreamBudget: set
// ReadSession::budget before execute(), and hand each file's tensors out with
// the block execute() passes to the sink (Loader::run does this for
// HandOut::kStream host loads).
//
// Thread safety: all methods may be called from any thread; blocks may be
// dropped from any thread, after the StreamBudget is gone too.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stop_token>
#include <string>

#include "pinload/pool.h"

namespace pinload::detail {

class StreamBudget {
 public:
  // `capacity_bytes` 0: no cap (blocks are still reserved only as files are
  // reached). `consumer_starved` (may be empty): true while the consumer waits
  // for tensors and none are queued. The pool must outlive every block.
  StreamBudget(std::shared_ptr<Pool> pool, std::uint64_t capacity_bytes, std::function<bool()> consumer_starved);

  std::uint64_t capacity() const noexcept;

  // Throws OutOfMemoryError naming `path` if a block of `bytes` cannot fit
  // the budget even alone.
  void check_fits(std::uint64_t bytes, const std::string& path) const;

  // A block of `bytes` for the file at `path`, counted against the budget
  // until its last owner drops it. Waits while it does not fit (Note
  // [Streaming within a budget]). Throws OutOfMemoryError (too large; the
  // pool or the OS refused with nothing of the load's left to wait for;
  // stalled), CancelledError once `stop` is requested.
  std::shared_ptr<Block> allocate(std::uint64_t bytes, const std::string& path, std::stop_token stop);

  // Files whose block is taken and whose readers have not all handed their
  // chunks to the sink and let go of the block: while any is, the load is
  // not stalled.
  void file_started() noexcept;
  void file_finished() noexcept;

  std::uint64_t held_bytes() const noexcept;
  std::uint64_t peak_held_bytes() const noexcept;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// The budget of a streaming load from `pool` (Note [Streaming within a
// budget]): the pool's capacity, and under a memory limit at most 7/8 of
// what it leaves plus the pool's idle memory. 0: neither is known. Reads the
// limit through default_env(). Never throws.
std::uint64_t streaming_budget_bytes(const Pool& pool);

}  // namespace pinload::detail
