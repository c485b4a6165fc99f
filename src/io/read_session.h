// Internal: one checkpoint being read, shared by a prefetch and the load that
// adopts it (Note [Prefetch and adoption] in prefetch.h).
//
// A session holds the open files, the plan, the host memory reads land in
// (one block per file, or in streaming mode one staging block per chunk) and
// which chunks are done. execute() is the one chunk executor: Loader::load and
// prefetch() both run it, so there is a single reader. Where the bytes go next
// (device copies, tensors handed out) is the loader's business: the session
// knows neither the Loader nor devices.
//
// Thread safety: one execute() at a time on a session (a second one throws
// InvalidArgumentError); its workers share the session through atomics. The
// other members that change the session throw the same while execute() runs;
// the const ones may be called at any time.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "io/cached_read_chooser.h"
#include "io/read_counters.h"
#include "io/stream_budget.h"
#include "pinload/byte_source.h"
#include "pinload/checkpoint.h"
#include "pinload/file_identity.h"
#include "pinload/io_template.h"
#include "pinload/pool.h"
#include "pinload/read_options.h"
#include "pinload/read_plan.h"

namespace pinload {

namespace detail {

// One file during a load: its source and its block.
//
// Note [Files in flight]
// A file is opened when a worker claims its first chunk and closed when its
// last chunk is read, so a load holds descriptors (two per file: buffered
// and O_DIRECT; and a mapping) only for the files being read, not for every shard of the
// checkpoint. At most ReadSession::max_open_files are open at once; a worker
// that needs one more waits for a file to finish. That bound is the largest
// number of files whose chunks interleave in the claim order (files_in_flight
// for the default plan), so the files already open always have their
// remaining chunks claimed by workers that are not waiting: no deadlock. A
// larger bound keeps that true, so files of one chunk each, which interleave
// with none, still have files_in_flight open and read at once.
// Every open checks the file's identity against the stat of its header read
// (Note [One version per load] in checkpoint.h).
struct OpenFile {
  std::string path;  // as the checkpoint names it (a cached remote object's source reads another)
  // Where the bytes come from (Note [Byte sources] in byte_source.h), made
  // when the session opens; it holds descriptors only between
  // open_in_flight and close_in_flight.
  std::unique_ptr<ByteSource> source;
  bool remote = false;  // an object read over the network, not a local file
  std::atomic<bool> counted_direct{false};  // counted in files_direct, not files_buffered
  std::atomic<bool> opened{false};  // open_in_flight ran; counted in files_direct/buffered
  bool closed = false;              // every chunk read, source closed (guarded by mu)
  std::atomic<std::uint32_t> chunks_left{0};    // chunks not read yet
  std::atomic<std::uint32_t> chunks_in_hand{0};  // with a budget: chunks whose reader still holds the block
  std::mutex mu;  // guards opening and closing the source
  std::shared_ptr<Block> block;  // not in streaming mode
};

// Note [Load stages]
// Where a host load's time goes, for fp8-bench: each reader, converting
// thread and the load's thread add the nanoseconds of each stage they pass
// to process-wide counters (a few clock reads per chunk of MiB, always on).
// Sums over threads; loads running at once add into the same counters, so
// take a snapshot around one load at a time.
//   readers     gate (waiting for room in a conversion ring), staging (a
//               staging block from the pool), slot (a CPU slot), fault_in
//               (fresh destination pages), read (the read call: in flight),
//               sink (after the read: verification, hand-out, queueing
//               the chunk's conversion)
//   converters  queued (a chunk waiting for a converting thread), convert,
//               idle (a converting thread waiting for a chunk)
//   load thread plan (planning the conversions: reading the scales),
//               finish (waiting for the conversions after the readers
//               joined), edges (elements across chunk edges)
// and the span from the first read's start to the last read's end and to
// the last conversion's end (steady clock).
struct LoadStages {
  std::atomic<std::uint64_t> gate{0}, staging{0}, slot{0}, fault_in{0}, read{0}, sink{0};
  std::atomic<std::uint64_t> queued{0}, convert{0}, idle{0};
  std::atomic<std::uint64_t> plan{0}, finish{0}, edges{0};
  std::atomic<std::uint64_t> chunks{0}, converted{0};
  std::atomic<std::uint64_t> first_read_start{UINT64_MAX}, last_read_end{0}, last_convert_end{0};

  // Nanoseconds of the steady clock (the spans' unit).
  static std::uint64_t now() noexcept;
  void reset() noexcept;
  void add_read_span(std::uint64_t start, std::uint64_t end) noexcept;
  void add_convert_end(std::uint64_t end) noexcept;
};
LoadStages& load_stages() noexcept;

// Called after each chunk is read: (chunk index, the block holding it, the
// chunk's offset in that block). In streaming mode the block is the chunk's
// own staging block, which the callee takes.
using ChunkSink = std::function<void(std::size_t, std::shared_ptr<Block>, std::size_t)>;

// Called before each chunk's read, by a worker holding no memory and no CPU
// slot: may wait for room (a streamed load whose consumer is behind); returns
// when the stop is requested.
using ChunkGate = std::function<void(std::stop_token)>;

class ReadSession {
 public:
  // Plans the reads of every file of `checkpoint` (replaying `replay` when
  // it tiles the files exactly: replay_plan in read_plan.h; else
  // make_read_plan). Files are opened later, as execute() reaches them (Note
  // [Files in flight]), and counted as direct or buffered in *counters then.
  // With `staging_pool`, chunks are read into staging blocks of their own
  // (streaming). No memory is allocated. Throws pinload::Error.
  static std::unique_ptr<ReadSession> open(Env* env, const ReadOptions& options, Checkpoint checkpoint,
                                           std::shared_ptr<Pool> staging_pool, const TemplateReads* replay,
                                           ReadCounters* counters);

  ReadSession(const ReadSession&) = delete;
  ReadSession& operator=(const ReadSession&) = delete;

  // Gives every file without one its block from `pool` (not in streaming
  // mode). A session whose blocks cannot fit the pool's budget together fails
  // at once with OutOfMemoryError.
  // With a budget (set_budget) it only checks that each file's block fits
  // the budget alone: blocks are taken as execute() reaches their files.
  // `beside_bytes`: new host memory the load takes beside the file blocks
  // (converted output, a conversion ring, staging, a stand-in device's
  // buffers), counted with them against the memory limit (Note [Memory
  // limits]), in streaming mode too.
  void allocate_blocks(Pool& pool, std::stop_token stop, std::uint64_t beside_bytes = 0);

  // Note [Streaming within a budget] (stream_budget.h): set before execute(),
  // on a session whose files have no blocks yet, each file's block is taken
  // from `budget` when a worker reaches the file, in file order, instead of
  // by allocate_blocks.
  void set_budget(std::unique_ptr<StreamBudget> budget);
  bool budgeted() const noexcept { return budget_ != nullptr; }
  // With a budget: gives files [0, file] their blocks from it, in order,
  // waiting as StreamBudget::allocate does. Throws what it throws.
  void take_blocks_up_to(std::size_t file, std::stop_token stop);

  // Reads the chunks `todo` (indices into plan().chunks, in claim order) with
  // `threads` workers, the calling thread being one of them. Each chunk is
  // marked done and recorded, then handed to `sink`. Workers run on `cpus`
  // (Note [NUMA placement] in numa.h; empty: anywhere). Once `stop` is
  // requested no new chunk starts; reads in flight finish. Returns after every
  // worker has joined; throws the first error (a CancelledError when the stop
  // ended a wait for staging memory), or InvalidArgumentError when another
  // execute() is running on this session.
  // `gate`, when set, is passed before each chunk is read.
  void execute(const std::vector<std::size_t>& todo, unsigned threads, std::stop_token stop, ReadCounters* counters,
               const std::vector<int>& cpus, const ChunkSink& sink, const ChunkGate& gate = {});

  // Streaming only: keeps chunk `i`'s staging block (read, not yet copied:
  // a prefetch's), and hands it over once.
  void keep_staged(std::size_t i, std::shared_ptr<Block> block);
  std::shared_ptr<Block> take_staged(std::size_t i);
  // Releases the blocks of files that no chunk was read into (a cancelled prefetch).
  void release_unread_blocks();
  // Drops the session's hold on file `file`'s block once every chunk of it
  // has been read (HandOut::kStream: the tensors handed out alone hold it).
  // May be called from execute()'s sink.
  void release_block(std::size_t file);
  // Counts the files opened so far as direct and buffered into *counters
  // again, and the bytes total and done (a load adopting this session counts
  // its own; the files not open yet count as they open).
  void count_files(ReadCounters* counters) const;

  const Checkpoint& checkpoint() const noexcept { return checkpoint_; }
  const ReadPlan& plan() const noexcept { return plan_; }
  bool streaming() const noexcept { return staging_pool_ != nullptr; }
  // The readers execute(threads) starts for files read over a network: a
  // remote object's connections, or at least the connections a network
  // filesystem wants (Note [Remote reads]); 0 where every file is local.
  unsigned network_readers(unsigned threads) const noexcept;
  std::size_t file_count() const noexcept { return files_.size(); }
  // File `i`'s block (null in streaming mode, or before allocate_blocks).
  const std::shared_ptr<Block>& block(std::size_t i) const { return files_[i]->block; }
  bool chunk_done(std::size_t i) const { return done_[i].load(std::memory_order_acquire); }
  // Bytes of the chunks done.
  std::uint64_t bytes_done() const;
  // The chunks not done, in plan order.
  std::vector<std::size_t> pending() const;
  // The reads that completed, in order, as a template destination.
  TemplateReads completed_reads(std::string destination) const;

 private:
  ReadSession() = default;
  // Throws InvalidArgumentError naming `what` while execute() runs.
  void check_idle(const char* what) const;
  // Opens file `index` for its first chunk (Note [Files in flight]), waiting
  // while max_open_files_ are open. Throws CancelledError where `stop` ends
  // the wait, or the open's error.
  void open_in_flight(std::size_t index, std::stop_token stop, ReadCounters* counters);
  // The last chunk of file `index` has been read: closes its source, and lets a waiting worker open the next file.
  void close_in_flight(std::size_t index);

  Env* env_ = nullptr;
  ReadOptions options_;  // of open(): how files are opened and read
  DirectIo direct_mode_ = DirectIo::kAuto;
  CachedRead cached_read_ = CachedRead::kAuto;
  CachedReadChooser chooser_;  // kAuto: map or pread, chunk by chunk
  Checkpoint checkpoint_;
  std::vector<std::unique_ptr<OpenFile>> files_;
  ReadPlan plan_;
  std::shared_ptr<Pool> staging_pool_;  // set: streaming
  // Readers: remote files take exactly one per connection (Note [Remote
  // reads]); files on network filesystems at least one per connection.
  unsigned remote_threads_ = 0;
  unsigned min_threads_ = 0;
  // Streaming only: chunks read but not yet handed to a copy (prefetched).
  std::vector<std::shared_ptr<Block>> staged_;
  std::unique_ptr<std::atomic<bool>[]> done_;  // per chunk
  std::atomic<bool> executing_{false};         // Thread safety above

  // Note [Files in flight]: files open now, and the bound.
  std::mutex open_mu_;
  std::condition_variable_any open_cv_;
  std::size_t open_files_ = 0;
  std::size_t max_open_files_ = 1;

  // Note [Streaming within a budget]: set_budget's, and the blocks taken.
  std::unique_ptr<StreamBudget> budget_;
  std::mutex budget_mu_;                      // guards taking_block_; blocks_taken_ changes under it
  std::condition_variable_any budget_cv_;     // a block taken, or the taker gave up
  bool taking_block_ = false;                 // one worker takes blocks at a time, in file order
  std::atomic<std::size_t> blocks_taken_{0};  // files [0, blocks_taken_) have their block

  // Chunk indices in the order their reads completed (for IoTemplate).
  mutable std::mutex completed_mu_;
  std::vector<std::uint32_t> completed_;
};

// Whether `checkpoint` names the same files as the session, in the same order.
bool same_files(const Checkpoint& a, const Checkpoint& b);

// What the block of `cf` takes of `pool`'s budget at most: the file widened
// to its direct-I/O alignment, in its size class and whole reservation.
std::uint64_t file_block_charge(const Pool& pool, const CheckpointFile& cf);

}  // namespace detail
}  // namespace pinload
