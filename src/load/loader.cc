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

#include "base/log.h"
#include "pinload/error.h"
#include "pinload/io_template.h"
#include "pinload/prefetch.h"
#include "pinload/read_plan.h"
#include "io/read_session.h"
#include "load/convert_on_load.h"

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

namespace {

using detail::ReadSession;

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
  // True when it was the last chunk of its file to arrive.
  bool arrived(const ReadChunk& c, std::vector<std::size_t>* ready) {
    File& f = files_[c.file];
    std::lock_guard lock(f.mu);
    f.arrived[c.index] = true;
    while (f.prefix < f.arrived.size() && f.arrived[f.prefix]) ++f.prefix;
    const std::uint64_t covered = f.prefix == f.arrived.size() ? UINT64_MAX : f.starts[f.prefix];
    while (f.next < f.by_end.size() && f.by_end[f.next].first <= covered) ready->push_back(f.by_end[f.next++].second);
    return f.prefix == f.arrived.size();
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
    LockedMemoryOptions host = kHostPoolMemory;  // Note [Locking host pools]
    host.numa_node = numa_.node;
    PoolOptions budget;
    budget.capacity_bytes = options_.pool_bytes;
    pool_ = device ? Pool::create(device->make_pinned_backend(PinnedMemoryOptions{.env = env_, .numa_node = numa_.node}),
                                  budget)
                   : Pool::create(make_locked_memory_backend(env_, host), budget);
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
  return run(checkpoint, LoadRequest{std::move(stop)}, &counters);
}

StateDict Loader::load(const std::vector<std::string>& paths, const LoadRequest& request) const {
  Counters counters;
  // A prefetch of the same paths has read the headers already.
  if (request.adopt != nullptr && request.adopt->paths() == paths && request.adopt->resolves_like(options_.resolve)) {
    if (std::optional<Checkpoint> checkpoint = request.adopt->checkpoint()) return run(*checkpoint, request, &counters);
  }
  return run(open_checkpoint(env_, paths, options_.resolve), request, &counters);
}

StateDict Loader::load(const Checkpoint& checkpoint, const LoadRequest& request) const {
  Counters counters;
  return run(checkpoint, request, &counters);
}

StateDict Loader::load(Prefetch& prefetch, LoadRequest request) const {
  Counters counters;
  return adopt(prefetch, std::move(request), &counters);
}

StateDict Loader::adopt(Prefetch& prefetch, LoadRequest request, Counters* counters) const {
  request.adopt = &prefetch;
  std::optional<Checkpoint> checkpoint = prefetch.checkpoint();
  if (!checkpoint) {
    if (!prefetch.state_ || prefetch.paths().empty()) {
      throw InvalidFileError("load(Prefetch&) of an empty prefetch, or one whose headers could not be read");
    }
    checkpoint = open_checkpoint(env_, prefetch.paths(), options_.resolve);
  }
  return run(*checkpoint, request, counters);
}

std::string Loader::destination() const {
  return options_.target.device != nullptr ? options_.target.device->name() : std::string(kHostDestination);
}

StateDict Loader::run(const Checkpoint& checkpoint, const LoadRequest& request, Counters* counters) const {
  const std::stop_token& stop = request.stop;
  const bool streaming = staging_pool_ != nullptr;
  Device* device = options_.target.device;
  // Note [Prefetch and adoption]: take what a prefetch of the same files read.
  std::unique_ptr<ReadSession> session;
  if (request.adopt != nullptr) {
    session = request.adopt->take();
    if (session && (session->streaming != streaming || !detail::same_files(session->checkpoint, checkpoint))) {
      log::debug("dropping a prefetch of other files or another destination mode");
      session.reset();
    }
  }
  if (session) {
    counters->files_direct = 0;
    counters->files_buffered = 0;
    for (const auto& f : session->files) {
      if (f->opened) (f->direct ? counters->files_direct : counters->files_buffered)++;  // the rest count as they open
    }
    counters->bytes_total = session->plan.total_bytes;
    counters->bytes_done = session->bytes_done();
  } else {
    session = detail::open_session(env_, options_, checkpoint, staging_pool_, nullptr, counters);
  }
  ReadSession& s = *session;
  const std::size_t n = s.files.size();
  detail::allocate_blocks(s, *pool_, stop);
  std::optional<CopyEngine> engine;
  if (device != nullptr) {
    engine.emplace(*device, options_.target.copy);
    for (std::size_t i = 0; i < n; ++i) {
      s.files[i]->device_buffer = device->allocate(std::max<std::uint64_t>(checkpoint.files[i].header.data_size(), 1));
    }
  }

  // Note [Conversion on load]: what converts, into which output memory.
  detail::ConversionPlan conversions = detail::plan_conversions(env_, checkpoint, options_.dtype);
  std::vector<std::shared_ptr<Block>> converted_blocks(n);
  std::vector<std::shared_ptr<DeviceBuffer>> converted_buffers(n);
  for (std::size_t i = 0; i < n && !conversions.empty(); ++i) {
    if (conversions.out_bytes[i] == 0) continue;
    if (device != nullptr) {
      converted_buffers[i] = device->allocate(conversions.out_bytes[i]);
    } else {
      converted_blocks[i] = pool_->allocate(conversions.out_bytes[i], stop);
    }
  }
  // Device conversions run as the copies of their tensors complete.
  std::optional<detail::DeviceConversions> device_conversions;
  if (device != nullptr && !conversions.empty()) {
    std::vector<std::shared_ptr<DeviceBuffer>> stored(n);
    for (std::size_t i = 0; i < n; ++i) stored[i] = s.files[i]->device_buffer;
    device_conversions.emplace(conversions, checkpoint, *device, *engine, std::move(stored), converted_buffers);
  }

  std::vector<Tensor> tensors;
  tensors.reserve(checkpoint.tensor_count());
  std::vector<bool> dropped;  // scales and markers used up by a conversion
  std::vector<std::pair<std::string, std::string>> metadata;
  for (std::size_t i = 0; i < n; ++i) {
    const CheckpointFile& cf = checkpoint.files[i];
    const std::uint64_t base = s.plan.files[i].data_in_block();
    for (std::size_t k = 0; k < cf.header.tensors.size(); ++k) {
      const TensorInfo& t = cf.header.tensors[k];
      const std::int64_t role = conversions.empty() ? detail::kKeptTensor : conversions.role[i][k];
      dropped.push_back(role == detail::kDroppedTensor);
      if (role >= 0) {
        const detail::TensorConversion& tc = conversions.tensors[static_cast<std::size_t>(role)];
        if (device != nullptr) {
          tensors.emplace_back(cf.name_prefix + t.name, tc.to, t.shape, converted_buffers[i], tc.out_offset,
                               tc.out_bytes());
        } else {
          tensors.emplace_back(cf.name_prefix + t.name, tc.to, t.shape, converted_blocks[i], tc.out_offset,
                               tc.out_bytes());
        }
        continue;
      }
      if (streaming) {
        tensors.emplace_back(cf.name_prefix + t.name, t.dtype, t.shape, s.files[i]->device_buffer, t.begin, t.nbytes());
        continue;
      }
      Tensor& tensor =
          tensors.emplace_back(cf.name_prefix + t.name, t.dtype, t.shape, s.files[i]->block, base + t.begin, t.nbytes());
      if (device != nullptr) tensor.set_device(s.files[i]->device_buffer, t.begin);
    }
    for (const auto& kv : cf.header.metadata) {
      if (std::none_of(metadata.begin(), metadata.end(), [&](const auto& m) { return m.first == kv.first; })) {
        metadata.push_back(kv);
      }
    }
  }
  // Host loads hand tensors out as they arrive; device loads once copied;
  // converting loads at the end (elements across chunks convert last).
  std::optional<Arrivals> arrivals;
  if (counters->ready != nullptr && device == nullptr && conversions.empty()) arrivals.emplace(s.plan, checkpoint);
  auto hand_out = [&](const std::vector<std::size_t>& ready) {
    std::vector<Tensor> out;
    out.reserve(ready.size());
    for (std::size_t i : ready) out.push_back(counters->stream ? std::move(tensors[i]) : tensors[i]);
    counters->ready->push(std::move(out));
  };
  // After each chunk: its tensors that became ready, and its copy to the
  // device. Only the data section goes to the device: clip the header bytes
  // that an aligned read brings along. In kStreaming the ticket holds the
  // staging block until its copy completes, then the pool has it back.
  auto on_read = [&](std::size_t i, std::shared_ptr<Block> block, std::size_t block_offset) {
    const ReadChunk& c = s.plan.chunks[i];
    // Host conversions: out of the read block while it is fresh, on this reader.
    if (device == nullptr && !conversions.empty()) {
      detail::convert_chunk(conversions, c, block->data() + block_offset, converted_blocks);
    }
    if (arrivals) {
      std::vector<std::size_t> ready;
      const bool file_read = arrivals->arrived(c, &ready);
      if (!ready.empty()) hand_out(ready);
      // HandOut::kStream: the file's tensors are all out and no reader
      // touches its block again, so the callers' tensors alone hold it.
      if (file_read && counters->stream) s.files[c.file]->block.reset();
    }
    if (!engine) return;
    const FileRead& r = s.plan.files[c.file];
    const std::uint64_t begin = std::max(c.offset, r.data_offset);
    const std::uint64_t end = c.offset + c.valid;
    if (end > begin) {
      engine->submit(std::move(block), block_offset + (begin - c.offset), s.files[c.file]->device_buffer,
                     begin - r.data_offset, end - begin);
      if (device_conversions) device_conversions->copied(c.file, begin - r.data_offset, end - r.data_offset);
    }
  };

  std::exception_ptr error;
  try {
    // What a prefetch read goes first, in plan order; staging blocks are
    // handed to their copies and burnt as the copies complete.
    for (std::size_t i = 0; i < s.plan.chunks.size(); ++i) {
      if (!s.chunk_done(i)) continue;
      const ReadChunk& c = s.plan.chunks[i];
      if (s.streaming) {
        on_read(i, std::move(s.staged[i]), 0);
      } else {
        on_read(i, s.files[c.file]->block, c.offset - s.plan.files[c.file].read_begin);
      }
    }
    detail::execute(s, s.pending(), options_.threads, stop, counters, numa_.cpus, on_read);
  } catch (...) {
    error = std::current_exception();
  }
  if (engine) {
    // Copies already queued finish before anything is released, error or not.
    try {
      engine->wait_all();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    counters->bytes_copied = engine->stats().bytes_completed;
  }
  if (error) std::rethrow_exception(error);
  if (stop.stop_requested()) throw CancelledError("load cancelled");
  if (!conversions.empty()) {
    if (device == nullptr) {
      std::vector<std::shared_ptr<Block>> file_blocks(n);
      for (std::size_t i = 0; i < n; ++i) file_blocks[i] = s.files[i]->block;
      detail::convert_straddlers(conversions, s.plan, file_blocks, converted_blocks);
    } else {
      device_conversions->finish();
    }
    std::vector<Tensor> kept;
    kept.reserve(tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (!dropped[i]) kept.push_back(std::move(tensors[i]));
    }
    tensors = std::move(kept);
  }
  if (request.record != nullptr) {
    IoTemplate recorded = template_files_of(checkpoint);
    if (recorded.files == request.record->files) recorded.destinations = std::move(request.record->destinations);
    recorded.set(s.completed_reads(destination()));
    *request.record = std::move(recorded);
  }
  if (counters->ready != nullptr && !conversions.empty()) {
    counters->ready->push(tensors);
  } else if (counters->ready != nullptr) {
    if (!arrivals) arrivals.emplace(s.plan, checkpoint);
    std::vector<std::size_t> rest;
    arrivals->rest(&rest);
    hand_out(rest);
  }
  if (counters->stream) return StateDict();
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

LoadHandle Loader::load_async(std::vector<std::string> paths, HandOut hand_out) const {
  auto state = std::make_shared<LoadHandle::State>();
  state->counters.ready = &state->ready;
  state->counters.stream = hand_out == HandOut::kStream;
  // The thread holds copies of what it needs; `this` need not outlive it.
  state->thread = std::jthread([loader = *this, paths = std::move(paths), s = state.get()] {
    try {
      Checkpoint checkpoint = open_checkpoint(loader.env_, paths, loader.options_.resolve);
      if (s->stop.stop_requested()) throw CancelledError("load cancelled");
      s->result = loader.run(checkpoint, LoadRequest{s->stop.get_token()}, &s->counters);
    } catch (...) {
      s->error = std::current_exception();
    }
    s->ready.close(s->error != nullptr);
    s->finished = true;
  });
  return LoadHandle(std::move(state));
}

LoadHandle Loader::load_async(Prefetch prefetch, HandOut hand_out) const {
  auto state = std::make_shared<LoadHandle::State>();
  state->counters.ready = &state->ready;
  state->counters.stream = hand_out == HandOut::kStream;
  state->thread = std::jthread([loader = *this, p = std::move(prefetch), s = state.get()]() mutable {
    try {
      s->result = loader.adopt(p, LoadRequest{s->stop.get_token()}, &s->counters);
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

LoadProgress LoadHandle::progress() const noexcept { return state_ ? state_->counters.snapshot() : LoadProgress{}; }

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
