#include "pinload/loader.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <unordered_map>

#include "base/log.h"
#include "io/read_session.h"
#include "load/convert_on_load.h"
#include "load/load_plan.h"
#include "load/numa_choice.h"
#include "load/load_counters.h"
#include "load/prefetch_handover.h"
#include "load/verify.h"
#include "load/store_load.h"
#include "load/device_mapped.h"
#include "load/zero_copy.h"
#include "pinload/error.h"
#include "pinload/io_template.h"
#include "pinload/prefetch.h"
#include "pinload/read_plan.h"

namespace pinload {

namespace {

using detail::PrefetchHandover;
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



// ---- the stages of Loader::run ----

// The session of a load: what an adopted prefetch of the same files and mode
// read (Note [Prefetch and adoption]), else a new one.
std::unique_ptr<ReadSession> session_for(const Checkpoint& checkpoint, const LoadRequest& request, bool streaming,
                                         const std::function<std::unique_ptr<ReadSession>()>& open,
                                         Loader::Counters* counters) {
  std::unique_ptr<ReadSession> session;
  if (request.adopt != nullptr) {
    session = PrefetchHandover::take(*request.adopt);
    if (session && (session->streaming() != streaming || !detail::same_files(session->checkpoint(), checkpoint))) {
      log::debug("dropping a prefetch of other files or another destination mode");
      session.reset();
    }
  }
  if (session) {
    session->count_files(counters);
    return session;
  }
  return open();
}

// Where converted tensors live (Note [Conversion on load] in convert.h): per
// file, a pool block (host loads) or a device buffer (device loads) holding
// its converted tensors; null for a file with none.
struct ConvertedMemory {
  std::vector<std::shared_ptr<Block>> blocks;
  std::vector<std::shared_ptr<DeviceBuffer>> buffers;
};

ConvertedMemory allocate_converted(const detail::ConversionPlan& conversions, const Checkpoint& checkpoint,
                                   Device* device, Pool& pool, std::stop_token stop) {
  const std::size_t files = checkpoint.files.size();
  ConvertedMemory out{std::vector<std::shared_ptr<Block>>(files), std::vector<std::shared_ptr<DeviceBuffer>>(files)};
  for (std::size_t i = 0; i < files && !conversions.empty(); ++i) {
    if (conversions.out_bytes[i] == 0) continue;
    if (device != nullptr) {
      try {
        out.buffers[i] = device->allocate(conversions.out_bytes[i]);
      } catch (const OutOfMemoryError& e) {
        throw OutOfMemoryError(e.message() + " (the file's converted output)", ErrorContext{checkpoint.files[i].path});
      }
      continue;
    }
    try {
      out.blocks[i] = pool.allocate(conversions.out_bytes[i], stop);
    } catch (const OutOfMemoryError& e) {
      throw OutOfMemoryError(e.message() + " (the file's converted output)", ErrorContext{checkpoint.files[i].path});
    }
  }
  return out;
}

// The tensors of a load, file by file in header order, over their files'
// blocks and (device loads) device buffers, converted ones over their
// converted memory, less those a conversion uses up (scales, markers); and
// the files' metadata, merged (the first file wins a key).
struct TensorIndex {
  std::vector<Tensor> tensors;
  std::vector<std::pair<std::string, std::string>> metadata;
};

TensorIndex index_tensors(const Checkpoint& checkpoint, const ReadSession& s,
                          const std::vector<std::shared_ptr<DeviceBuffer>>& device_buffers,
                          const detail::ConversionPlan& conversions, const ConvertedMemory& converted) {
  TensorIndex index;
  index.tensors.reserve(checkpoint.tensor_count());
  const bool on_device = !device_buffers.empty();
  for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
    const CheckpointFile& cf = checkpoint.files[i];
    const std::uint64_t base = s.plan().files[i].data_in_block();
    for (std::size_t k = 0; k < cf.header.tensors.size(); ++k) {
      const TensorInfo& t = cf.header.tensors[k];
      const std::int64_t role = conversions.empty() ? detail::kKeptTensor : conversions.role[i][k];
      if (role == detail::kDroppedTensor) continue;
      if (role >= 0) {
        const detail::TensorConversion& tc = conversions.tensors[static_cast<std::size_t>(role)];
        if (on_device) {
          index.tensors.emplace_back(cf.name_prefix + t.name, tc.to, t.shape, converted.buffers[i], tc.out_offset,
                                     tc.out_bytes());
        } else {
          index.tensors.emplace_back(cf.name_prefix + t.name, tc.to, t.shape, converted.blocks[i], tc.out_offset,
                                     tc.out_bytes());
        }
        continue;
      }
      if (s.streaming()) {
        index.tensors.emplace_back(cf.name_prefix + t.name, t.dtype, t.shape, device_buffers[i], t.begin, t.nbytes());
        continue;
      }
      Tensor& tensor =
          index.tensors.emplace_back(cf.name_prefix + t.name, t.dtype, t.shape, s.block(i), base + t.begin, t.nbytes());
      if (on_device) tensor.set_device(device_buffers[i], t.begin);
    }
  }
  index.metadata = checkpoint.metadata();
  return index;
}

// Converts what could not convert chunk by chunk once every read (and copy)
// is done: on the host the elements across chunks of whole-file blocks (a
// staged load's converted in HostConversions::finish), on a device
// everything.
void finish_conversions(const detail::ConversionPlan& conversions, const ReadSession& s,
                        detail::DeviceConversions* on_device, const ConvertedMemory& converted) {
  if (conversions.empty() || conversions.staged) return;
  if (on_device == nullptr) {
    std::vector<std::shared_ptr<Block>> file_blocks(s.file_count());
    for (std::size_t i = 0; i < file_blocks.size(); ++i) file_blocks[i] = s.block(i);
    detail::convert_straddlers(conversions, s.plan(), file_blocks, converted.blocks);
  } else {
    on_device->finish();
  }
}

// The loader side of a device load (Note [Device loads]): one device buffer
// per file (its data section) and the copy engine that fills them, chunk by
// chunk as reads complete.
class DevicePipeline {
 public:
  DevicePipeline(Device& device, const CopyOptions& copy, const Checkpoint& checkpoint) : engine_(device, copy) {
    buffers_.reserve(checkpoint.files.size());
    for (const CheckpointFile& f : checkpoint.files) {
      try {
        buffers_.push_back(device.allocate(std::max<std::uint64_t>(f.header.data_size(), 1)));
      } catch (const OutOfMemoryError& e) {
        if (!e.context().file.empty()) throw;
        throw OutOfMemoryError(e.message(), ErrorContext{f.path});
      }
    }
  }
  const std::vector<std::shared_ptr<DeviceBuffer>>& buffers() const noexcept { return buffers_; }
  CopyEngine& engine() noexcept { return engine_; }
  // Each copy submitted is reported to `conversions` (may be null), so that a
  // tensor converts as soon as its stored bytes are submitted.
  void convert_as_copied(detail::DeviceConversions* conversions) noexcept { conversions_ = conversions; }

  // Queues the copy of chunk `c`, which lies at `block_offset` in `block`.
  // Only the data section goes to the device: the header bytes that an
  // aligned read brings along are clipped. In kStreaming the ticket holds the
  // staging block until its copy completes, then the pool has it back.
  void submit(const ReadPlan& plan, const ReadChunk& c, std::shared_ptr<Block> block, std::size_t block_offset) {
    const FileRead& r = plan.files[c.file];
    const std::uint64_t begin = std::max(c.offset, r.data_offset);
    const std::uint64_t end = c.offset + c.valid;
    if (end > begin) {
      engine_.submit(std::move(block), block_offset + (begin - c.offset), buffers_[c.file], begin - r.data_offset,
                     end - begin);
      if (conversions_ != nullptr) conversions_->copied(c.file, begin - r.data_offset, end - r.data_offset);
    }
  }

  // Waits for every copy queued (never releases a block under a DMA), keeping
  // the first error in *error; counts the bytes copied.
  void drain(std::exception_ptr* error, Loader::Counters* counters) {
    try {
      engine_.wait_all();
    } catch (...) {
      if (!*error) *error = std::current_exception();
    }
    counters->bytes_copied = engine_.stats().bytes_completed;
  }

 private:
  CopyEngine engine_;
  std::vector<std::shared_ptr<DeviceBuffer>> buffers_;
  detail::DeviceConversions* conversions_ = nullptr;
};

// Hands a load's tensors out as they become ready (Note [Ready tensors]):
// host tensors chunk by chunk, device tensors (and anything left) at the end,
// converting loads' all at the end. Under HandOut::kStream each tensor is
// moved out, so the load keeps none.
class TensorHandOut {
 public:
  // `tensors` are the load's (TensorIndex); `by_chunk`: a host load without
  // conversion; `converting`: a load with conversions (whole at the end).
  // `budgeted`: a session whose blocks come as its files are reached (Note
  // [Streaming within a budget]); each tensor gets its file's block as it is
  // handed out.
  TensorHandOut(const ReadPlan& plan, const Checkpoint& checkpoint, std::vector<Tensor>& tensors,
                const Loader::Counters& counters, bool by_chunk, bool converting, const ReadSession* budgeted)
      : plan_(plan), checkpoint_(checkpoint), tensors_(tensors), ready_(counters.ready), stream_(counters.stream),
        converting_(converting), budgeted_(budgeted) {
    if (ready_ != nullptr && by_chunk) arrivals_.emplace(plan, checkpoint);
    if (budgeted_ != nullptr) {
      for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
        file_of_.insert(file_of_.end(), checkpoint.files[i].header.tensors.size(), static_cast<std::uint32_t>(i));
      }
    }
  }
  // Chunk `c` has been read into `block`, its file's block. True when it was
  // the last of its file: the file's tensors are then all handed out.
  // Budgeted tensors take `block` itself, not the session's pointer to it:
  // the reader of the file's last chunk may release that one meanwhile.
  bool arrived(const ReadChunk& c, const std::shared_ptr<Block>& block) {
    if (!arrivals_) return false;
    std::vector<std::size_t> ready;
    const bool file_read = arrivals_->arrived(c, &ready);
    push(ready, block.get() != nullptr ? &block : nullptr);
    return file_read;
  }
  // The load is complete: everything not handed out yet.
  void rest() {
    if (ready_ == nullptr) return;
    if (converting_) {
      ready_->push(tensors_);
      return;
    }
    if (!arrivals_) arrivals_.emplace(plan_, checkpoint_);
    std::vector<std::size_t> rest;
    arrivals_->rest(&rest);
    push(rest, nullptr);
  }

 private:
  // `block`: the block of every tensor in `indices` (one file's), or null to
  // take each tensor's from the session (no reader runs any more).
  void push(const std::vector<std::size_t>& indices, const std::shared_ptr<Block>* block) {
    if (indices.empty()) return;
    std::vector<Tensor> out;
    out.reserve(indices.size());
    for (std::size_t i : indices) {
      if (budgeted_ != nullptr) {
        const Tensor& t = tensors_[i];
        out.emplace_back(t.name(), t.dtype(), t.shape(), block != nullptr ? *block : budgeted_->block(file_of_[i]),
                         t.block_offset(), t.nbytes());
        continue;
      }
      out.push_back(stream_ ? std::move(tensors_[i]) : tensors_[i]);
    }
    ready_->push(std::move(out));
  }
  const ReadPlan& plan_;
  const Checkpoint& checkpoint_;
  std::vector<Tensor>& tensors_;
  detail::ReadyQueue* ready_;
  const bool stream_;
  const bool converting_;
  const ReadSession* budgeted_;
  std::vector<std::uint32_t> file_of_;  // budgeted_: tensor index -> file
  std::optional<Arrivals> arrivals_;
};

// Records the reads of `s` for `destination` into *record (io_template.h).
void record_template(const Checkpoint& checkpoint, const ReadSession& s, const std::string& destination,
                     IoTemplate* record) {
  IoTemplate recorded = template_files_of(checkpoint);
  if (recorded.files == record->files) recorded.destinations = std::move(record->destinations);
  recorded.set(s.completed_reads(destination));
  *record = std::move(recorded);
}

}  // namespace

namespace {

// The staging block a staged load reads each chunk into: the largest chunk,
// at least `block_size` (ReadSession allocates that much per chunk).
std::size_t largest_chunk(const ReadPlan& plan, std::size_t block_size) {
  std::size_t largest = block_size;
  for (const ReadChunk& c : plan.chunks) largest = std::max<std::size_t>(largest, c.length);
  return largest;
}

// How many staging blocks of `block_bytes` a staged conversion's budget
// holds beside what is in use (its output blocks among it; SIZE_MAX without
// a budget): at least one, else OutOfMemoryError naming the first file.
std::size_t staging_blocks_within_budget(const Pool& pool, std::size_t block_bytes, const ReadPlan& plan) {
  const std::uint64_t capacity = pool.options().capacity_bytes;
  const std::uint64_t in_use = pool.stats().in_use_bytes;
  const std::size_t blocks = pool.blocks_available(block_bytes);
  if (blocks == 0) {
    throw OutOfMemoryError("pool budget of " + std::to_string(capacity) + " bytes holds the converted output (" +
                               std::to_string(in_use) + " bytes in use) but no staging block of " +
                               std::to_string(block_bytes) + " bytes beside it",
                           ErrorContext{plan.files.empty() ? std::string{} : plan.files.front().path});
  }
  return blocks;
}

// InvalidArgumentError unless a staging pool of `capacity` bytes holds one
// read block of `block_bytes`.
void require_one_block(std::uint64_t capacity, std::uint64_t block_bytes) {
  if (capacity < block_bytes) {
    throw InvalidArgumentError("staging budget of " + std::to_string(capacity) + " bytes cannot hold one " +
                               std::to_string(block_bytes) + "-byte read block");
  }
}

// make_staging_pool for options already validated, on `numa_node`.
std::shared_ptr<Pool> staging_pool_on(const LoadOptions& options, Env* env, int numa_node) {
  // Small budgets use plain pages: a 2 MiB huge-page granule would not fit.
  PinnedMemoryOptions pinned{.env = env, .numa_node = numa_node};
  if (options.target.staging_bytes < (64u << 20)) pinned.huge_pages = HugePages::kOff;
  std::unique_ptr<HostMemoryBackend> backend = options.target.device->make_pinned_backend(pinned);
  const std::uint64_t align = backend->alignment();
  require_one_block(options.target.staging_bytes, (Pool::size_class(options.block_size) + align - 1) / align * align);
  PoolOptions staging;
  staging.capacity_bytes = options.target.staging_bytes;
  staging.when_full = WhenFull::kWait;
  return Pool::create(std::move(backend), staging);
}

}  // namespace

namespace detail {

// The machine's topology, read once per process (a load reads it at every
// Loader otherwise); a fake tree (tests) is read every time.
NumaTopology read_numa_topology(const std::string& sysfs_root) {
  if (sysfs_root != "/sys") return NumaTopology::read(sysfs_root);
  static std::mutex mu;
  static std::optional<NumaTopology> machine;
  std::lock_guard lock(mu);
  if (!machine) machine = NumaTopology::read(sysfs_root);
  return *machine;
}

// Note [NUMA placement] (numa.h). Under kNumaAuto, a sysfs it cannot read
// turns placement off rather than failing the load.
NumaPlacement choose_numa_placement(const LoadOptions& options) {
  const int requested = options.numa.node;
  if (requested == kNumaNone) return {};
  try {
    const NumaTopology topology = read_numa_topology(options.numa.sysfs_root);
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

}  // namespace detail

std::shared_ptr<Pool> make_staging_pool(const LoadOptions& options, Env* env) {
  options.validate();
  if (options.target.device == nullptr) throw InvalidArgumentError("staging_bytes (streaming mode) needs a target device");
  return staging_pool_on(options, env != nullptr ? env : default_env(), detail::choose_numa_placement(options).node);
}

Loader::Loader(LoadOptions options, std::shared_ptr<Pool> pool, Env* env, std::shared_ptr<Pool> staging)
    : options_((options.validate(), options)),
      pool_(std::move(pool)),
      env_(env != nullptr ? env : default_env()),
      numa_(detail::choose_numa_placement(options_)) {
  if (options_.target.mode == DeviceMode::kStreaming && options_.target.device == nullptr) {
    throw InvalidArgumentError("staging_bytes (streaming mode) needs a target device");
  }
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
    if (staging) require_one_block(staging->options().capacity_bytes, Pool::size_class(options_.block_size));
    staging_pool_ = staging ? std::move(staging) : staging_pool_on(options_, env_, numa_.node);
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
  if (request.adopt != nullptr && request.adopt->paths() == paths &&
      PrefetchHandover::resolves_like(*request.adopt, options_.resolve)) {
    if (std::optional<Checkpoint> checkpoint = PrefetchHandover::checkpoint(*request.adopt)) {
      return run(*checkpoint, request, &counters);
    }
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
  std::optional<Checkpoint> checkpoint = PrefetchHandover::checkpoint(prefetch);
  if (!checkpoint) {
    if (PrefetchHandover::empty(prefetch)) {
      throw InvalidArgumentError("load(Prefetch&) of an empty prefetch, or one whose headers could not be read");
    }
    checkpoint = open_checkpoint(env_, prefetch.paths(), options_.resolve);
  }
  return run(*checkpoint, request, counters);
}

std::string Loader::destination() const {
  return options_.target.device != nullptr ? options_.target.device->name() : std::string(kHostDestination);
}

namespace {

// Note [Memory limits] (memory_limit.h): the new host memory a load takes
// beside its files' blocks, so that every kind of load that cannot fit the
// process's limit fails before reading instead of being OOM-killed: a host
// conversion's output and its ring, a streaming device load's staging, and
// the stand-in device's buffers, which are host memory.
std::uint64_t host_bytes_beside_blocks(const Checkpoint& checkpoint, const detail::ConversionPlan& conversions,
                                       Device* device, const LoadOptions& options, const Pool* staging_pool) {
  std::uint64_t bytes = 0;
  std::uint64_t stored = 0;
  for (const CheckpointFile& f : checkpoint.files) stored += f.header.data_size();
  std::uint64_t converted = 0;
  for (const std::uint64_t out : conversions.out_bytes) converted += out;
  if (device == nullptr) {
    for (const std::uint64_t out : conversions.out_bytes) bytes += out != 0 ? Pool::size_class(out) : 0;
    if (conversions.staged) {
      // The ring holds at most what the load reads, a chunk at a time: a
      // small file's load needs no 192 MiB beside it.
      const std::uint64_t block = Pool::size_class(options.block_size);
      const std::uint64_t chunks = (stored + options.block_size - 1) / options.block_size + 1;
      bytes += std::max<std::uint64_t>(std::min<std::uint64_t>(detail::kConversionRingBytes, chunks * block), 2 * block);
    }
    return bytes;
  }
  if (device->kind() == DeviceKind::kSim) bytes += stored + converted;
  if (staging_pool != nullptr) {
    const PoolStats staged = staging_pool->stats();
    const std::uint64_t cap = staging_pool->options().capacity_bytes;
    const std::uint64_t most = std::min(cap != 0 ? cap : stored, stored);
    bytes += most > staged.reserved_bytes ? most - staged.reserved_bytes : 0;
  }
  return bytes;
}

// The state dict with the paths it was read from (StateDict::at names them).
StateDict with_files(StateDict sd, const Checkpoint& checkpoint) {
  std::vector<std::string> files;
  files.reserve(checkpoint.files.size());
  for (const CheckpointFile& f : checkpoint.files) files.push_back(f.path);
  sd.set_files(std::move(files));
  return sd;
}

}  // namespace

StateDict Loader::run(const Checkpoint& checkpoint, const LoadRequest& request, Counters* counters,
                      bool may_map) const {
  const std::stop_token& stop = request.stop;
  Device* device = options_.target.device;
  // Note [Load plans]: the facts, then what they decide.
  detail::LoadFacts facts;
  facts.to_device = device != nullptr;
  facts.device_streaming = options_.target.mode == DeviceMode::kStreaming;
  facts.converting = detail::conversion_changes_anything(checkpoint, options_.dtype);
  facts.verifying = options_.verify.active();
  facts.adopting = request.adopt != nullptr;
  facts.recording = request.record != nullptr;
  facts.may_map = may_map;
  facts.zero_copy = options_.zero_copy;
  facts.streams = counters->stream;
  facts.hands_out_ready = counters->ready != nullptr;
  facts.direct = options_.direct;
  auto hand_out_ready = [&](std::vector<Tensor> ready) {
    if (counters->ready != nullptr) counters->ready->push(std::move(ready));
  };
  auto read_rest = [&](const Checkpoint& rest) { return run(rest, request, counters, false); };
  const detail::LoadRoutes routes = detail::plan_routes(facts);
  for (const detail::LoadRoute route : routes.routes) {
    std::optional<StateDict> sd;
    switch (route) {
      case detail::LoadRoute::kStore:  // Note [Store clients]
        sd = detail::load_from_store(options_, env_, checkpoint, counters, stop, hand_out_ready, read_rest);
        break;
      case detail::LoadRoute::kStoreConverted:  // Note [Converted store entries]
        sd = detail::load_converted_from_store(options_, env_, checkpoint, counters, stop, hand_out_ready);
        break;
      case detail::LoadRoute::kStoreToDevice:  // Note [Store device loads]
        sd = detail::load_to_device_from_store(options_, env_, checkpoint, counters, stop);
        if (sd && counters->ready != nullptr) counters->ready->push(std::vector<Tensor>(sd->begin(), sd->end()));
        if (sd && counters->stream) return StateDict();
        break;
      case detail::LoadRoute::kZeroCopy:  // Note [Zero-copy loads]
        sd = detail::load_zero_copy(options_, env_, checkpoint, *pool_, counters, stop, hand_out_ready, read_rest);
        break;
      case detail::LoadRoute::kMappedToDevice:  // Note [Copies from mapped memory] in device_mapped.h
        sd = detail::load_mapped_to_device(options_, env_, checkpoint, counters, stop, read_rest);
        break;
    }
    if (sd) return with_files(std::move(*sd), checkpoint);
  }
  // Note [Conversion on load]: what converts. A staged host load's chunks
  // stream through a ring of staging blocks of the pool (Note [Staged
  // conversion] in convert_on_load.cc).
  const detail::ConversionPlan conversions =
      detail::plan_conversions(env_, checkpoint, options_.dtype, routes.may_stage);
  facts.conversions = !conversions.empty();
  facts.conversions_staged = conversions.staged;
  facts.verify_whole_files = detail::verify_checks_whole_files(options_.verify, checkpoint);
  // Note [Keeping the page cache]: cold files read buffered where they are to
  // stay cached; under kAuto only where the host keeps no copy of its own.
  facts.page_cache_keeps = options_.direct == DirectIo::kAuto && !facts.adopting &&
                           detail::keep_page_cache(options_, env_, checkpoint.data_bytes(),
                                                   detail::page_cache_only_copy(facts));
  if (detail::streams_within_budget(facts)) {
    facts.streaming_budget_bytes = detail::streaming_budget_bytes(*pool_);
    // More than all blocks can take (a file's aligned range, a size class,
    // whole reservations, one shared slab): past the budget, reads may wait.
    facts.most_block_bytes = PoolOptions{}.slab_bytes;
    for (const CheckpointFile& cf : checkpoint.files) facts.most_block_bytes += detail::file_block_charge(*pool_, cf);
  }
  const detail::LoadPlan plan = detail::plan_load(facts);
  if (!plan.refusal.empty()) {
    throw InvalidArgumentError(plan.refusal,
                               ErrorContext{checkpoint.files.empty() ? std::string() : checkpoint.files.front().path});
  }
  const std::shared_ptr<Pool>& staging = plan.stage_in_pool ? pool_ : staging_pool_;
  std::unique_ptr<ReadSession> session = session_for(checkpoint, request, staging != nullptr, [&] {
    ReadOptions read_options = options_.read_options();
    if (plan.read_buffered) read_options.direct = DirectIo::kOff;
    if (plan.one_file_in_flight) read_options.files_in_flight = 1;
    std::unique_ptr<ReadSession> opened =
        ReadSession::open(env_, read_options, checkpoint, staging, nullptr, counters);
    if (plan.budget_bytes != 0) {
      opened->set_budget(std::make_unique<detail::StreamBudget>(
          pool_, plan.budget_bytes, [ready = counters->ready] { return ready->starved(); }));
    }
    return opened;
  }, counters);
  // Note [Verified loads] (manifest.h): headers checked before any memory is taken.
  std::optional<detail::Verifier> verifier;
  if (options_.verify.active()) verifier.emplace(env_, options_.verify, checkpoint, session->plan(), session->streaming());
  ReadSession& s = *session;
  s.allocate_blocks(*pool_, stop, host_bytes_beside_blocks(checkpoint, conversions, device, options_, staging_pool_.get()));
  std::optional<DevicePipeline> pipeline;
  if (plan.device_copies) pipeline.emplace(*device, options_.target.copy, checkpoint);
  static const std::vector<std::shared_ptr<DeviceBuffer>> kNoBuffers;
  const std::vector<std::shared_ptr<DeviceBuffer>>& device_buffers = pipeline ? pipeline->buffers() : kNoBuffers;
  const ConvertedMemory converted = allocate_converted(conversions, checkpoint, device, *pool_, stop);
  TensorIndex index = index_tensors(checkpoint, s, device_buffers, conversions, converted);
  TensorHandOut hand_out(s.plan(), checkpoint, index.tensors, *counters, plan.hand_out_by_chunk,
                         !conversions.empty(), s.budgeted() ? &s : nullptr);
  // Device conversions run as the copies of their tensors complete (Note
  // [Device conversion pipeline] in convert_on_load.h).
  std::optional<detail::DeviceConversions> device_conversions;
  if (plan.device_conversions) {
    device_conversions.emplace(conversions, checkpoint, *device, pipeline->engine(), device_buffers, converted.buffers);
    pipeline->convert_as_copied(&*device_conversions);
  }

  // Host conversions run beside the reads (Note [Converting beside the reads]
  // in convert_on_load.cc), one thread per CPU.
  std::optional<detail::HostConversions> host_conversions;
  if (plan.host_conversions) {
    const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
    const unsigned threads = std::min(options_.threads, cpus);
    std::size_t ring_chunks = SIZE_MAX, ring_reads = SIZE_MAX;
    if (plan.conversion_ring) {
      const std::size_t chunk = largest_chunk(s.plan(), options_.block_size);
      ring_chunks = std::min(detail::conversion_ring_chunks(chunk, s.network_readers(options_.threads), threads),
                             staging_blocks_within_budget(*pool_, chunk, s.plan()));
      ring_reads = detail::conversion_ring_reads(chunk, s.network_readers(options_.threads));
    }
    host_conversions.emplace(env_, conversions, s.plan(), converted.blocks, threads, ring_chunks, ring_reads);
  }

  // Wiring reads to copies: after each chunk, its host conversions (queued),
  // its tensors that became ready and its copy to the device.
  auto on_read = [&](std::size_t i, std::shared_ptr<Block> block, std::size_t block_offset) {
    const ReadChunk& c = s.plan().chunks[i];
    // Verified before anything uses the chunk: no tensor is handed out unchecked.
    if (verifier) verifier->landed(c, block, block_offset);
    // HandOut::kStream: the file's tensors are all out and no reader
    // touches its block again, so the callers' tensors alone hold it.
    if (hand_out.arrived(c, block) && counters->stream) s.release_block(c.file);
    // The block goes last, so a staged chunk's block is back in the pool
    // when its conversion ends and lets the next reader in.
    if (host_conversions) host_conversions->submit(c, std::move(block), block_offset);
    if (pipeline) pipeline->submit(s.plan(), c, std::move(block), block_offset);
  };
  std::exception_ptr error;
  try {
    // What a prefetch read goes first, in plan order; staging blocks are
    // handed to their copies and burnt as the copies complete.
    for (std::size_t i = 0; i < s.plan().chunks.size(); ++i) {
      if (!s.chunk_done(i)) continue;
      const ReadChunk& c = s.plan().chunks[i];
      if (s.streaming()) {
        on_read(i, s.take_staged(i), 0);
      } else {
        on_read(i, s.block(c.file), c.offset - s.plan().files[c.file].read_begin);
      }
    }
    // A staged load's readers wait for room before reading (Note [Staged conversion]).
    detail::ChunkGate gate;
    if (plan.conversion_ring) gate = [&](std::stop_token t) { host_conversions->admit(t); };
    s.execute(s.pending(), options_.threads, stop, counters, numa_.cpus, on_read, gate);
    if (host_conversions) host_conversions->finish();
    if (verifier) verifier->finish();
  } catch (...) {
    error = std::current_exception();
  }
  // Draining: copies already queued finish before anything is released, error or not.
  if (pipeline) pipeline->drain(&error, counters);
  if (error) std::rethrow_exception(error);
  if (stop.stop_requested()) throw CancelledError("load cancelled");
  finish_conversions(conversions, s, device_conversions ? &*device_conversions : nullptr, converted);
  if (request.record != nullptr) record_template(checkpoint, s, destination(), request.record);
  if (s.budgeted() && s.file_count() > 0) s.take_blocks_up_to(s.file_count() - 1, stop);  // files with nothing to read
  hand_out.rest();
  if (counters->stream) return StateDict();
  return with_files(StateDict(std::move(index.tensors), std::move(index.metadata)), checkpoint);
}

// ---- asynchronous loads ----

struct LoadHandle::State {
  detail::ReadyQueue ready;
  Loader::Counters counters;
  std::stop_source stop;
  std::atomic<bool> finished{false};
  std::mutex finished_mu;  // with finished_cv: wait_done()
  std::condition_variable finished_cv;
  StateDict result;
  std::exception_ptr error;
  std::jthread thread;

  void finish() {
    {
      std::lock_guard lock(finished_mu);
      finished = true;
    }
    finished_cv.notify_all();
  }

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
    s->finish();
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
    s->finish();
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

bool LoadHandle::wait_done(std::chrono::microseconds timeout) {
  if (!state_) return true;
  std::unique_lock lock(state_->finished_mu);
  return state_->finished_cv.wait_for(lock, timeout, [&] { return state_->finished.load(); });
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
    if (!t.on_host()) throw InvalidArgumentError("upload() needs host tensors", ErrorContext{{}, t.name()});
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
