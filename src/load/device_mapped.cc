#include "load/device_mapped.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <utility>

#include "base/log.h"
#include "io/leased_mapping.h"
#include "load/load_counters.h"
#include "load/zero_copy.h"
#include "pinload/file_identity.h"
#include "pinload/error.h"

namespace pinload::detail {

namespace {

constexpr std::size_t kPage = 4096;
constexpr std::size_t kChunkGrain = 2u << 20;
constexpr std::size_t kMinChunk = 8u << 20;
constexpr std::size_t kMaxChunk = 256u << 20;

std::atomic<bool> g_file_registration_refused{false};

struct Registry {
  std::mutex mu;
  std::map<std::pair<std::uint64_t, std::string>, std::weak_ptr<RegisteredMapping>> entries;
};

Registry& registry() {
  static Registry* r = new Registry;  // NOLINT: never destroyed, mappings may go at exit
  return *r;
}

}  // namespace

std::size_t registration_chunk_bytes(const RegistrationCost& cost) {
  if (cost.seconds_per_gb <= 0) return kMaxChunk;
  // Per-call cost = kRegistrationCallShare x the chunk's per-byte cost.
  const double bytes = cost.seconds_per_call / (kRegistrationCallShare * cost.seconds_per_gb) * 1e9;
  const double grains = std::ceil(std::max(bytes, 1.0) / static_cast<double>(kChunkGrain));
  const double rounded = std::min(grains * static_cast<double>(kChunkGrain), static_cast<double>(kMaxChunk));
  return std::clamp(static_cast<std::size_t>(rounded), kMinChunk, kMaxChunk);
}

std::shared_ptr<RegisteredMapping> RegisteredMapping::make(std::shared_ptr<Block> mapping, const std::byte* data,
                                                           std::size_t bytes, bool file_backed, bool register_chunks,
                                                           std::size_t chunk_bytes) {
  std::shared_ptr<RegisteredMapping> m(new RegisteredMapping);
  m->mapping_ = std::move(mapping);
  m->data_ = data;
  m->bytes_ = (bytes + kPage - 1) / kPage * kPage;
  m->chunk_bytes_ = std::max<std::size_t>((chunk_bytes + kPage - 1) / kPage * kPage, kPage);
  m->file_backed_ = file_backed;
  m->register_ = register_chunks;
  m->chunks_.resize((m->bytes_ + m->chunk_bytes_ - 1) / m->chunk_bytes_);
  return m;
}

RegisteredMapping::~RegisteredMapping() {
  chunks_.clear();  // unregistered while the mapping is still there
}

std::shared_ptr<Block> RegisteredMapping::block() {
  return std::shared_ptr<Block>(shared_from_this(), mapping_.get());
}

bool RegisteredMapping::copy(CopyEngine& engine, std::size_t offset, std::size_t bytes,
                             const std::shared_ptr<DeviceBuffer>& dst, std::size_t dst_offset) {
  Device& device = engine.device();
  const std::shared_ptr<Block> whole = block();
  const std::size_t end = offset + bytes;
  for (std::size_t at = offset; at < end;) {
    const std::size_t k = at / chunk_bytes_;
    const std::size_t chunk_end = std::min((k + 1) * chunk_bytes_, bytes_);
    const std::size_t n = std::min(end, chunk_end) - at;
    {
      std::lock_guard lock(mu_);
      if (device_id_ != 0 && device_id_ != device.id()) {
        // Registered with another device: CUDA's portable registration serves
        // every device; elsewhere the chunks copy unregistered.
      } else if (register_ && !refused_ && !chunks_[k]) {
        std::string why;
        const std::size_t chunk_bytes = chunk_end - k * chunk_bytes_;
        chunks_[k] = device.register_host(data_ + k * chunk_bytes_, chunk_bytes, &why);
        if (chunks_[k]) {
          device_id_ = device.id();
        } else {
          refused_ = true;
          if (file_backed_) {
            if (!g_file_registration_refused.exchange(true)) {
              log::debug("{} refused to register a file mapping ({}): device loads of this process read their files "
                         "into pinned memory (the staged path) from now on",
                         device.name(), why);
            }
            return false;
          }
          log::debug("{} refused to register {} bytes of a store entry ({}): they copy as from pageable memory",
                     device.name(), chunk_bytes, why);
        }
      }
    }
    // Submitted at once: the next chunk's registration runs while this one copies.
    engine.submit(whole, at, dst, dst_offset + (at - offset), n);
    at += n;
  }
  return true;
}

std::shared_ptr<RegisteredMapping> find_registered(const Device& device, const std::string& key) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  auto it = r.entries.find({device.id(), key});
  if (it == r.entries.end()) return nullptr;
  std::shared_ptr<RegisteredMapping> m = it->second.lock();
  if (!m || (m->still_valid && !m->still_valid())) {
    r.entries.erase(it);
    return nullptr;
  }
  return m;
}

void keep_registered(const Device& device, const std::string& key, const std::shared_ptr<RegisteredMapping>& mapping) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  std::erase_if(r.entries, [](const auto& e) { return e.second.expired(); });
  r.entries[{device.id(), key}] = mapping;
}

bool file_registration_refused() noexcept { return g_file_registration_refused.load(std::memory_order_relaxed); }

void forget_file_registration_refusal() noexcept { g_file_registration_refused.store(false); }

std::vector<std::shared_ptr<DeviceBuffer>> allocate_file_buffers(const Checkpoint& checkpoint, Device& device) {
  std::vector<std::shared_ptr<DeviceBuffer>> buffers;
  buffers.reserve(checkpoint.files.size());
  for (const CheckpointFile& f : checkpoint.files) {
    try {
      buffers.push_back(device.allocate(std::max<std::uint64_t>(f.header.data_size(), 1)));
    } catch (const OutOfMemoryError& e) {
      if (!e.context().file.empty()) throw;
      throw OutOfMemoryError(e.message(), ErrorContext{f.path});
    }
  }
  return buffers;
}

std::optional<StateDict> copy_mapped_to_device(const Checkpoint& checkpoint,
                                               const std::vector<std::shared_ptr<RegisteredMapping>>& files,
                                               const std::vector<std::shared_ptr<DeviceBuffer>>& buffers,
                                               Device& device, const CopyOptions& copy) {
  {
    CopyEngine engine(device, copy);
    for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
      const auto& h = checkpoint.files[i].header;
      if (h.data_size() == 0) continue;
      if (!files[i]->copy(engine, h.data_offset(), h.data_size(), buffers[i], 0)) {
        engine.wait_all();
        return std::nullopt;
      }
    }
    engine.wait_all();
  }
  std::vector<Tensor> tensors;
  tensors.reserve(checkpoint.tensor_count());
  for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
    const CheckpointFile& cf = checkpoint.files[i];
    const std::shared_ptr<Block> block = files[i]->block();
    const std::uint64_t base = cf.header.data_offset();
    for (const TensorInfo& t : cf.header.tensors) {
      Tensor& tensor = tensors.emplace_back(cf.name_prefix + t.name, t.dtype, t.shape, block, base + t.begin, t.nbytes());
      tensor.set_device(buffers[i], t.begin);
    }
  }
  return StateDict(std::move(tensors), checkpoint.metadata());
}

std::optional<StateDict> load_mapped_to_device(const LoadOptions& options, Env* env, const Checkpoint& checkpoint,
                                               Loader::Counters* counters, std::stop_token stop,
                                               const std::function<StateDict(const Checkpoint&)>& read) {
  Device& device = *options.target.device;
  if (options.zero_copy == ZeroCopy::kOff || file_registration_refused()) return std::nullopt;
  const std::size_t n = checkpoint.files.size();
  std::vector<std::shared_ptr<RegisteredMapping>> files(n);
  std::vector<std::string> keys(n);
  std::vector<MappedFile> fresh(n);  // mapped by this load: populated before the copies
  for (std::size_t i = 0; i < n; ++i) {
    const CheckpointFile& cf = checkpoint.files[i];
    if (cf.path.find("://") != std::string::npos || !cf.version.empty()) continue;  // remote
    keys[i] = "file:" + cf.path + ":" + FileIdentity::of(cf.stat).describe();
    if ((files[i] = find_registered(device, keys[i]))) continue;
    if (options.zero_copy == ZeroCopy::kAuto) {
      // Each mapping holds its file open for the lease: leave three quarters
      // of the descriptors to everything else, as a zero-copy host load does.
      rlimit nofile{};
      if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY &&
          LeasedMapping::live_count() >= nofile.rlim_cur / 4) {
        continue;
      }
      const int fd = env->open_read(cf.path, 0);
      if (fd < 0) continue;
      const ScopedFd owned(env, fd);
      const double resident = env->resident_fraction(fd, cf.stat.size, 64);
      if (resident < options.resident_threshold) continue;  // cold: read (and staged) as before
    }
    std::string why;
    std::shared_ptr<LeasedMapping> lease = LeasedMapping::open(env, cf.path, FileIdentity::of(cf.stat), &why);
    if (!lease) {
      log::debug("{}: read, not copied from a mapping ({})", cf.path, why);
      continue;
    }
    std::shared_ptr<Block> block = lease->block();
    fresh[i] = MappedFile{lease->data(), block};
    files[i] = RegisteredMapping::make(std::move(block), lease->data(), lease->size(), /*file_backed=*/true);
    // After a lease break the address holds anonymous memory, not the registered file pages.
    files[i]->still_valid = [weak = std::weak_ptr<LeasedMapping>(lease)] {
      const std::shared_ptr<LeasedMapping> l = weak.lock();
      return l != nullptr && !l->moved();
    };
  }
  Checkpoint mapped_part, rest;
  mapped_part.index_files = rest.index_files = checkpoint.index_files;
  std::vector<std::shared_ptr<RegisteredMapping>> mapped_files;
  std::vector<bool> was_mapped(n, false);
  for (std::size_t i = 0; i < n; ++i) {
    was_mapped[i] = files[i] != nullptr;
    if (files[i]) {
      mapped_part.files.push_back(checkpoint.files[i]);
      mapped_files.push_back(files[i]);
    } else {
      rest.files.push_back(checkpoint.files[i]);
    }
  }
  if (mapped_files.empty()) return std::nullopt;
  // Device memory first, as a load that reads: a model that cannot fit fails before any work.
  const std::vector<std::shared_ptr<DeviceBuffer>> buffers = allocate_file_buffers(mapped_part, device);
  // Every page in memory, and a page that cannot be read an IoError, before
  // any is registered.
  populate_mapped(env, fresh, checkpoint, options.threads, options.block_size, stop);
  fresh.clear();
  if (stop.stop_requested()) throw CancelledError("load cancelled");
  std::optional<StateDict> copied =
      copy_mapped_to_device(mapped_part, mapped_files, buffers, device, options.target.copy);
  if (!copied) return std::nullopt;  // refused: the staged path reads every file
  for (std::size_t i = 0; i < n; ++i) {
    if (files[i]) {
      keep_registered(device, keys[i], files[i]);
      log::debug("{}: copied to {} from its mapping", checkpoint.files[i].path, device.name());
    }
  }
  const bool streaming = options.target.mode == DeviceMode::kStreaming;
  std::vector<Tensor> from_mappings;
  from_mappings.reserve(copied->size());
  for (const Tensor& t : *copied) {
    if (streaming) {
      from_mappings.emplace_back(t.name(), t.dtype(), t.shape(), t.device_buffer(), t.device_offset(), t.nbytes());
    } else {
      from_mappings.push_back(t);
    }
  }
  copied.reset();
  files.clear();
  mapped_files.clear();  // streaming: the mappings go with the last host view
  const std::uint64_t bytes = mapped_part.data_bytes();
  counters->bytes_total += bytes;
  counters->bytes_done += bytes;
  counters->bytes_copied += bytes;
  counters->files_zero_copy += mapped_part.files.size();
  if (counters->ready != nullptr) counters->ready->push(from_mappings);
  StateDict read_part;
  if (!rest.files.empty()) read_part = read(rest);
  if (counters->stream) return StateDict();
  std::vector<Tensor> tensors;
  tensors.reserve(checkpoint.tensor_count());
  std::size_t next_mapped = 0, next_read = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t count = checkpoint.files[i].header.tensors.size();
    for (std::size_t k = 0; k < count; ++k) {
      tensors.push_back(was_mapped[i] ? from_mappings[next_mapped++] : read_part[next_read++]);
    }
  }
  return StateDict(std::move(tensors), checkpoint.metadata());
}

}  // namespace pinload::detail
