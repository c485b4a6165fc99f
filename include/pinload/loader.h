// pinload/loader.h: load checkpoints into pool memory with parallel reads.
//
// Loader::load resolves paths (checkpoint.h), plans the reads (read_plan.h),
// and has `threads` workers execute the plan: each file's data section is
// read in one sequential sweep of `block_size` preads, straight into one pool
// block per file. The result is a StateDict of views into those blocks.
//
// Note [Direct I/O]
// kAuto reads a file with O_DIRECT unless most of it is already in the page
// cache (sampled with mincore), where a buffered read is a memcpy and direct
// I/O would go to the disk again. Direct reads are aligned supersets of the
// data section (alignment from statx STATX_DIOALIGN, else 4096): the block
// holds a few header bytes before the first tensor. Reads land at offsets of
// the file's alignment in page-aligned blocks, so a file whose memory
// alignment (STATX_DIOALIGN) is above 4096 is read buffered. Where O_DIRECT is refused
// at open() or at the first read (EINVAL: tmpfs, some FUSE mounts), the file
// falls back to buffered reads. kOn makes a refusal an error.
//
// Note [Mapped reads]
// A file read buffered whose pages are in the page cache need not be pread:
// it is mapped (Env::map_file), and a chunk can be populated
// (MADV_POPULATE_READ) and copied into its block with non-temporal stores.
// Where the page cache holds large folios that copy runs at memcpy's rate,
// about 1.4x pread's copy_to_user; where it holds 4 KiB pages, populating and
// tearing down a page-table entry per page makes it about 0.6-0.7x pread
// (docs/tuning.md). Which a machine has depends on how the file was read in,
// so CachedRead::kAuto (the default) times both on the load's first chunks and
// then takes the faster (cached_read_chooser.h); kMap and kPread force one.
// The mapping never turns a file that shrank under the load into a crash:
// populating a range the file lost fails with EFAULT, and a SIGBUS during the
// copy (the file cut between populate and copy) ends that copy
// (mapped_copy.h). Either way, and on any other failure to map or populate,
// the chunk is read again with pread, which reports the short file as the
// unmapped path does.
//
// Note [Zero-copy loads]
// A new process has no pool memory yet, and fresh anonymous memory can be
// slow to arrive (first touch at 0.3-1.1 GB/s on a VM whose host has taken
// back the guest's free pages: docs/tuning.md), while a file in the page
// cache can be handed out with no byte moved. So a host load (no device, no
// conversion, local files) may hand a file's tensors out as views of a
// private, copy-on-write mapping of the file (opened, mapped and populated
// through the load's Env, so injected faults reach it), guarded by a read
// lease that moves the bytes out before any writer or truncation gets to the
// file (Note [Leased mappings] in src/io/leased_mapping.h): never a SIGBUS.
//   ZeroCopy::kAuto  maps a file when the pool lacks idle memory to read it
//                    into (the pool-kept, model-switching case keeps reading
//                    into memory it has touched), a lease is granted and at
//                    least resident_threshold of it is in the page cache.
//   ZeroCopy::kOn    maps every file a lease is granted for, whatever is
//                    cached.
//   ZeroCopy::kOff   never maps.
// Either way a mapped file's pages are faulted into the process with
// `threads` threads (MADV_POPULATE_READ) before the load returns: its bytes
// are resident, as a read's are, and a page that cannot be read is an
// IoError then, not a fault in the caller's first pass.
// A mapped file is counted in LoadProgress::files_zero_copy; its tensors'
// Block is the mapping (not pool memory, not locked) and lives while any of
// them does. Files that are not mapped are read as usual, in the same load.
//
// Note [Keeping the page cache]
// Direct reads leave nothing in the page cache, so a worker restarted on the
// same machine reads the disk again, while safetensors' mmap restart finds
// its files cached (issue 37). So each load decides how it reads its cold
// files (PageCache, PINLOAD_PAGE_CACHE where the option is kAuto):
//   kKeep    they go through the page cache: a host load that may map
//            (Note [Zero-copy loads]) maps them and populates the mappings
//            in parallel, so the page cache holds the only copy; other
//            loads read them buffered (DirectIo::kAuto becomes kOff).
//   kBypass  O_DIRECT (Note [Direct I/O]); only cached files are mapped.
//   kAuto    kKeep where the page cache would hold the only host copy (a
//            mapped host load, a streaming device load) and the load's
//            bytes are at most kKeepFraction of what memory leaves
//            (memory_limit.h: MemAvailable, cgroup limits); else kBypass.
//            Loads that keep their own copy (a kept pool, a cached device
//            load, a conversion) would take the memory twice: kBypass.
// The threshold and what it costs are measured in docs/tuning.md.
//
// Note [Block size]
// 8 MiB per chunk: a pread of it costs one syscall per 8 MiB (the seed article
// measured 16x fewer calls than 128 KiB buffered reads at 2 MiB already), 8
// threads keep 64 MiB in flight on one file, and a file copied from its
// mapping drops each chunk's page-table entries (MADV_DONTNEED) once per 8 MiB:
// each drop is a TLB shootdown across the load's threads, which at 2 MiB cost
// 10-25% of a copy from large folios. Measured against 2 MiB, cold and warm,
// in docs/tuning.md.
//
// Note [Direct reads in flight]
// `threads` bounds a load's work on the CPU: copies out of the page cache and
// what follows each read (conversions, handing tensors out). A direct read
// only waits on the device, and this VM's disk and its fresh memory (pinned
// by the read) both deliver more with more requests outstanding, so direct
// reads keep up to kDirectReadsInFlight in flight on extra workers. In a fresh
// process, the 7.8 GB set cold at 32 in flight read 1.14-1.61 GB/s against
// 1.03-1.13 at 8; warm pool-kept copies at 32 threads were 5% slower than at
// 8, hence the split (docs/tuning.md).
//
// Note [Device loads]
// With LoadOptions::target.device set, every chunk is copied to the device as
// soon as its read completes (CopyEngine, copy_engine.h), so reads and copies
// overlap end to end; each file gets one device allocation (its data section)
// and tensors are offsets into it.
//   kCached     chunks land in the file's pool block, which stays: tensors
//               are on the host and on the device, and upload() can bring the
//               model back to the device with only the host-to-device copy.
// A local file in the page cache is not read at all (unless ZeroCopy::kOff):
// it is copied to the device from a leased mapping registered with the
// device, which is then the tensors' host copy (Note [Copies from mapped
// memory] in src/load/device_mapped.h).
//   kStreaming  chunks land in staging blocks from a pool capped at
//               staging_bytes; a block goes back to it once its copy's events
//               complete (burn after reading). Peak host memory stays at or
//               below staging_bytes, so a model larger than host memory loads.
//               Tensors are on the device only.
//
// Note [Ready tensors]
// A load started with load_async hands tensors out as they arrive, through
// LoadHandle::next_ready: a host tensor as soon as the chunks that hold its
// bytes have been read (chunks complete out of order, so a file's tensors
// become ready as the arrived prefix of its sweep grows), a device tensor when
// the load's copies have completed. wait() still returns the whole state dict.
//
// Failure: a load either returns every tensor or throws; on throw, every block,
// file descriptor and thread it took has been released. A load whose blocks
// cannot fit the pool's budget together fails at once with OutOfMemoryError,
// even under WhenFull::kWait (it would be waiting for itself).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "pinload/checkpoint.h"
#include "pinload/convert.h"
#include "pinload/copy_engine.h"
#include "pinload/device.h"
#include "pinload/env.h"
#include "pinload/manifest.h"
#include "pinload/numa.h"
#include "pinload/pool.h"
#include "pinload/read_options.h"
#include "pinload/state_dict.h"
#include "pinload/store.h"

namespace pinload {

// DirectIo, CachedRead and the defaults and bounds of threads, block_size,
// files_in_flight and resident_threshold are in read_options.h.

// Whether a host load may hand files out as views of leased file mappings:
// Note [Zero-copy loads].
enum class ZeroCopy { kAuto, kOn, kOff };

// How a load reads its cold files: Note [Keeping the page cache].
enum class PageCache { kAuto, kKeep, kBypass };
// PageCache::kAuto keeps a load's files in the page cache when they take at
// most this fraction of the memory left (docs/tuning.md).
inline constexpr double kKeepFraction = 0.5;
// Overrides PageCache::kAuto: "keep", "bypass" (or "auto").
inline constexpr const char* kPageCacheVariable = "PINLOAD_PAGE_CACHE";

// The spellings of DirectIo ("auto", "on", "off") and CachedRead ("auto",
// "map", "pread") that the CLI and Python take; nullopt for anything else.
std::optional<DirectIo> parse_direct_io(std::string_view text) noexcept;
const char* direct_io_name(DirectIo direct) noexcept;
std::optional<CachedRead> parse_cached_read(std::string_view text) noexcept;
const char* cached_read_name(CachedRead cached_read) noexcept;
std::optional<ZeroCopy> parse_zero_copy(std::string_view text) noexcept;  // "auto", "on", "off"
const char* zero_copy_name(ZeroCopy zero_copy) noexcept;
std::optional<PageCache> parse_page_cache(std::string_view text) noexcept;  // "auto", "keep", "bypass"
const char* page_cache_name(PageCache page_cache) noexcept;

enum class DeviceMode { kCached, kStreaming };

inline constexpr std::uint64_t kDefaultStagingBytes = 256u << 20;

// Where a load puts its tensors besides (or instead of) host memory.
struct DeviceTarget {
  Device* device = nullptr;  // null: host only. Must outlive the Loader.
  DeviceMode mode = DeviceMode::kCached;
  CopyOptions copy;
  std::uint64_t staging_bytes = kDefaultStagingBytes;  // kStreaming's host budget
};

// Where a load's pool and reader threads go on a NUMA machine: Note [NUMA
// placement] in numa.h. A pool handed to the Loader is used as it is; only
// the Loader's own pools (and its readers) are placed.
struct NumaOptions {
  int node = kNumaAuto;             // kNumaAuto, kNumaNone, or a node id
  std::string sysfs_root = "/sys";  // where the topology is read (tests: a fake tree)
};

// The options of a Loader. validate() is the one check of them: the Loader,
// the CLI and the Python bindings (pinload.LoadOptions) all call it, and
// nothing clamps a value that fails it.
struct LoadOptions {
  unsigned threads = kDefaultThreads;              // 1..kMaxThreads
  std::size_t block_size = kDefaultBlockSize;      // kMinBlockSize..kMaxBlockSize
  DirectIo direct = DirectIo::kAuto;
  std::size_t files_in_flight = kDefaultFilesInFlight;  // shards read at once, >= 1
  // A file at least this resident in the page cache is read buffered under
  // DirectIo::kAuto, and a buffered one is mapped unless CachedRead::kPread.
  // Above 1: never counted as cached.
  double resident_threshold = kDefaultResidentThreshold;
  CachedRead cached_read = CachedRead::kAuto;
  ZeroCopy zero_copy = ZeroCopy::kAuto;  // Note [Zero-copy loads]
  // Note [Keeping the page cache]; kBypass with ZeroCopy::kOn is refused.
  PageCache page_cache = PageCache::kAuto;
  // Where kAuto reads the memory limit (read_host_memory_limit's root): ""
  // is the real /proc and /sys (tests: a fake tree).
  std::string memory_root;
  ResolveOptions resolve;
  DeviceTarget target;  // Note [Device loads]; copy.streams 1..kMaxCopyStreams
  NumaOptions numa;
  // Hand floating tensors out in another dtype, converting inside the load
  // (Note [Conversion on load] in convert.h). With a device target the
  // converted tensors are on the device only; tensors are handed out
  // (next_ready) once the whole load has completed.
  DTypeOptions dtype;
  // The budget of the pool the Loader creates when it is given none
  // (PoolOptions::capacity_bytes; 0: no budget). Note [Memory limits] in
  // memory_limit.h: a load that cannot fit it, or the process's memory
  // limit, fails with OutOfMemoryError before reading.
  std::uint64_t pool_bytes = 0;
  // Check the stored bytes against a manifest's digests, or whole files
  // against published sha256 digests, as the readers land them (Note
  // [Verified loads] in manifest.h): a mismatch is an IntegrityError and the
  // load returns nothing.
  VerifyOptions verify;
  // Ask the node store first (Note [Store clients] in store.h); PINLOAD_STORE
  // sets it where `store.socket` is empty.
  StoreOptions store;
  // Wraps the source of each file the load reads (Note [Byte sources] in
  // byte_source.h): fault injection, tracing. Empty: none.
  WrapSource wrap_source;

  // Throws InvalidArgumentError naming the first option out of range (its
  // Python name: "threads", "block_size", "streams", ...) and its value.
  // Checks values only: the Loader also refuses kStreaming without a device.
  void validate() const;
  // What the readers need of these options (the io layer's own options):
  // block_size, direct, files_in_flight, resident_threshold, cached_read,
  // resolve.remote and wrap_source.
  ReadOptions read_options() const {
    return ReadOptions{block_size, direct, files_in_flight, resident_threshold, cached_read, resolve.remote, wrap_source};
  }
};

// Counters of one load, readable while it runs.
struct LoadProgress {
  std::uint64_t bytes_done = 0;
  std::uint64_t bytes_total = 0;
  std::uint64_t files_direct = 0;    // files read with O_DIRECT
  std::uint64_t files_buffered = 0;  // files read through the page cache
  std::uint64_t files_mapped = 0;    // of those, copied from a mapping (Note [Mapped reads])
  std::uint64_t bytes_copied = 0;    // to the device, completed
  std::uint64_t files_zero_copy = 0; // handed out as file mappings (Note [Zero-copy loads])
  std::uint64_t files_store = 0;     // mapped from the node store (Note [Store clients] in store.h)
};

// How a load_async handle gives its tensors out (Note [Ready tensors]).
enum class HandOut {
  // Through next_ready() as they arrive, and all of them again from wait().
  kWhole,
  // Only through next_ready(): the load keeps no tensor it has handed out,
  // and drops a host file's block as soon as that file is read, so the
  // block goes back to the pool once the caller has dropped the file's
  // tensors (streaming consumers: pinload.iter_tensors). wait() returns an
  // empty state dict.
  kStream,
};

class LoadHandle;
class Prefetch;
struct IoTemplate;

// The optional parts of one load.
struct LoadRequest {
  std::stop_token stop;          // once requested, the load throws CancelledError
  Prefetch* adopt = nullptr;     // take over what it read (prefetch.h); may be empty
  // Receives the files of the load and, for its destination ("host" or the
  // device's name), the reads done, in the order they completed (including
  // those of an adopted prefetch). Other destinations already in *record are
  // kept when its files are the same. See io_template.h.
  IoTemplate* record = nullptr;
};

class Loader {
 public:
  // `pool` null: a pool of its own, on the target device's pinned memory or
  // else locked host memory. `env` null: the POSIX env. *env must outlive the
  // Loader and every load it starts. Throws InvalidArgumentError for options
  // that fail LoadOptions::validate(), kStreaming without a target device, a
  // LoadOptions::numa.node the machine lacks, or a staging budget below one
  // read block. `staging`: kStreaming's staging pool, which loaders may share
  // so that one pinned allocation serves load after load (make_staging_pool);
  // null: a staging pool of the loader's own.
  explicit Loader(LoadOptions options = {}, std::shared_ptr<Pool> pool = nullptr, Env* env = nullptr,
                  std::shared_ptr<Pool> staging = nullptr);

  // Loads every tensor of `paths` (files, indexes, folders). Blocks; throws
  // pinload::Error. The tensors keep their blocks alive on their own.
  StateDict load(const std::vector<std::string>& paths) const;
  // Loads an already resolved checkpoint; stops with CancelledError once
  // `stop` is requested.
  StateDict load(const Checkpoint& checkpoint, std::stop_token stop = {}) const;
  // The same with a request: adopting a prefetch of the same files and
  // recording an I/O template (Note [Prefetch and adoption] in prefetch.h).
  StateDict load(const std::vector<std::string>& paths, const LoadRequest& request) const;
  StateDict load(const Checkpoint& checkpoint, const LoadRequest& request) const;
  // Loads what `prefetch` was started for, adopting what it read; its
  // headers are not read again. An empty prefetch throws InvalidArgumentError.
  StateDict load(Prefetch& prefetch, LoadRequest request = {}) const;
  // Starts a load on a thread of its own and returns at once.
  LoadHandle load_async(std::vector<std::string> paths, HandOut hand_out = HandOut::kWhole) const;
  // load(prefetch) on a thread of its own, which owns the prefetch.
  LoadHandle load_async(Prefetch prefetch, HandOut hand_out = HandOut::kWhole) const;

  const std::shared_ptr<Pool>& pool() const noexcept { return pool_; }
  // kStreaming's staging pool (null for other loads).
  const std::shared_ptr<Pool>& staging_pool() const noexcept { return staging_pool_; }
  const LoadOptions& options() const noexcept { return options_; }
  Env* env() const noexcept { return env_; }
  // The NUMA node and CPUs this loader uses; inactive on one-node machines.
  const NumaPlacement& numa_placement() const noexcept { return numa_; }
  // The name of this loader's reads in an I/O template: "host", or the
  // target device's name.
  std::string destination() const;

  struct Counters;  // internal: a load's live progress counters

 private:
  StateDict run(const Checkpoint& checkpoint, const LoadRequest& request, Counters* counters,
                bool may_map = true) const;
  StateDict adopt(Prefetch& prefetch, LoadRequest request, Counters* counters) const;

  LoadOptions options_;
  std::shared_ptr<Pool> pool_;
  std::shared_ptr<Pool> staging_pool_;
  Env* env_;
  NumaPlacement numa_;
};

// The staging pool of kStreaming loads with `options`: pinned memory of
// options.target.device (on the loader's NUMA node), capped at
// target.staging_bytes, waiting when full. Loaders given the same one reuse
// its pinned blocks, so only the first load pins memory. Throws
// InvalidArgumentError without a target device, or for a budget below one
// read block.
std::shared_ptr<Pool> make_staging_pool(const LoadOptions& options, Env* env = nullptr);

// Copies the host tensors of `host` to `device`: one device allocation per
// host block, tensors at the same offsets, so a model cached in the pool goes
// back to the device with only the host-to-device copy. The result's tensors
// are on the device and still on the host. Throws DeviceError,
// OutOfMemoryError, InvalidArgumentError (a tensor that is not on the host).
StateDict upload(const StateDict& host, Device& device, const CopyOptions& options = {});

// A load in flight. Destroying it, or assigning another handle over it,
// cancels the load and waits for it.
class LoadHandle {
 public:
  LoadHandle(LoadHandle&&) noexcept = default;
  LoadHandle& operator=(LoadHandle&&) noexcept = default;
  ~LoadHandle();

  // Waits and returns the state dict, or throws what the load threw
  // (CancelledError after cancel()). Call once.
  StateDict wait();
  // Waits until tensors not returned before are ready (Note [Ready tensors])
  // and returns them; empty once every tensor has been returned. Throws what
  // the load threw (a failed load hands out nothing more). Call from one
  // thread at a time.
  std::vector<Tensor> next_ready();
  // True once next_ready() would return without waiting; false after
  // `timeout`.
  bool wait_ready(std::chrono::milliseconds timeout);
  // True once the load has finished (wait() would not block); false after
  // `timeout`. Wakes as the load ends, not at a polling interval.
  bool wait_done(std::chrono::microseconds timeout);
  // Asks the load to stop; wait() then throws CancelledError.
  void cancel() noexcept;
  bool done() const noexcept;
  LoadProgress progress() const noexcept;

  struct State;

 private:
  friend class Loader;
  explicit LoadHandle(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace pinload
