// Internal: one checkpoint being read, shared by a prefetch and the load that
// adopts it (Note [Prefetch and adoption] in prefetch.h).
//
// A session holds the open files, the plan, the destination memory (one block
// per file, or in streaming mode one staging block per chunk) and which chunks
// are done. execute() is the one chunk executor: Loader::load and prefetch()
// both run it, so there is a single reader.
//
// Thread safety: execute() may run on one session from one caller at a time;
// its workers share the session through atomics. Everything else is called
// with no execute() running.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "io/cached_read_chooser.h"
#include "io/remote/object_cache.h"
#include "io/remote/remote_client.h"
#include "pinload/checkpoint.h"
#include "pinload/file_identity.h"
#include "pinload/io_template.h"
#include "pinload/loader.h"
#include "pinload/pool.h"
#include "pinload/read_plan.h"

namespace pinload {

namespace detail {
class ReadyQueue;  // loader.cc: tensors handed out as they arrive (Note [Ready tensors])
}

struct Loader::Counters {
  std::atomic<std::uint64_t> bytes_done{0};
  std::atomic<std::uint64_t> bytes_total{0};
  std::atomic<std::uint64_t> files_direct{0};
  std::atomic<std::uint64_t> files_buffered{0};
  std::atomic<std::uint64_t> files_mapped{0};
  std::atomic<std::uint64_t> bytes_copied{0};
  std::atomic<std::uint64_t> files_zero_copy{0};
  detail::ReadyQueue* ready = nullptr;  // set by load_async
  bool stream = false;                  // HandOut::kStream: keep nothing handed out

  LoadProgress snapshot() const noexcept {
    LoadProgress p;
    p.bytes_done = bytes_done.load(std::memory_order_relaxed);
    p.bytes_total = bytes_total.load(std::memory_order_relaxed);
    p.files_direct = files_direct.load(std::memory_order_relaxed);
    p.files_buffered = files_buffered.load(std::memory_order_relaxed);
    p.files_mapped = files_mapped.load(std::memory_order_relaxed);
    p.bytes_copied = bytes_copied.load(std::memory_order_relaxed);
    p.files_zero_copy = files_zero_copy.load(std::memory_order_relaxed);
    return p;
  }
};

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
//
// Note [Files in flight]
// A file is opened when a worker claims its first chunk and closed when its
// last chunk is read, so a load holds descriptors (two per file: buffered
// and O_DIRECT) only for the files being read, not for every shard of the
// checkpoint. At most ReadSession::max_open_files are open at once; a worker
// that needs one more waits for a file to finish. That bound is the largest
// number of files whose chunks interleave in the claim order (files_in_flight
// for the default plan), so the files already open always have their
// remaining chunks claimed by workers that are not waiting: no deadlock.
// Every open checks the file's identity against the stat of its header read
// (Note [One version per load] in checkpoint.h).
struct OpenFile {
  std::string path;
  FileStat stat;          // the stat of the header read until opened; then the open file's
  FileIdentity identity;  // of the header read: every descriptor must match it
  ScopedFd direct_fd;
  ScopedFd buffered_fd;
  FileMapping mapping;  // buffered files in the page cache, unless CachedRead::kPread
  std::atomic<bool> direct{false};
  std::atomic<bool> opened{false};  // open_for_load ran; counted in files_direct/buffered
  bool closed = false;              // every chunk read, descriptors closed (guarded by mu)
  std::atomic<std::uint32_t> chunks_left{0};  // chunks not read yet
  std::mutex mu;  // guards opening and closing the descriptors
  std::shared_ptr<Block> block;                 // host and kCached loads
  std::shared_ptr<DeviceBuffer> device_buffer;  // device loads: the data section
  // Remote files (Note [Remote reads]): no descriptors; chunks are ranged GETs.
  std::shared_ptr<remote::RemoteClient> remote;
  remote::ObjectInfo object;
  std::unique_ptr<remote::ObjectCache::Writer> cache_writer;  // Note [Remote cache]
  bool network_fs = false;  // NFS, SMB/CIFS or FUSE: Note [Network filesystems] in remote.h

  // The descriptor for buffered reads, opened (and its identity checked) on
  // first use.
  int buffered(Env* env);
};

struct ReadSession {
  Env* env = nullptr;
  LoadOptions options;  // of open_session: how files are opened and read
  DirectIo direct_mode = DirectIo::kAuto;
  CachedRead cached_read = CachedRead::kAuto;
  CachedReadChooser chooser;  // kAuto: map or pread, chunk by chunk
  Checkpoint checkpoint;
  std::vector<std::unique_ptr<OpenFile>> files;
  ReadPlan plan;
  bool streaming = false;  // each chunk into a staging block instead of its file's block
  // Readers: remote files take exactly one per connection (Note [Remote
  // reads]); files on network filesystems at least one per connection.
  unsigned remote_threads = 0;
  unsigned min_threads = 0;
  std::shared_ptr<Pool> staging_pool;
  // Streaming only: chunks read but not yet handed to a copy (prefetched).
  std::vector<std::shared_ptr<Block>> staged;
  std::unique_ptr<std::atomic<bool>[]> done;  // per chunk

  // Note [Files in flight]: files open now, and the bound.
  std::mutex open_mu;
  std::condition_variable_any open_cv;
  std::size_t open_files = 0;
  std::size_t max_open_files = 1;

  // Chunk indices in the order their reads completed (for IoTemplate).
  std::mutex completed_mu;
  std::vector<std::uint32_t> completed;

  bool chunk_done(std::size_t i) const { return done[i].load(std::memory_order_acquire); }
  // Bytes of the chunks done.
  std::uint64_t bytes_done() const;
  // The chunks not done, in plan order.
  std::vector<std::size_t> pending() const;
  // The reads that completed, in order, as a template destination.
  TemplateReads completed_reads(std::string destination);
};

// Plans the reads of every file of `checkpoint` (replaying `replay` when it
// tiles the files exactly, else make_read_plan). Files are opened later, as
// execute() reaches them (Note [Files in flight]), and counted as direct or
// buffered in *counters then. No memory is allocated. Throws pinload::Error.
std::unique_ptr<ReadSession> open_session(Env* env, const LoadOptions& options, Checkpoint checkpoint,
                                          std::shared_ptr<Pool> staging_pool, const TemplateReads* replay,
                                          Loader::Counters* counters);

// Gives every file without one its block from `pool` (not in streaming
// mode). A session whose blocks cannot fit the pool's budget together fails
// at once with OutOfMemoryError.
void allocate_blocks(ReadSession& s, Pool& pool, std::stop_token stop);

// Called after each chunk is read: (chunk index, the block holding it, the
// chunk's offset in that block). In streaming mode the block is the chunk's
// own staging block, which the callee takes.
using ChunkSink = std::function<void(std::size_t, std::shared_ptr<Block>, std::size_t)>;

// Reads the chunks `todo` (indices into s.plan.chunks, in claim order) with
// `threads` workers, the calling thread being one of them. Each chunk is
// marked done and recorded, then handed to `sink`. Workers run on `cpus`
// (Note [NUMA placement] in numa.h; empty: anywhere). Once `stop` is requested
// no new chunk starts; reads in flight finish. Returns after every worker
// has joined; throws the first error (a CancelledError when the stop ended a
// wait for staging memory).
void execute(ReadSession& s, const std::vector<std::size_t>& todo, unsigned threads, std::stop_token stop,
             Loader::Counters* counters, const std::vector<int>& cpus, const ChunkSink& sink);

// Whether `checkpoint` names the same files as the session, in the same order.
bool same_files(const Checkpoint& a, const Checkpoint& b);

}  // namespace detail
}  // namespace pinload
