// pinload/model_cache.h: recently used checkpoints kept in the pinned pool.
//
// A service that switches between models (FLUX, then SDXL, then FLUX again)
// keeps the host copies of the last few in pool memory, under a budget, so
// that switching back reads nothing from storage and costs only the
// host-to-device copy (get_on, via upload() in loader.h).
//
// Note [Cache keys]
// An entry is keyed by the identity of the files the request resolved to:
// for each file in load order its path, name prefix, size, mtime_ns, inode and
// device (FileStat, env.h). The paths a caller passes are an alias of that key.
// A get() under a known alias re-stats the alias's files (weights and index
// files: open + statx + close through the Env, no pread); if any differs, the
// entry is stale: it is dropped (`invalidations`) and the get is a miss. A get
// under a new alias resolves the paths (reading headers, not data) and is a
// hit when an entry of the same identity exists. What is not detected: a new
// file appearing in a folder that would change what the folder resolves to
// (a new component, a new variant); call evict() or clear() after such a change.
//
// Note [Cache budget]
// An entry costs the pool bytes of its blocks (their size classes, as
// PoolStats::in_use_bytes counts them). A miss first evicts least recently
// used entries until the new model's data fits next to the rest (so that the
// pool can hand the evicted blocks to the new load), then loads, inserts and
// evicts again until cached_bytes <= budget_bytes. A model larger than the
// whole budget is loaded and returned but not cached (`too_large`), and evicts
// nothing. Evicting drops the cache's reference only: the blocks go back to the
// pool when every tensor over them is gone, so pool memory in use is
// cached_bytes plus what callers still hold (`evicted_live_bytes` counts the
// evicted part). get_on() returns device-only tensors for that reason: they
// keep no host block alive.
//
// Note [Concurrent gets]
// The lock is held only to look up and update the maps, never across file
// access, loads, copies or block releases. Gets of one alias that is being
// loaded wait for that load and share its result (`waits`), or its error:
// the model is read once. Gets of two different aliases of the same files that
// miss at the same moment both load; the second insert keeps the first entry.
//
// Thread safety: every method may be called concurrently.
#pragma once

#include <cstdint>
#include <future>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pinload/copy_engine.h"
#include "pinload/device.h"
#include "pinload/loader.h"
#include "pinload/state_dict.h"

namespace pinload {

struct ModelCacheStats {
  std::uint64_t hits = 0;           // gets served from the cache: no data read
  std::uint64_t misses = 0;         // gets that loaded from storage
  std::uint64_t waits = 0;          // gets that shared another get's load of the same paths
  std::uint64_t evictions = 0;      // entries dropped to stay within the budget
  std::uint64_t invalidations = 0;  // entries dropped because a file changed
  std::uint64_t too_large = 0;      // loads returned but not cached (larger than the budget)
  std::uint64_t entries = 0;
  std::uint64_t cached_bytes = 0;  // pool bytes of the cached entries
  std::uint64_t budget_bytes = 0;
  // Pool bytes of entries the cache dropped (evicted, invalidated, cleared)
  // that callers still hold: they return to the pool with the callers' tensors.
  std::uint64_t evicted_live_bytes = 0;
};

class ModelCache {
 public:
  // Loads through `loader` (null: a Loader with default options on a pool of
  // its own), which must load to host memory only (no device target): throws
  // InvalidArgumentError otherwise. The cache holds at most `budget_bytes` of pool
  // memory (Note [Cache budget]); 0 caches nothing.
  explicit ModelCache(std::uint64_t budget_bytes, std::shared_ptr<const Loader> loader = nullptr);
  ~ModelCache();
  ModelCache(const ModelCache&) = delete;
  ModelCache& operator=(const ModelCache&) = delete;

  // The host state dict of `paths` (as Loader::load takes them): from the
  // cache on a hit (no data read), else loaded and cached. Throws what the
  // load throws; a failed load caches nothing.
  StateDict get(const std::vector<std::string>& paths);
  // The same model on `device`: tensors on the device only, in device memory
  // of their own (device copies are not cached: drop the previous model's
  // before switching). A hit costs the host-to-device copy alone (upload());
  // a miss reads and copies in one pipelined load (kCached, Note [Device
  // loads] in loader.h) and caches the host copy. Throws DeviceError and
  // OutOfMemoryError besides.
  StateDict get_on(Device& device, const std::vector<std::string>& paths, const CopyOptions& copy = {});

  // Whether get(paths) would be a hit now: a known alias whose files are
  // unchanged (stats them, reads nothing, changes nothing).
  bool contains(const std::vector<std::string>& paths) const;
  // Drops the entry that `paths` (an alias used before) names; false if none.
  // Callers' tensors stay valid.
  bool evict(const std::vector<std::string>& paths);
  // Drops every entry.
  void clear();
  // Changes the budget, evicting least recently used entries to meet it.
  void set_budget(std::uint64_t budget_bytes);

  ModelCacheStats stats() const;
  const Loader& loader() const noexcept { return *loader_; }

  struct Entry;

 private:
  struct Alias;
  using EntryPtr = std::shared_ptr<const Entry>;

  StateDict lookup_or_load(const std::vector<std::string>& paths, Device* device, const CopyOptions& copy,
                           StateDict* on_device);
  bool unchanged(const Alias& alias) const;
  // The following need mu_ held; dropped entries go to *graveyard, to be
  // destroyed after the lock is released.
  void touch(const EntryPtr& entry);
  // `identity` by value: the caller's string may live in an alias this erases.
  void erase_entry(std::string identity, std::vector<EntryPtr>* graveyard);
  void evict_until(std::uint64_t room, std::vector<EntryPtr>* graveyard);

  std::shared_ptr<const Loader> loader_;
  mutable std::mutex mu_;
  std::uint64_t budget_bytes_;
  std::uint64_t cached_bytes_ = 0;
  ModelCacheStats counters_;
  std::list<EntryPtr> lru_;                                                   // most recently used first
  std::unordered_map<std::string, std::list<EntryPtr>::iterator> entries_;    // identity -> lru_ node
  std::unordered_map<std::string, std::shared_ptr<const Alias>> aliases_;     // request -> alias
  std::unordered_map<std::string, std::shared_future<StateDict>> in_flight_;  // request -> its load
  std::vector<std::pair<std::weak_ptr<Block>, std::uint64_t>> evicted_;       // blocks callers may hold
};

}  // namespace pinload
