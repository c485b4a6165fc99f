#include "pinload/session.h"

#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include <future>

#include "load/numa_choice.h"
#include "load/request_state.h"
#include "pinload/error.h"
#include "pinload/host_memory.h"
#include "pinload/model_cache.h"

namespace pinload {

struct Session::State {
  std::mutex mu;
  std::map<std::string, std::unique_ptr<Device>> devices;  // by canonical name
  // By device (null: the host), budget and NUMA node (-1: none).
  std::map<std::tuple<const Device*, std::uint64_t, int>, std::shared_ptr<Pool>> pools;
  std::map<std::tuple<const Device*, std::uint64_t, int>, std::shared_ptr<Pool>> staging_pools;
  // kPrefetch requests not adopted yet, by device and paths (Note [Requests]).
  std::map<std::string, std::shared_ptr<detail::PrefetchSlot>> prefetches;
  std::shared_ptr<ModelCache> cache;  // kCached requests' (made by the first)
};

namespace {

// The pool of a device's (or the host's) loads, on `numa_node`.
std::shared_ptr<Pool> make_pool(Env* env, Device* device, std::uint64_t capacity_bytes, int numa_node) {
  PoolOptions options;
  options.capacity_bytes = capacity_bytes;
  if (device != nullptr) {
    return Pool::create(device->make_pinned_backend(PinnedMemoryOptions{.env = env, .numa_node = numa_node}), options);
  }
  LockedMemoryOptions host = kHostPoolMemory;  // Note [Locking host pools]
  host.numa_node = numa_node;
  return Pool::create(make_locked_memory_backend(env, host), options);
}

// The NUMA node loads with `options` place their pools on (-1: none).
int numa_node_of(const LoadOptions& options) { return detail::choose_numa_placement(options).node; }

}  // namespace

Session::Session(Env* env) : env_(env != nullptr ? env : default_env()), state_(std::make_unique<State>()) {}

// Pools go before devices: a pinned pool's blocks are released through its device.
Session::~Session() {
  state_->prefetches.clear();
  state_->cache.reset();
  state_->staging_pools.clear();
  state_->pools.clear();
}

Session& Session::process() {
  static Session* session = new Session;  // never destroyed: Note [Sessions]
  return *session;
}

Device* Session::device(std::string_view spec) {
  const DeviceSpec parsed = parse_device_spec(spec);
  if (parsed.is_host()) return nullptr;
  std::lock_guard lock(state_->mu);
  std::unique_ptr<Device>& device = state_->devices[parsed.name()];
  if (!device) {
    try {
      device = open_device(parsed);
    } catch (...) {
      state_->devices.erase(parsed.name());
      throw;
    }
  }
  return device.get();
}

std::shared_ptr<Pool> Session::shared_pool(Device* device, std::uint64_t capacity_bytes, int numa_node) {
  std::lock_guard lock(state_->mu);
  std::shared_ptr<Pool>& pool = state_->pools[{device, capacity_bytes, numa_node}];
  if (!pool) pool = make_pool(env_, device, capacity_bytes, numa_node);
  return pool;
}

std::shared_ptr<Pool> Session::shared_staging_pool(const LoadOptions& options, int numa_node) {
  std::lock_guard lock(state_->mu);
  std::shared_ptr<Pool>& pool = state_->staging_pools[{options.target.device, options.target.staging_bytes, numa_node}];
  if (!pool) pool = make_staging_pool(options, env_);
  return pool;
}

std::shared_ptr<Pool> Session::pool(std::string_view spec, std::uint64_t capacity_bytes) {
  LoadOptions options;
  options.target.device = device(spec);
  return shared_pool(options.target.device, capacity_bytes, numa_node_of(options));
}

std::shared_ptr<Pool> Session::staging_pool(std::string_view spec, std::uint64_t staging_bytes) {
  LoadOptions options;
  options.target.device = device(spec);
  if (options.target.device == nullptr) throw InvalidArgumentError("staging_bytes: staging pools are a device's");
  options.target.mode = DeviceMode::kStreaming;
  options.target.staging_bytes = staging_bytes;
  options.validate();
  return shared_staging_pool(options, numa_node_of(options));
}

Loader Session::loader(std::string_view spec, LoadOptions options, Env* env) {
  options.target.device = device(spec);
  options.validate();
  const int node = numa_node_of(options);
  std::shared_ptr<Pool> pool = shared_pool(options.target.device, options.pool_bytes, node);
  std::shared_ptr<Pool> staging;
  if (options.target.device != nullptr && options.target.mode == DeviceMode::kStreaming) {
    staging = shared_staging_pool(options, node);
  }
  return Loader(std::move(options), std::move(pool), env != nullptr ? env : env_, std::move(staging));
}

Checkpoint Session::open(const std::vector<std::string>& paths, const ResolveOptions& options) const {
  return open_checkpoint(env_, paths, options);
}

LoadHandle Session::start(std::string_view spec, LoadOptions options, std::vector<std::string> paths,
                          HandOut hand_out) {
  return loader(spec, std::move(options)).load_async(std::move(paths), hand_out);
}

namespace {

// The key of a prefetch: its device and paths.
std::string prefetch_key(std::string_view device, const std::vector<std::string>& paths) {
  std::string key(device);
  for (const std::string& p : paths) key += '\n' + p;
  return key;
}

}  // namespace

std::shared_ptr<ModelCache> Session::model_cache(const Request& request) {
  std::lock_guard lock(state_->mu);
  if (!state_->cache) {
    LoadOptions host = request.options;
    host.target = DeviceTarget{};  // the cache keeps host copies; get_on uploads them
    auto loader = std::make_shared<const Loader>(std::move(host), nullptr, env_);
    state_->cache = std::make_shared<ModelCache>(request.cache_bytes, std::move(loader));
  }
  return state_->cache;
}

RequestHandle Session::start(Request request) {
  if (request.paths.empty()) throw InvalidArgumentError("a request needs at least one path");
  auto handle = std::make_unique<RequestHandle::State>();
  handle->kind = request.kind;
  const std::string key = prefetch_key(request.device, request.paths);
  switch (request.kind) {
    case RequestKind::kWhole:
    case RequestKind::kStream: {
      const HandOut hand_out = request.kind == RequestKind::kStream ? HandOut::kStream : HandOut::kWhole;
      const Loader l = loader(request.device, std::move(request.options));
      std::shared_ptr<detail::PrefetchSlot> slot;
      {
        std::lock_guard lock(state_->mu);
        if (auto it = state_->prefetches.find(key); it != state_->prefetches.end()) {
          slot = std::move(it->second);
          state_->prefetches.erase(it);
        }
      }
      if (slot) {
        Prefetch taken;
        {
          std::lock_guard lock(slot->mu);
          taken = std::move(slot->prefetch);
        }
        handle->load = l.load_async(std::move(taken), hand_out);
      } else {
        handle->load = l.load_async(std::move(request.paths), hand_out);
      }
      break;
    }
    case RequestKind::kPrefetch: {
      auto slot = std::make_shared<detail::PrefetchSlot>();
      slot->prefetch = prefetch(loader(request.device, std::move(request.options)), std::move(request.paths));
      {
        std::lock_guard lock(state_->mu);
        state_->prefetches[key] = slot;  // replaces an older one of the same paths, which stops with its last holder
      }
      handle->prefetch = std::move(slot);
      break;
    }
    case RequestKind::kBatch: {
      auto l = std::make_shared<const Loader>(loader(request.device, std::move(request.options)));
      handle->batch = std::async(std::launch::async, [l, paths = std::move(request.paths), stop = handle->stop.get_token()] {
        return load_batch(*l, paths, stop);
      });
      break;
    }
    case RequestKind::kShard: {
      if (device(request.device) != nullptr) {
        throw InvalidArgumentError("a shard request loads to the host ('cpu'), not '" + request.device + "'");
      }
      request.options.validate();
      ShardLoadOptions shard;
      shard.threads = request.options.threads;
      shard.block_size = request.options.block_size;
      shard.direct = request.options.direct != DirectIo::kOff;
      shard.wrap_source = request.options.wrap_source;
      handle->shard = std::make_unique<ShardLoad>(request.paths, request.shard, shard,
                                                  pool("cpu", request.options.pool_bytes), env_);
      break;
    }
    case RequestKind::kCached: {
      Device* target = device(request.device);
      std::shared_ptr<ModelCache> cache = model_cache(request);
      handle->cached = std::async(std::launch::async, [cache, target, paths = std::move(request.paths),
                                                       copy = request.options.target.copy] {
        return target != nullptr ? cache->get_on(*target, paths, copy) : cache->get(paths);
      });
      break;
    }
  }
  return RequestHandle(std::move(handle));
}

}  // namespace pinload
