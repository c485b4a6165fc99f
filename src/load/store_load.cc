#include "load/store_load.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

#include "base/log.h"
#include "load/device_mapped.h"
#include "load/load_counters.h"
#include "load/zero_copy.h"
#include "pinload/error.h"
#include "pinload/file_identity.h"
#include "pinload/safetensors.h"
#include "pinload/store.h"
#include "remote/remote_url.h"
#include "store/client.h"

namespace pinload::detail {
namespace {

std::atomic<bool> warned{false};

// PINLOAD_STORE_REGISTER: "0", "off" or "false" copies from the store's pages unregistered
// (pageable); anything else, or unset, registers them (Note [Store device loads]).
bool register_store_pages() {
  const char* v = std::getenv("PINLOAD_STORE_REGISTER");
  if (v == nullptr) return true;
  const std::string_view s = v;
  return !(s == "0" || s == "off" || s == "false");
}


// Note [Store clients]: an unreachable store is a warning once per process,
// and the load reads the files itself; with `required`, an error.
void unavailable(const StoreOptions& store, const Error& e) {
  if (store.required) throw;
  if (!warned.exchange(true)) {
    log::warn("{}; loading without the store (store_required makes this an error)", e.what());
  } else {
    log::debug("{}; loading without the store", e.what());
  }
}

// The connection, or null (warned once) where the store cannot be reached and is not required.
std::shared_ptr<StoreConnection> connect_to_store(const StoreOptions& store) {
  try {
    return StoreConnection::connect(store.socket);
  } catch (const UnavailableError& e) {
    unavailable(store, e);
    return nullptr;
  }
}

// The store's entry for the local file `cf` (its converted image where `variant` is active). The
// client opens the file: the store never serves a file its client could not read (Note [The node
// store]).
StoreConnection::Served get_local(StoreConnection& connection, Env* env, const CheckpointFile& cf,
                                  const StoreVariant& variant = {}) {
  ScopedFd fd = open_or_throw(env, cf.path);
  check_identity(env, fd.get(), cf.path, FileIdentity::of(cf.stat));
  return connection.get(fd.get(), store_name(cf.path), /*hold=*/true, variant);
}

// Note [One version per load]: the entry must be of the file whose header was parsed.
void check_served_version(const StoreConnection::Served& served, const CheckpointFile& cf) {
  if (!(served.identity == FileIdentity::of(cf.stat))) {
    throw IoError("replaced or modified since its header was read (the store has " + served.identity.describe() +
                      ", the header was read from " + FileIdentity::of(cf.stat).describe() + ")",
                  ErrorContext{cf.path});
  }
}

}  // namespace

namespace {

// Each local file of `checkpoint` the store serves, mapped; null where it is
// read instead. nullopt where the store is not used at all.
std::optional<std::vector<MappedFile>> map_from_store(const LoadOptions& options, Env* env,
                                                      const Checkpoint& checkpoint, std::stop_token stop) {
  const StoreOptions store = StoreOptions::from_environment(options.store);
  if (!store.active()) return std::nullopt;
  // Note [Remote store entries]: a remote object is an entry where its ETag is a strong one.
  const auto servable = [](const CheckpointFile& f) {
    return f.version.empty() || remote::classify_validator(f.version, 0) == remote::Validator::kStrong;
  };
  if (std::none_of(checkpoint.files.begin(), checkpoint.files.end(), servable)) return std::nullopt;
  const std::shared_ptr<StoreConnection> connection = connect_to_store(store);
  if (!connection) return std::nullopt;
  std::vector<MappedFile> mapped(checkpoint.files.size());
  for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
    const CheckpointFile& cf = checkpoint.files[i];
    const bool remote = !cf.version.empty();
    if (!servable(cf)) {
      log::debug("{}: no strong ETag ({}): read without the store", remote::display_url(cf.path), cf.version);
      continue;
    }
    if (stop.stop_requested()) throw CancelledError("load cancelled");
    StoreConnection::Served served;
    try {
      if (remote) {
        // The client read the header with its own credentials, at this ETag. nullopt: the
        // daemon may not fetch it, or cannot pin its version; read here, required or not.
        std::optional<StoreConnection::Served> fetched =
            connection->get_remote(cf.path, cf.version, cf.stat.size, /*hold=*/true);
        if (!fetched) continue;
        served = std::move(*fetched);
      } else {
        served = get_local(*connection, env, cf);
      }
    } catch (const UnavailableError& e) {
      unavailable(store, e);
      return std::nullopt;
    } catch (const Error& e) {
      // The store refused this file (its budget is held by clients, the
      // daemon's memory is short): read here.
      if (store.required) throw;
      log::warn("{}; reading it without the store", e.what());
      continue;
    }
    // A remote entry's ETag says it is the version whose header was parsed.
    if (!remote) check_served_version(served, cf);
    log::debug("{}: {} the store", remote ? remote::display_url(cf.path) : cf.path,
               served.hit ? "mapped from" : "read into");
    std::shared_ptr<StoreMapping> m = StoreMapping::map(connection, std::move(served), cf.path);
    mapped[i] = MappedFile{m->data(), m->block()};
  }
  return mapped;
}

}  // namespace

std::optional<StateDict> load_from_store(const LoadOptions& options, Env* env, const Checkpoint& checkpoint,
                                         Loader::Counters* counters, std::stop_token stop,
                                         const std::function<void(std::vector<Tensor>)>& hand_out,
                                         const std::function<StateDict(const Checkpoint&)>& read) {
  std::optional<std::vector<MappedFile>> mapped = map_from_store(options, env, checkpoint, stop);
  if (!mapped || std::none_of(mapped->begin(), mapped->end(), [](const MappedFile& m) { return m.block != nullptr; })) {
    return std::nullopt;
  }
  return hand_out_mapped(options, env, checkpoint, std::move(*mapped), &counters->files_store, counters, stop, hand_out,
                         read);
}

namespace {

// Whether each file converts as a checkpoint of its own, as the daemon
// converts it: no FP8 weight whose scale (or quantisation marker) is in
// another file (Note [Conversion on load] in convert.h).
bool converts_file_by_file(const Checkpoint& checkpoint) {
  if (checkpoint.files.size() < 2) return true;
  static constexpr std::string_view kSuffixes[] = {"_scale", ".scale_weight", ".comfy_quant"};
  for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
    const CheckpointFile& cf = checkpoint.files[i];
    for (const TensorInfo& t : cf.header.tensors) {
      if (t.dtype != DType::kF8_E4M3 && t.dtype != DType::kF8_E5M2) continue;
      const std::string layer = t.name.ends_with(".weight") ? t.name.substr(0, t.name.size() - 7) : t.name;
      for (std::size_t j = 0; j < checkpoint.files.size(); ++j) {
        if (j == i || checkpoint.files[j].name_prefix != cf.name_prefix) continue;
        const Header& other = checkpoint.files[j].header;
        if (other.find(t.name + "_scale") != nullptr) return false;
        for (const std::string_view suffix : kSuffixes) {
          if (other.find(layer + std::string(suffix)) != nullptr) return false;
        }
      }
    }
  }
  return true;
}

}  // namespace

std::optional<StateDict> load_converted_from_store(const LoadOptions& options, Env* env, const Checkpoint& checkpoint,
                                                   Loader::Counters* counters, std::stop_token stop,
                                                   const std::function<void(std::vector<Tensor>)>& hand_out) {
  const StoreOptions store = StoreOptions::from_environment(options.store);
  if (!store.active() || checkpoint.files.empty()) return std::nullopt;
  for (const CheckpointFile& cf : checkpoint.files) {
    if (!cf.version.empty()) return std::nullopt;  // remote: converted by its client
  }
  if (!converts_file_by_file(checkpoint)) {
    log::debug("an FP8 weight's scale lies in another file: converted without the store");
    return std::nullopt;
  }
  const std::shared_ptr<StoreConnection> connection = connect_to_store(store);
  if (!connection) return std::nullopt;
  Checkpoint images;
  images.index_files = checkpoint.index_files;
  std::vector<MappedFile> mapped;
  for (const CheckpointFile& cf : checkpoint.files) {
    if (stop.stop_requested()) throw CancelledError("load cancelled");
    StoreConnection::Served served;
    try {
      served = get_local(*connection, env, cf, StoreVariant{options.dtype, cf.name_prefix});
    } catch (const UnavailableError& e) {
      unavailable(store, e);
      return std::nullopt;
    } catch (const Error& e) {
      // Refused (the budget, the daemon's memory, a file it cannot convert): converted here, every file.
      if (store.required) throw;
      log::warn("{}; converting without the store", e.what());
      return std::nullopt;
    }
    check_served_version(served, cf);
    log::debug("{}: {} the store, converted", cf.path, served.hit ? "mapped from" : "converted into");
    std::shared_ptr<StoreMapping> m = StoreMapping::map(connection, std::move(served), cf.path);
    CheckpointFile image;
    image.path = cf.path;
    image.name_prefix = cf.name_prefix;
    image.stat = cf.stat;
    image.stat.size = m->size();
    image.header = parse_safetensors(std::span<const std::byte>(m->data(), m->size()), cf.path + " (the store's converted entry)");
    images.files.push_back(std::move(image));
    mapped.push_back(MappedFile{m->data(), m->block()});
  }
  LoadOptions as_stored = options;
  as_stored.dtype = {};
  return hand_out_mapped(as_stored, env, images, std::move(mapped), &counters->files_store, counters, stop, hand_out,
                         [](const Checkpoint&) -> StateDict { throw std::logic_error("every file is mapped"); });
}

std::optional<StateDict> load_to_device_from_store(const LoadOptions& options, Env* env, const Checkpoint& checkpoint,
                                                   Loader::Counters* counters, std::stop_token stop) {
  Device& device = *options.target.device;
  // Note [Copies from mapped memory] (device_mapped.h): entries whose tensors
  // from a load before still live are copied from that load's registered
  // mappings, with no new mapping and no registration.
  std::vector<std::string> keys;
  std::vector<std::shared_ptr<RegisteredMapping>> files;
  for (const CheckpointFile& cf : checkpoint.files) {
    keys.push_back("store:" + cf.path + ":" + (cf.version.empty() ? FileIdentity::of(cf.stat).describe() : cf.version));
    files.push_back(find_registered(device, keys.back()));
  }
  if (std::any_of(files.begin(), files.end(), [](const auto& f) { return f == nullptr; })) {
    std::optional<std::vector<MappedFile>> mapped = map_from_store(options, env, checkpoint, stop);
    if (!mapped || std::any_of(mapped->begin(), mapped->end(), [](const MappedFile& m) { return m.block == nullptr; })) {
      return std::nullopt;  // the mappings, and their holds, go
    }
    // Note [Store device loads] (store.h): the shared pages registered with the device
    // (pinned: read-only, so their sharing stays), unless PINLOAD_STORE_REGISTER=0.
    // Whole pages: the mapping is sized in whole pages past the file's end.
    for (std::size_t i = 0; i < files.size(); ++i) {
      const MappedFile& m = (*mapped)[i];
      files[i] = RegisteredMapping::make(m.block, m.data, m.block->size(), /*file_backed=*/false, register_store_pages());
    }
  }
  if (stop.stop_requested()) throw CancelledError("load cancelled");
  const std::uint64_t bytes = checkpoint.data_bytes();
  counters->bytes_total += bytes;
  // Straight from the shared pages to the device: no staging copy.
  std::optional<StateDict> both =
      copy_mapped_to_device(checkpoint, files, allocate_file_buffers(checkpoint, device), device, options.target.copy);
  if (!both) throw std::logic_error("a store entry's refused registration ended its copy");
  for (std::size_t i = 0; i < files.size(); ++i) keep_registered(device, keys[i], files[i]);
  files.clear();
  counters->files_store += checkpoint.files.size();
  counters->bytes_done += bytes;
  counters->bytes_copied += bytes;
  if (options.target.mode == DeviceMode::kCached) return both;
  // Streaming: the tensors are on the device only; the mappings (and their registrations) go now.
  std::vector<Tensor> device_only;
  device_only.reserve(both->size());
  for (const Tensor& t : *both) {
    device_only.emplace_back(t.name(), t.dtype(), t.shape(), t.device_buffer(), t.device_offset(), t.nbytes());
  }
  return StateDict(std::move(device_only), both->metadata());
}

}  // namespace pinload::detail
