#include "pinload/loader.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "log.h"
#include "pinload/error.h"
#include "pinload/read_plan.h"

namespace pinload {

namespace detail {

// Tensors of a load in flight that are ready to hand out (Note [Ready
// tensors] in loader.h), until the load ends.
class ReadyQueue {
 public:
  void push(std::vector<Tensor> tensors) {
    if (tensors.empty()) return;
    {
      std::lock_guard lock(mu_);
      if (closed_) return;
      for (Tensor& t : tensors) ready_.push_back(std::move(t));
    }
    cv_.notify_all();
  }
  // The load has ended: nothing more comes. A failed load drops what was not
  // taken, so that a partial result is never handed out after the failure.
  void close(bool failed) {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
      if (failed) ready_.clear();
    }
    cv_.notify_all();
  }
  // True once take() would not block.
  bool wait_for(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return closed_ || !ready_.empty(); });
  }
  // Waits for tensors or for the end; empty at the end.
  std::vector<Tensor> take() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return closed_ || !ready_.empty(); });
    return std::exchange(ready_, {});
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Tensor> ready_;
  bool closed_ = false;
};

}  // namespace detail

struct Loader::Counters {
  std::atomic<std::uint64_t> bytes_done{0};
  std::atomic<std::uint64_t> bytes_total{0};
  std::atomic<std::uint64_t> files_direct{0};
  std::atomic<std::uint64_t> files_buffered{0};
  std::atomic<std::uint64_t> bytes_copied{0};
  detail::ReadyQueue* ready = nullptr;  // set by load_async
};

namespace {

constexpr std::uint32_t kFallbackDirectAlign = 4096;
constexpr int kResidencySamples = 64;

// One file during a load: its descriptors and its block.
struct OpenFile {
  std::string path;
  FileStat stat;
  ScopedFd direct_fd;
  ScopedFd buffered_fd;
  std::atomic<bool> direct{false};
  std::mutex mu;  // guards opening buffered_fd
  std::shared_ptr<Block> block;                 // host and kCached loads
  std::shared_ptr<DeviceBuffer> device_buffer;  // device loads: the data section

  // The descriptor for buffered reads, opened on first use.
  int buffered(Env* env) {
    std::lock_guard lock(mu);
    if (!buffered_fd.valid()) buffered_fd = open_or_throw(env, path);
    return buffered_fd.get();
  }
};

// Keeps the first error of many workers.
class FirstError {
 public:
  void set(std::exception_ptr e) {
    std::lock_guard lock(mu_);
    if (!error_) error_ = std::move(e);
  }
  std::exception_ptr get() const {
    std::lock_guard lock(mu_);
    return error_;
  }

 private:
  mutable std::mutex mu_;
  std::exception_ptr error_;
};

// Which tensors of a host load have all their bytes in memory (Note [Ready
// tensors] in loader.h). Chunks of a file complete out of order; each file
// tracks the prefix of its sweep that has arrived, and a tensor is ready once
// that prefix covers its last byte.
class Arrivals {
 public:
  // Tensor indices count the checkpoint's tensors file by file, in header order.
  Arrivals(const ReadPlan& plan, const Checkpoint& checkpoint) : files_(plan.files.size()) {
    std::size_t index = 0;
    for (std::size_t i = 0; i < files_.size(); ++i) {
      File& f = files_[i];
      f.arrived.assign(plan.files[i].chunk_count, false);
      f.starts.resize(plan.files[i].chunk_count);
      const std::uint64_t data_offset = plan.files[i].data_offset;
      for (const TensorInfo& t : checkpoint.files[i].header.tensors) f.by_end.push_back({data_offset + t.end, index++});
      std::sort(f.by_end.begin(), f.by_end.end());
    }
    for (const ReadChunk& c : plan.chunks) files_[c.file].starts[c.index] = c.offset;
  }

  // Chunk `c` has arrived: appends the tensors that became ready to *ready.
  void arrived(const ReadChunk& c, std::vector<std::size_t>* ready) {
    File& f = files_[c.file];
    std::lock_guard lock(f.mu);
    f.arrived[c.index] = true;
    while (f.prefix < f.arrived.size() && f.arrived[f.prefix]) ++f.prefix;
    const std::uint64_t covered = f.prefix == f.arrived.size() ? UINT64_MAX : f.starts[f.prefix];
    while (f.next < f.by_end.size() && f.by_end[f.next].first <= covered) ready->push_back(f.by_end[f.next++].second);
  }

  // Every tensor not handed out yet (a file with no chunks; the end of a load).
  void rest(std::vector<std::size_t>* ready) {
    for (File& f : files_) {
      std::lock_guard lock(f.mu);
      while (f.next < f.by_end.size()) ready->push_back(f.by_end[f.next++].second);
    }
  }

 private:
  struct File {
    std::mutex mu;
    std::vector<std::uint64_t> starts;  // file offset of each chunk, by ReadChunk::index
    std::vector<bool> arrived;          // by ReadChunk::index
    std::size_t prefix = 0;     // chunks [0, prefix) have arrived
    std::vector<std::pair<std::uint64_t, std::size_t>> by_end;  // (end in file, tensor index)
    std::size_t next = 0;       // by_end[0, next) handed out
  };
  std::vector<File> files_;
};

// Opens a file for the load and decides direct or buffered (Note [Direct I/O]).
void open_for_load(Env* env, const CheckpointFile& cf, const LoadOptions& options, OpenFile* f) {
  f->path = cf.path;
  f->buffered_fd = open_or_throw(env, cf.path);
  f->stat = stat_or_throw(env, f->buffered_fd.get(), cf.path);
  if (f->stat.size != cf.stat.size) {
    throw IoError("file changed size from " + std::to_string(cf.stat.size) + " to " +
                  std::to_string(f->stat.size) + " bytes after its header was read",
                  ErrorContext{cf.path});
  }
  if (options.direct == DirectIo::kOff) return;
  if (options.direct == DirectIo::kAuto) {
    const double resident = env->resident_fraction(f->buffered_fd.get(), f->stat.size, kResidencySamples);
    if (resident >= options.resident_threshold) {
      log::debug("{}: {:.0f}% in page cache, reading buffered", cf.path, resident * 100);
      return;
    }
  }
  // Reads land at page-aligned places in pool blocks (Note [Direct I/O]).
  if (f->stat.dio_mem_align > kFallbackDirectAlign) {
    const std::string why = "O_DIRECT needs " + std::to_string(f->stat.dio_mem_align) +
                            "-byte aligned memory here; pool blocks are aligned to " +
                            std::to_string(kFallbackDirectAlign);
    if (options.direct == DirectIo::kOn) throw IoError(why, ErrorContext{cf.path});
    log::debug("{}: {}, reading buffered", cf.path, why);
    return;
  }
  const int fd = env->open_read(cf.path, O_DIRECT);
  if (fd >= 0) {
    f->direct_fd = ScopedFd(env, fd);
    f->direct = true;
  } else if (options.direct == DirectIo::kOn) {
    throw_os_error("O_DIRECT open refused", -fd, ErrorContext{cf.path});
  } else {
    log::debug("{}: O_DIRECT refused at open ({}), reading buffered", cf.path, -fd);
  }
}

// Note [NUMA placement] (numa.h). Under kNumaAuto, a sysfs it cannot read
// turns placement off rather than failing the load.
NumaPlacement choose_numa_placement(const LoadOptions& options) {
  const int requested = options.numa.node;
  if (requested == kNumaNone) return {};
  try {
    const NumaTopology topology = NumaTopology::read(options.numa.sysfs_root);
    const Device* device = options.target.device;
    const int device_node =
        requested == kNumaAuto && device != nullptr && topology.multi_node() ? device->numa_node(topology) : -1;
    NumaPlacement placement = place_numa(topology, requested, device_node);
    if (placement.active()) {
      log::debug("NUMA: pool memory and readers on node {} (CPUs {})", placement.node,
                 format_cpulist(placement.cpus));
    }
    return placement;
  } catch (const Error& e) {
    if (requested != kNumaAuto) throw;
    log::warn("NUMA placement off: {}", e.what());
    return {};
  }
}

[[noreturn]] void throw_read_error(const OpenFile& f, std::int64_t rc, std::uint64_t at, std::uint64_t end) {
  throw_os_error("read failed", static_cast<int>(-rc), ErrorContext{f.path, {}, at, end});
}

// Executes one chunk: reads [offset, offset + valid) of the file to `dest`.
void read_chunk(Env* env, OpenFile& f, const FileRead& plan, const ReadChunk& c, DirectIo mode,
                Loader::Counters* counters, std::byte* dest) {
  std::uint64_t done = 0;
  bool direct = f.direct.load(std::memory_order_relaxed);
  while (done < c.valid) {
    const std::uint64_t at = c.offset + done;
    const int fd = direct ? f.direct_fd.get() : f.buffered(env);
    // Direct reads ask for the whole aligned length; buffered for what is left.
    const std::uint64_t want = direct ? c.length - done : c.valid - done;
    const std::int64_t n = env->pread(fd, dest + done, want, at);
    if (n == -EINTR || n == -EAGAIN) continue;
    if (n == -EINVAL && direct && mode != DirectIo::kOn) {
      if (f.direct.exchange(false)) {
        log::debug("{}: O_DIRECT read refused, reading buffered", f.path);
        counters->files_direct--;
        counters->files_buffered++;
      }
      direct = false;
      continue;
    }
    if (n < 0) throw_read_error(f, n, at, c.offset + c.valid);
    if (n == 0) {
      throw IoError("file ended at byte " + std::to_string(at) + " but was " + std::to_string(plan.file_size) +
                    " bytes when its header was read (truncated while loading?)",
                    ErrorContext{f.path, {}, at, c.offset + c.valid});
    }
    done += static_cast<std::uint64_t>(n);
    // A short direct read leaves an unaligned position: finish buffered.
    if (direct && done < c.valid && done % plan.alignment != 0) direct = false;
  }
}

}  // namespace

Loader::Loader(LoadOptions options, std::shared_ptr<Pool> pool, Env* env)
    : options_(options),
      pool_(std::move(pool)),
      env_(env != nullptr ? env : default_env()),
      numa_(choose_numa_placement(options_)) {
  if (options_.threads == 0) options_.threads = 1;
  if (options_.block_size < 4096) options_.block_size = 4096;
  Device* device = options_.target.device;
  if (!pool_) {
    pool_ = device ? Pool::create(device->make_pinned_backend(PinnedMemoryOptions{.env = env_, .numa_node = numa_.node}))
                   : Pool::create(make_locked_memory_backend(env_, LockedMemoryOptions{.numa_node = numa_.node}));
  }
  if (device && options_.target.mode == DeviceMode::kStreaming) {
    // Small budgets use plain pages: a 2 MiB huge-page granule would not fit.
    PinnedMemoryOptions pinned{.env = env_, .numa_node = numa_.node};
    if (options_.target.staging_bytes < (64u << 20)) pinned.huge_pages = HugePages::kOff;
    std::unique_ptr<HostMemoryBackend> backend = device->make_pinned_backend(pinned);
    const std::uint64_t align = backend->alignment();
    const std::uint64_t one_block = (Pool::size_class(options_.block_size) + align - 1) / align * align;
    if (options_.target.staging_bytes < one_block) {
      throw InvalidFileError("staging budget of " + std::to_string(options_.target.staging_bytes) +
                             " bytes cannot hold one " + std::to_string(one_block) + "-byte read block");
    }
    PoolOptions staging;
    staging.capacity_bytes = options_.target.staging_bytes;
    staging.when_full = WhenFull::kWait;
    staging_pool_ = Pool::create(std::move(backend), staging);
  }
}

StateDict Loader::load(const std::vector<std::string>& paths) const {
  return load(open_checkpoint(env_, paths, options_.resolve));
}

StateDict Loader::load(const Checkpoint& checkpoint, std::stop_token stop) const {
  Counters counters;
  return run(checkpoint, std::move(stop), &counters);
}

StateDict Loader::run(const Checkpoint& checkpoint, std::stop_token stop, Counters* counters) const {
  const std::size_t n = checkpoint.files.size();
  std::vector<std::unique_ptr<OpenFile>> files;
  std::vector<FileRead> reads;
  files.reserve(n);
  reads.reserve(n);
  for (const CheckpointFile& cf : checkpoint.files) {
    auto f = std::make_unique<OpenFile>();
    open_for_load(env_, cf, options_, f.get());
    FileRead r;
    r.path = cf.path;
    r.file_size = cf.stat.size;
    r.data_offset = cf.header.data_offset();
    r.direct = f->direct;
    // Buffered reads use the same aligned ranges, so a file takes the same
    // block (size class) whether it was read direct or through the cache.
    r.alignment = std::max(f->stat.dio_offset_align, kFallbackDirectAlign);
    (f->direct ? counters->files_direct : counters->files_buffered)++;
    reads.push_back(std::move(r));
    files.push_back(std::move(f));
  }
  const ReadPlan plan = make_read_plan(std::move(reads), PlanOptions{options_.block_size, options_.files_in_flight});
  counters->bytes_total = plan.total_bytes;
  // A load holds its blocks until it ends, so one that cannot fit the budget
  // fails now instead of waiting for memory only it could free.
  const bool streaming = staging_pool_ != nullptr;
  Device* device = options_.target.device;
  if (const std::uint64_t capacity = pool_->options().capacity_bytes; capacity != 0 && !streaming) {
    std::uint64_t need = 0;
    for (const FileRead& r : plan.files) need += Pool::size_class(std::max<std::uint64_t>(r.block_bytes(), 1));
    if (need > capacity) {
      throw OutOfMemoryError("checkpoint needs " + std::to_string(need) + " bytes of pool memory; the pool budget is " +
                             std::to_string(capacity) + " bytes");
    }
  }
  if (!streaming) {
    for (std::size_t i = 0; i < n; ++i) files[i]->block = pool_->allocate(plan.files[i].block_bytes(), stop);
  }
  std::optional<CopyEngine> engine;
  if (device != nullptr) {
    engine.emplace(*device, options_.target.copy);
    for (std::size_t i = 0; i < n; ++i) {
      files[i]->device_buffer = device->allocate(std::max<std::uint64_t>(checkpoint.files[i].header.data_size(), 1));
    }
  }

  std::vector<Tensor> tensors;
  tensors.reserve(checkpoint.tensor_count());
  std::vector<std::pair<std::string, std::string>> metadata;
  for (std::size_t i = 0; i < n; ++i) {
    const CheckpointFile& cf = checkpoint.files[i];
    const std::uint64_t base = plan.files[i].data_in_block();
    for (const TensorInfo& t : cf.header.tensors) {
      if (streaming) {
        tensors.emplace_back(cf.name_prefix + t.name, t.dtype, t.shape, files[i]->device_buffer, t.begin, t.nbytes());
        continue;
      }
      Tensor& tensor =
          tensors.emplace_back(cf.name_prefix + t.name, t.dtype, t.shape, files[i]->block, base + t.begin, t.nbytes());
      if (device != nullptr) tensor.set_device(files[i]->device_buffer, t.begin);
    }
    for (const auto& kv : cf.header.metadata) {
      if (std::none_of(metadata.begin(), metadata.end(), [&](const auto& m) { return m.first == kv.first; })) {
        metadata.push_back(kv);
      }
    }
  }
  // Host loads hand tensors out as they arrive; device loads once copied.
  std::optional<Arrivals> arrivals;
  if (counters->ready != nullptr && device == nullptr) arrivals.emplace(plan, checkpoint);
  auto hand_out = [&](const std::vector<std::size_t>& ready) {
    std::vector<Tensor> out;
    out.reserve(ready.size());
    for (std::size_t i : ready) out.push_back(tensors[i]);
    counters->ready->push(std::move(out));
  };

  std::atomic<std::size_t> next{0};
  std::stop_source abort;  // the first error, or the caller's stop, ends every worker
  std::stop_callback forward_stop(stop, [&] { abort.request_stop(); });
  FirstError first_error;
  auto worker = [&] {
    try {
      const ThreadAffinityScope near_pool(env_, numa_.cpus);  // Note [NUMA placement]
      for (;;) {
        if (abort.stop_requested()) return;
        const std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= plan.chunks.size()) return;
        const ReadChunk& c = plan.chunks[i];
        const FileRead& r = plan.files[c.file];
        OpenFile& f = *files[c.file];
        // kStreaming reads into a staging block that its copy's ticket gives
        // back once the copy completes; the others into the file's block.
        std::shared_ptr<Block> staging = streaming ? staging_pool_->allocate(c.length, abort.get_token()) : nullptr;
        std::shared_ptr<Block> dest = streaming ? std::move(staging) : f.block;
        const std::size_t dest_offset = streaming ? 0 : c.offset - r.read_begin;
        read_chunk(env_, f, r, c, options_.direct, counters, dest->data() + dest_offset);
        counters->bytes_done.fetch_add(c.valid, std::memory_order_relaxed);
        if (arrivals) {
          std::vector<std::size_t> ready;
          arrivals->arrived(c, &ready);
          if (!ready.empty()) hand_out(ready);
        }
        if (engine) {
          // Only the data section goes to the device: clip the header bytes
          // that an aligned read brings along.
          const std::uint64_t begin = std::max(c.offset, r.data_offset);
          const std::uint64_t end = c.offset + c.valid;
          if (end > begin) {
            engine->submit(std::move(dest), dest_offset + (begin - c.offset), f.device_buffer, begin - r.data_offset,
                           end - begin);
          }
        }
      }
    } catch (...) {
      first_error.set(std::current_exception());
      abort.request_stop();
    }
  };
  const std::size_t thread_count = std::min<std::size_t>(options_.threads, std::max<std::size_t>(plan.chunks.size(), 1));
  {
    std::vector<std::jthread> threads;
    threads.reserve(thread_count);
    try {
      for (std::size_t t = 1; t < thread_count; ++t) threads.emplace_back(worker);
    } catch (const std::system_error& e) {
      abort.request_stop();  // joins the ones that started, then reports
      first_error.set(std::make_exception_ptr(IoError(std::string("cannot start reader thread: ") + e.what())));
    }
    worker();  // the calling thread works too
  }
  if (engine) {
    // Copies already queued finish before anything is released, error or not.
    try {
      engine->wait_all();
    } catch (...) {
      first_error.set(std::current_exception());
    }
    counters->bytes_copied = engine->stats().bytes_completed;
  }
  if (auto e = first_error.get()) std::rethrow_exception(e);
  if (stop.stop_requested()) throw CancelledError("load cancelled");
  if (counters->ready != nullptr) {
    if (!arrivals) arrivals.emplace(plan, checkpoint);
    std::vector<std::size_t> rest;
    arrivals->rest(&rest);
    hand_out(rest);
  }
  return StateDict(std::move(tensors), std::move(metadata));
}

// ---- asynchronous loads ----

struct LoadHandle::State {
  detail::ReadyQueue ready;
  Loader::Counters counters;
  std::stop_source stop;
  std::atomic<bool> finished{false};
  StateDict result;
  std::exception_ptr error;
  std::jthread thread;

  // Dropping a handle (destroyed or assigned over) cancels its load and waits.
  ~State() {
    stop.request_stop();
    if (thread.joinable()) thread.join();
  }
};

LoadHandle Loader::load_async(std::vector<std::string> paths) const {
  auto state = std::make_shared<LoadHandle::State>();
  state->counters.ready = &state->ready;
  // The thread holds copies of what it needs; `this` need not outlive it.
  state->thread = std::jthread([loader = *this, paths = std::move(paths), s = state.get()] {
    try {
      Checkpoint checkpoint = open_checkpoint(loader.env_, paths, loader.options_.resolve);
      if (s->stop.stop_requested()) throw CancelledError("load cancelled");
      s->result = loader.run(checkpoint, s->stop.get_token(), &s->counters);
    } catch (...) {
      s->error = std::current_exception();
    }
    s->ready.close(s->error != nullptr);
    s->finished = true;
  });
  return LoadHandle(std::move(state));
}

LoadHandle::LoadHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}

LoadHandle::~LoadHandle() = default;  // State's destructor cancels and joins

StateDict LoadHandle::wait() {
  if (!state_) throw CancelledError("wait() on an empty LoadHandle");
  if (state_->thread.joinable()) state_->thread.join();
  if (state_->error) std::rethrow_exception(state_->error);
  return std::move(state_->result);
}

std::vector<Tensor> LoadHandle::next_ready() {
  if (!state_) throw CancelledError("next_ready() on an empty LoadHandle");
  std::vector<Tensor> ready = state_->ready.take();
  if (ready.empty() && state_->error) {
    if (state_->thread.joinable()) state_->thread.join();
    std::rethrow_exception(state_->error);
  }
  return ready;
}

bool LoadHandle::wait_ready(std::chrono::milliseconds timeout) {
  return !state_ || state_->ready.wait_for(timeout);
}

void LoadHandle::cancel() noexcept {
  if (state_) state_->stop.request_stop();
}

bool LoadHandle::done() const noexcept { return state_ && state_->finished.load(); }

LoadProgress LoadHandle::progress() const noexcept {
  LoadProgress p;
  if (!state_) return p;
  p.bytes_done = state_->counters.bytes_done.load(std::memory_order_relaxed);
  p.bytes_total = state_->counters.bytes_total.load(std::memory_order_relaxed);
  p.files_direct = state_->counters.files_direct.load(std::memory_order_relaxed);
  p.files_buffered = state_->counters.files_buffered.load(std::memory_order_relaxed);
  p.bytes_copied = state_->counters.bytes_copied.load(std::memory_order_relaxed);
  return p;
}

StateDict upload(const StateDict& host, Device& device, const CopyOptions& options) {
  // One device allocation per host block, spanning the tensors that use it.
  struct Span {
    std::size_t begin = SIZE_MAX, end = 0;
    std::shared_ptr<DeviceBuffer> buffer;
  };
  std::unordered_map<const Block*, Span> spans;
  for (const Tensor& t : host) {
    if (!t.on_host()) throw InvalidFileError("upload() needs host tensors", ErrorContext{{}, t.name()});
    Span& span = spans[t.block().get()];
    span.begin = std::min(span.begin, t.block_offset());
    span.end = std::max<std::size_t>(span.end, t.block_offset() + t.nbytes());
  }
  CopyEngine engine(device, options);
  std::vector<Tensor> tensors;
  tensors.reserve(host.size());
  for (const Tensor& t : host) {
    Span& span = spans[t.block().get()];
    if (!span.buffer) {
      span.buffer = device.allocate(std::max<std::size_t>(span.end - span.begin, 1));
      if (span.end > span.begin) engine.submit(t.block(), span.begin, span.buffer, 0, span.end - span.begin);
    }
    Tensor& copy = tensors.emplace_back(t);
    copy.set_device(span.buffer, t.block_offset() - span.begin);
  }
  engine.wait_all();
  return StateDict(std::move(tensors), host.metadata());
}

}  // namespace pinload
