// pinload/copy_engine.h: many-stream, chunked host-to-device copies out of
// pool blocks, and the tickets that say when a block may be reused.
//
// CopyEngine::submit cuts a copy into chunk_bytes pieces (plan_copy: plain
// data), queues them round-robin over `streams` streams of one Device, records
// an event on each stream it used, and returns a CopyTicket. The ticket holds
// the host Block (and the DeviceBuffer) until every one of those events has
// completed; only then does it let go, so a pool block returns to its free
// list, and can be refilled by a new load, strictly after the copies that read
// it have finished (Note [Ordering] in device.h). A reaper thread waits on the
// events in submission order and lets go of each ticket's references as soon
// as they complete, whether or not anyone polls the ticket.
//
// Note [Copy streams]
// Two streams by default: H100/H200 have several copy engines, and two
// host-to-device streams already saturate PCIe 5 / NVLink-C2C in practice;
// more only add per-copy overhead. Chunks of 8 MiB keep each cudaMemcpyAsync
// far above its fixed cost (~10 us, i.e. <1% at 50 GB/s) while letting both
// streams start on a file early. docs/gpu.md has the measurements.
//
// Failure: a device error during a copy fails its ticket (wait() throws
// DeviceError) and is rethrown by wait_all(). A ticket's block is released once
// its events have completed or failed; if the device fails so badly that not
// even that is known, the block is never released (leaked), since a DMA engine
// might still read it.
//
// Thread safety: all methods may be called concurrently. The Device must
// outlive the engine; destroying the engine waits for every copy in flight.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "pinload/device.h"
#include "pinload/pool.h"

namespace pinload {

inline constexpr std::size_t kDefaultCopyStreams = 2;  // Note [Copy streams]
inline constexpr std::size_t kMaxCopyStreams = 64;
inline constexpr std::size_t kDefaultCopyChunkBytes = 8u << 20;

struct CopyOptions {
  std::size_t streams = kDefaultCopyStreams;
  std::size_t chunk_bytes = kDefaultCopyChunkBytes;
  // submit() waits while more than this many bytes are queued and not yet
  // completed (a "stall"); 0: no limit. A submit larger than the limit still
  // goes once nothing else is in flight.
  std::uint64_t max_in_flight_bytes = 0;
};

// One piece of a copy: host block[host_offset, +bytes) to
// device buffer[device_offset, +bytes), queued on stream `stream`.
struct CopyChunk {
  std::size_t host_offset = 0;
  std::size_t device_offset = 0;
  std::size_t bytes = 0;
  std::size_t stream = 0;
  bool operator==(const CopyChunk&) const = default;
};

// Cuts a copy of `bytes` into pieces of `chunk_bytes` (the last one shorter),
// in order, on streams first_stream, first_stream+1, ... modulo `streams`.
// Empty when bytes == 0. Throws InvalidArgumentError when chunk_bytes or streams
// is 0.
std::vector<CopyChunk> plan_copy(std::size_t host_offset, std::size_t device_offset, std::size_t bytes,
                                 std::size_t chunk_bytes, std::size_t streams, std::size_t first_stream = 0);

struct CopyStats {
  std::uint64_t tickets_submitted = 0;
  std::uint64_t tickets_completed = 0;  // events done (or failed), references released
  std::uint64_t tickets_failed = 0;
  std::uint64_t bytes_submitted = 0;
  std::uint64_t bytes_completed = 0;
  std::uint64_t chunks = 0;             // copies queued on the device
  std::uint64_t events = 0;             // events recorded
  std::uint64_t stalls = 0;             // submits that waited for max_in_flight_bytes
  std::uint64_t in_flight_bytes = 0;
  std::uint64_t peak_in_flight_bytes = 0;
};

namespace detail {
struct TicketState;
}

// The state of one submit. Copyable (shared). An empty ticket (bytes == 0, or
// default-constructed) is done.
class CopyTicket {
 public:
  CopyTicket() = default;
  // True once every chunk has been copied and the ticket has let go of the
  // host block: the host range may be reused. Never blocks.
  bool done() const noexcept;
  // Waits until done(); throws DeviceError if a copy failed.
  void wait() const;
  std::size_t bytes() const noexcept;
  std::size_t chunks() const noexcept;

 private:
  friend class CopyEngine;
  explicit CopyTicket(std::shared_ptr<detail::TicketState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::TicketState> state_;
};

class CopyEngine {
 public:
  // Creates options.streams streams on `device`. Throws InvalidArgumentError for
  // zero streams or chunk_bytes, DeviceError when a stream cannot be made.
  explicit CopyEngine(Device& device, CopyOptions options = {});
  // Waits for every copy in flight (never cancels a DMA), then joins.
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queues the copy of host_block[host_offset, +bytes) to
  // dst[dst_offset, +bytes) and returns at once (after a stall, see
  // max_in_flight_bytes). The ticket holds `host_block` and `dst` until the
  // copies complete. Throws InvalidArgumentError when a range leaves its block or
  // buffer (nothing queued), DeviceError when the device refuses a copy (the
  // chunks already queued still complete before the block is released).
  CopyTicket submit(std::shared_ptr<Block> host_block, std::size_t host_offset,
                    const std::shared_ptr<DeviceBuffer>& dst, std::size_t dst_offset, std::size_t bytes);
  // Waits until every ticket submitted so far is done. Throws DeviceError if
  // any copy failed since the engine was made.
  void wait_all();

  CopyStats stats() const;
  // The engine's stream `i` (< options().streams), for work that must follow
  // copies on it (a load's dtype conversions).
  Stream& stream(std::size_t i) { return streams_.at(i); }
  const CopyOptions& options() const noexcept { return options_; }
  Device& device() const noexcept { return device_; }

 private:
  void reap();
  void finish(const std::shared_ptr<detail::TicketState>& state, std::exception_ptr error);

  Device& device_;
  const CopyOptions options_;
  std::vector<Stream> streams_;

  mutable std::mutex mu_;
  std::condition_variable changed_;  // a ticket completed, or a new one came
  std::deque<std::shared_ptr<detail::TicketState>> pending_;  // submission order
  std::size_t next_stream_ = 0;
  CopyStats stats_;
  std::exception_ptr first_error_;
  bool stop_ = false;
  std::thread reaper_;
};

}  // namespace pinload
