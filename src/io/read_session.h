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
#include "pinload/checkpoint.h"
#include "pinload/io_template.h"
#include "pinload/loader.h"  // LoadOptions only: the session knows no Loader
#include "pinload/pool.h"
#include "pinload/read_plan.h"

namespace pinload {

namespace detail {

// A read-only mapping of a whole file (Note [Mapped reads] in loader.h).
// Owns the mapping; move-only.
class FileMapping {
 public:
  FileMapping() = default;
  FileMapping(Env* env, const std::byte* data, std::size_t bytes) : env_(env), data_(data), bytes_(bytes) {}
  FileMapping(FileMapping&& other) noexcept
      : env_(other.env_), data_(std::exchange(other.data_, nullptr)), bytes_(other.bytes_) {}
  FileMapping& operator=(FileMapping&& other) noexcept {
    if (this != &other) {
      reset();
      env_ = other.env_;
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = other.bytes_;
    }
    return *this;
  }
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;
  ~FileMapping() { reset(); }

  const std::byte* data() const { return data_; }
  bool valid() const { return data_ != nullptr; }
  void reset() {
    if (data_ != nullptr) env_->unmap(const_cast<std::byte*>(data_), bytes_);
    data_ = nullptr;
  }

 private:
  Env* env_ = nullptr;
  const std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// One file during a load: its descriptors, its mapping and its block.
struct OpenFile {
  std::string path;
  FileStat stat;
  ScopedFd direct_fd;
  ScopedFd buffered_fd;
  FileMapping mapping;  // buffered files in the page cache, unless CachedRead::kPread
  std::atomic<bool> direct{false};
  std::mutex mu;  // guards opening buffered_fd
  std::shared_ptr<Block> block;  // not in streaming mode

  // The descriptor for buffered reads, opened on first use.
  int buffered(Env* env);
};

// Called after each chunk is read: (chunk index, the block holding it, the
// chunk's offset in that block). In streaming mode the block is the chunk's
// own staging block, which the callee takes.
using ChunkSink = std::function<void(std::size_t, std::shared_ptr<Block>, std::size_t)>;

class ReadSession {
 public:
  // Opens every file of `checkpoint`, plans its reads (replaying `replay`
  // when it tiles the files exactly: replay_plan in read_plan.h; else
  // make_read_plan) and counts direct and buffered files in *counters. With
  // `staging_pool`, chunks are read into staging blocks of their own
  // (streaming). No memory is allocated. Throws pinload::Error.
  static std::unique_ptr<ReadSession> open(Env* env, const LoadOptions& options, Checkpoint checkpoint,
                                           std::shared_ptr<Pool> staging_pool, const TemplateReads* replay,
                                           ReadCounters* counters);

  ReadSession(const ReadSession&) = delete;
  ReadSession& operator=(const ReadSession&) = delete;

  // Gives every file without one its block from `pool` (not in streaming
  // mode). A session whose blocks cannot fit the pool's budget together fails
  // at once with OutOfMemoryError.
  void allocate_blocks(Pool& pool, std::stop_token stop);

  // Reads the chunks `todo` (indices into plan().chunks, in claim order) with
  // `threads` workers, the calling thread being one of them. Each chunk is
  // marked done and recorded, then handed to `sink`. Workers run on `cpus`
  // (Note [NUMA placement] in numa.h; empty: anywhere). Once `stop` is
  // requested no new chunk starts; reads in flight finish. Returns after every
  // worker has joined; throws the first error (a CancelledError when the stop
  // ended a wait for staging memory), or InvalidArgumentError when another
  // execute() is running on this session.
  void execute(const std::vector<std::size_t>& todo, unsigned threads, std::stop_token stop, ReadCounters* counters,
               const std::vector<int>& cpus, const ChunkSink& sink);

  // Streaming only: keeps chunk `i`'s staging block (read, not yet copied:
  // a prefetch's), and hands it over once.
  void keep_staged(std::size_t i, std::shared_ptr<Block> block);
  std::shared_ptr<Block> take_staged(std::size_t i);
  // Releases the blocks of files that no chunk was read into (a cancelled prefetch).
  void release_unread_blocks();
  // Counts the files read direct and buffered into *counters again (a load
  // adopting this session counts its own).
  void count_files(ReadCounters* counters) const;

  const Checkpoint& checkpoint() const noexcept { return checkpoint_; }
  const ReadPlan& plan() const noexcept { return plan_; }
  bool streaming() const noexcept { return staging_pool_ != nullptr; }
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

  Env* env_ = nullptr;
  DirectIo direct_mode_ = DirectIo::kAuto;
  CachedRead cached_read_ = CachedRead::kAuto;
  CachedReadChooser chooser_;  // kAuto: map or pread, chunk by chunk
  Checkpoint checkpoint_;
  std::vector<std::unique_ptr<OpenFile>> files_;
  ReadPlan plan_;
  std::shared_ptr<Pool> staging_pool_;  // set: streaming
  // Streaming only: chunks read but not yet handed to a copy (prefetched).
  std::vector<std::shared_ptr<Block>> staged_;
  std::unique_ptr<std::atomic<bool>[]> done_;  // per chunk
  std::atomic<bool> executing_{false};         // Thread safety above

  // Chunk indices in the order their reads completed (for IoTemplate).
  mutable std::mutex completed_mu_;
  std::vector<std::uint32_t> completed_;
};

// Whether `checkpoint` names the same files as the session, in the same order.
bool same_files(const Checkpoint& a, const Checkpoint& b);

}  // namespace detail
}  // namespace pinload
