#include "pinload/model_cache.h"

#include <exception>
#include <map>
#include <mutex>
#include <unordered_set>

#include "base/log.h"
#include "pinload/checkpoint.h"
#include "pinload/error.h"
#include "pinload/file_identity.h"

namespace pinload {

namespace {

// A file as it was when the entry was made.
struct SeenFile {
  std::string path;
  FileStat stat;
};

// Stats `path` through the Env without reading it; false if it cannot.
bool stat_path(Env* env, const std::string& path, FileStat* out) {
  const int fd = env->open_read(path, 0);
  if (fd < 0) return false;
  ScopedFd closer(env, fd);
  return env->stat(fd, out) == 0;
}

// The request as the caller spelled it (Note [Cache keys]: an alias).
std::string request_key(const std::vector<std::string>& paths, const ResolveOptions& resolve) {
  std::string key = "variant=" + resolve.variant;
  for (const std::string& p : paths) {
    key += '\0';
    key += p;
  }
  return key;
}

// The identity of the resolved files (Note [Cache keys]).
std::string identity_of(const Checkpoint& ck) {
  std::string key;
  for (const CheckpointFile& f : ck.files) {
    key += f.path;
    key += '\0';
    key += f.name_prefix;
    key += '\0';
    for (std::uint64_t v : {f.stat.size, static_cast<std::uint64_t>(f.stat.mtime_ns), f.stat.inode, f.stat.device}) {
      key += std::to_string(v);
      key += '\0';
    }
  }
  return key;
}

// Pool bytes held by `sd`: the size class of each distinct block.
std::uint64_t pool_bytes(const StateDict& sd) {
  std::unordered_set<const Block*> seen;
  std::uint64_t total = 0;
  for (const Tensor& t : sd) {
    if (t.block() && seen.insert(t.block().get()).second) total += t.block()->capacity();
  }
  return total;
}

// `sd` with each tensor made by `make(t)`, its metadata and files kept
// (StateDict::at names them).
template <typename Make>
StateDict remade(const StateDict& sd, Make make) {
  std::vector<Tensor> tensors;
  tensors.reserve(sd.size());
  for (const Tensor& t : sd) tensors.push_back(make(t));
  StateDict out(std::move(tensors), sd.metadata());
  out.set_files(sd.files());
  return out;
}

// Note [Registrations that last as long as the blocks]
// Note [Copies from mapped memory] (device_mapped.h): a cached entry's blocks
// are registered with each device they go to, once, so that a switch back
// copies with no staging copy and registers nothing again. A registration
// must outlive every copy from its block, and callers hold the entry's
// tensors (get()) past the entry's eviction. So the entry's tensors hold
// their blocks through aliases of a holder that keeps the registrations too:
// a registration ends when the last tensor of its block does, the entry's or
// a caller's, never under a copy.
struct RegisteredBlock {
  std::shared_ptr<Block> block;
  std::mutex mu;
  std::map<std::uint64_t, std::shared_ptr<void>> by_device;  // Device::id -> registration (null: refused)
};

// `sd` with each distinct block behind a RegisteredBlock alias (one holder a block, in `holders`).
StateDict through_registered_blocks(const StateDict& sd, std::vector<std::shared_ptr<RegisteredBlock>>* holders) {
  std::map<const Block*, std::shared_ptr<Block>> alias;
  return remade(sd, [&](const Tensor& t) {
    std::shared_ptr<Block>& a = alias[t.block().get()];
    if (!a) {
      auto holder = std::make_shared<RegisteredBlock>();
      holder->block = t.block();
      a = std::shared_ptr<Block>(holder, holder->block.get());
      holders->push_back(std::move(holder));
    }
    return Tensor(t.name(), t.dtype(), t.shape(), a, t.block_offset(), t.nbytes());
  });
}

StateDict host_only(const StateDict& sd) {
  return remade(sd, [](const Tensor& t) {
    return Tensor(t.name(), t.dtype(), t.shape(), t.block(), t.block_offset(), t.nbytes());
  });
}

StateDict device_only(const StateDict& sd) {
  return remade(sd, [](const Tensor& t) {
    return Tensor(t.name(), t.dtype(), t.shape(), t.device_buffer(), t.device_offset(), t.nbytes());
  });
}

}  // namespace

struct ModelCache::Entry {
  std::string identity;
  StateDict host;
  std::uint64_t bytes = 0;
  // Note [Registrations that last as long as the blocks]: the holders
  // behind the aliases that `host`'s tensors hold.
  std::vector<std::shared_ptr<RegisteredBlock>> blocks;
};

struct ModelCache::Alias {
  std::string identity;
  std::vector<SeenFile> files;  // the weights and the index files read
};

ModelCache::ModelCache(std::uint64_t budget_bytes, std::shared_ptr<const Loader> loader)
    : loader_(loader ? std::move(loader) : std::make_shared<const Loader>()), budget_bytes_(budget_bytes) {
  if (loader_->options().target.device != nullptr) {
    throw InvalidArgumentError("ModelCache needs a Loader that loads to host memory (no device target); use get_on()");
  }
  // Cached copies live in pool memory, counted against the budget and ready
  // for upload(): never a file mapping (Note [Zero-copy loads] in loader.h).
  if (loader_->options().zero_copy != ZeroCopy::kOff) {
    LoadOptions options = loader_->options();
    options.zero_copy = ZeroCopy::kOff;
    loader_ = std::make_shared<const Loader>(options, loader_->pool(), loader_->env());
  }
}

ModelCache::~ModelCache() = default;

StateDict ModelCache::get(const std::vector<std::string>& paths) {
  return lookup_or_load(paths, nullptr, {}, nullptr);
}

StateDict ModelCache::get_on(Device& device, const std::vector<std::string>& paths, const CopyOptions& copy) {
  StateDict on_device;
  StateDict host = lookup_or_load(paths, &device, copy, &on_device);
  if (!on_device.empty() || host.empty()) return on_device;
  // The entry that holds `host`, if it is cached (it may be too large, or gone meanwhile).
  EntryPtr entry;
  {
    std::lock_guard lock(mu_);
    for (const EntryPtr& e : lru_) {
      if (!e->host.empty() && e->host[0].block() == host[0].block()) {
        entry = e;
        break;
      }
    }
  }
  // Pool blocks are page-aligned; whole pages. A refusal (memory the device
  // pinned already: its own pinned pool) leaves a null, tried once.
  const auto register_block = [&device](const Block& b) {
    return device.register_host(b.data(), (b.capacity() + 4095) / 4096 * 4096);
  };
  std::vector<std::shared_ptr<void>> for_this_copy;  // an entry not cached: registered for the copy only
  if (entry) {
    for (const std::shared_ptr<RegisteredBlock>& holder : entry->blocks) {
      std::lock_guard lock(holder->mu);
      if (!holder->by_device.contains(device.id())) holder->by_device[device.id()] = register_block(*holder->block);
    }
  } else {
    std::unordered_set<const Block*> seen;
    for (const Tensor& t : host) {
      if (seen.insert(t.block().get()).second) for_this_copy.push_back(register_block(*t.block()));
    }
  }
  StateDict out = device_only(upload(host, device, copy));
  out.set_files(host.files());  // upload() keeps tensors and metadata only
  return out;
}

bool ModelCache::unchanged(const Alias& alias) const {
  for (const SeenFile& f : alias.files) {
    FileStat now;
    if (!stat_path(loader_->env(), f.path, &now) || FileIdentity::of(now) != FileIdentity::of(f.stat)) {
      log::debug("{}: changed since it was cached", f.path);
      return false;
    }
  }
  return true;
}

// Fills *on_device only when it loaded the model to `device` itself (a miss).
StateDict ModelCache::lookup_or_load(const std::vector<std::string>& paths, Device* device, const CopyOptions& copy,
                                     StateDict* on_device) {
  const std::string key = request_key(paths, loader_->options().resolve);
  std::vector<EntryPtr> graveyard;  // destroyed after the lock is released
  std::shared_future<StateDict> other_load;
  std::promise<StateDict> promise;  // this get's load, if it is a miss
  for (;;) {
    std::unique_lock lock(mu_);
    if (auto a = aliases_.find(key); a != aliases_.end()) {
      const std::shared_ptr<const Alias> alias = a->second;
      lock.unlock();
      const bool fresh = unchanged(*alias);
      lock.lock();
      auto e = entries_.find(alias->identity);
      if (e == entries_.end()) continue;  // dropped meanwhile: look again
      if (fresh) {
        const EntryPtr entry = *e->second;
        touch(entry);
        ++counters_.hits;
        lock.unlock();
        return entry->host;
      }
      ++counters_.invalidations;
      erase_entry(alias->identity, &graveyard);
      continue;
    }
    if (auto f = in_flight_.find(key); f != in_flight_.end()) {
      other_load = f->second;
      ++counters_.waits;
    } else {
      // A miss: this get loads, and gets of the same alias wait for it.
      in_flight_.emplace(key, promise.get_future().share());
    }
    break;
  }
  graveyard.clear();
  if (other_load.valid()) return other_load.get();  // rethrows that load's error

  try {
    const Checkpoint ck = open_checkpoint(loader_->env(), paths, loader_->options().resolve);
    auto alias = std::make_shared<Alias>();
    alias->identity = identity_of(ck);
    for (const CheckpointFile& f : ck.files) alias->files.push_back({f.path, f.stat});
    for (const std::string& index : ck.index_files) {
      SeenFile id{index, {}};
      if (stat_path(loader_->env(), index, &id.stat)) alias->files.push_back(std::move(id));
    }
    {
      std::unique_lock lock(mu_);
      if (auto e = entries_.find(alias->identity); e != entries_.end()) {
        // The same files under another spelling: a hit that read headers only.
        const EntryPtr entry = *e->second;
        touch(entry);
        aliases_[key] = alias;
        ++counters_.hits;
        in_flight_.erase(key);
        lock.unlock();
        promise.set_value(entry->host);
        return entry->host;
      }
      // Make room first, so that the pool can reuse the evicted blocks.
      if (ck.data_bytes() <= budget_bytes_) evict_until(ck.data_bytes(), &graveyard);
    }
    graveyard.clear();

    StateDict host;
    if (device != nullptr) {
      LoadOptions options = loader_->options();
      options.target = DeviceTarget{device, DeviceMode::kCached, copy, kDefaultStagingBytes};
      const StateDict both = Loader(options, loader_->pool(), loader_->env()).load(ck);
      host = host_only(both);
      *on_device = device_only(both);
    } else {
      host = loader_->load(ck);
    }

    auto entry = std::make_shared<Entry>();
    entry->identity = alias->identity;
    entry->bytes = pool_bytes(host);
    host = through_registered_blocks(host, &entry->blocks);
    entry->host = host;
    {
      std::lock_guard lock(mu_);
      ++counters_.misses;
      if (entry->bytes > budget_bytes_) {
        ++counters_.too_large;
      } else if (!entries_.contains(entry->identity)) {
        lru_.push_front(entry);
        entries_.emplace(entry->identity, lru_.begin());
        cached_bytes_ += entry->bytes;
        aliases_[key] = alias;
        evict_until(0, &graveyard);
      } else {
        aliases_[key] = alias;  // another alias loaded the same files meanwhile: keep its entry
      }
      in_flight_.erase(key);
    }
    promise.set_value(host);
    return host;
  } catch (...) {
    {
      std::lock_guard lock(mu_);
      in_flight_.erase(key);
    }
    promise.set_exception(std::current_exception());
    throw;
  }
}

void ModelCache::touch(const EntryPtr& entry) {
  auto e = entries_.find(entry->identity);
  if (e != entries_.end()) lru_.splice(lru_.begin(), lru_, e->second);
}

void ModelCache::erase_entry(std::string identity, std::vector<EntryPtr>* graveyard) {
  auto e = entries_.find(identity);
  if (e == entries_.end()) return;
  const EntryPtr entry = *e->second;
  lru_.erase(e->second);
  entries_.erase(e);
  cached_bytes_ -= entry->bytes;
  std::erase_if(aliases_, [&](const auto& a) { return a.second->identity == identity; });
  std::erase_if(evicted_, [](const auto& b) { return b.first.expired(); });
  std::unordered_set<const Block*> seen;
  for (const Tensor& t : entry->host) {
    if (t.block() && seen.insert(t.block().get()).second) evicted_.emplace_back(t.block(), t.block()->capacity());
  }
  graveyard->push_back(entry);
}

void ModelCache::evict_until(std::uint64_t room, std::vector<EntryPtr>* graveyard) {
  while (!lru_.empty() && cached_bytes_ + room > budget_bytes_) {
    const std::string identity = lru_.back()->identity;
    log::debug("model cache: evicting an entry of {} bytes", lru_.back()->bytes);
    erase_entry(identity, graveyard);
    ++counters_.evictions;
  }
}

bool ModelCache::contains(const std::vector<std::string>& paths) const {
  std::shared_ptr<const Alias> alias;
  {
    std::lock_guard lock(mu_);
    auto a = aliases_.find(request_key(paths, loader_->options().resolve));
    if (a == aliases_.end()) return false;
    alias = a->second;
  }
  return unchanged(*alias);
}

bool ModelCache::evict(const std::vector<std::string>& paths) {
  std::vector<EntryPtr> graveyard;
  std::lock_guard lock(mu_);
  auto a = aliases_.find(request_key(paths, loader_->options().resolve));
  if (a == aliases_.end()) return false;
  erase_entry(a->second->identity, &graveyard);
  // graveyard is declared before the lock, so its entries die after it is released.
  return true;
}

void ModelCache::clear() {
  std::vector<EntryPtr> graveyard;
  std::lock_guard lock(mu_);
  while (!lru_.empty()) erase_entry(lru_.front()->identity, &graveyard);
}

void ModelCache::set_budget(std::uint64_t budget_bytes) {
  std::vector<EntryPtr> graveyard;
  std::lock_guard lock(mu_);
  budget_bytes_ = budget_bytes;
  evict_until(0, &graveyard);
}

ModelCacheStats ModelCache::stats() const {
  std::lock_guard lock(mu_);
  ModelCacheStats s = counters_;
  s.entries = lru_.size();
  s.cached_bytes = cached_bytes_;
  s.budget_bytes = budget_bytes_;
  for (const auto& [block, bytes] : evicted_) {
    if (!block.expired()) s.evicted_live_bytes += bytes;
  }
  return s;
}

}  // namespace pinload
