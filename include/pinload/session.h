// pinload/session.h: what a process shares between its loads.
//
// Note [Sessions]
// A device (a CUDA context), its pinned pool and its staging pool are costly
// to make (pinning memory takes seconds) and worth sharing: every load to
// "cuda:0" in a process should read into one pinned pool, and every
// streaming load reuse one staging pool. A Session owns them, made on first
// use and kept while it lives, and makes Loaders that use them:
//   - device(spec): the device a spec names (parse_device_spec), opened once;
//     nullptr for "cpu";
//   - pool(spec, capacity): the pool loads to `spec` share, of that budget
//     (0: none): locked host memory for "cpu", the device's pinned memory
//     otherwise;
//   - loader(spec, options): a Loader on the session's device, the pool of
//     options.pool_bytes on the NUMA node the options place it on (numa.h),
//     and for a streaming load the shared staging pool of its
//     staging_bytes;
//   - open(paths) and start(request): the verbs of a load. A request's kind
//     says what is loaded and how it is handed out (Note [Requests] in
//     request.h): whole, streamed, prefetched for a later request to adopt,
//     a batch of files, a rank's shard, or through the session's model cache.
//     start(spec, options, paths, hand_out) is the whole or streamed kind,
//     returning the loader's own handle.
// A session's devices close when it is destroyed: its loads' device tensors
// and pinned blocks go first. Session::process() is the process's session,
// never destroyed (tensors and device buffers may outlive every caller): the Python bindings and the
// pinload command load through it, and a C++ program may too, so that its
// loads and the bindings' share pools. Across processes, the node store
// (store.h) shares files' pages.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "pinload/checkpoint.h"
#include "pinload/device.h"
#include "pinload/env.h"
#include "pinload/loader.h"
#include "pinload/pool.h"
#include "pinload/request.h"

namespace pinload {

class Session {
 public:
  // Devices and pools through `env` (null: default_env()); *env must outlive
  // the session.
  explicit Session(Env* env = nullptr);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // The process's session: made on first use, never destroyed.
  static Session& process();

  Env* env() const noexcept { return env_; }

  // The device `spec` names, opened on first use and kept; nullptr for the
  // host ("cpu"). Throws InvalidArgumentError for a malformed spec,
  // DeviceError as open_device.
  Device* device(std::string_view spec);

  // The pool shared by the loads to `spec` with a budget of `capacity_bytes`
  // (0: no budget), on the NUMA node default options place `spec`'s loads on
  // (numa.h; none on a one-node machine).
  std::shared_ptr<Pool> pool(std::string_view spec, std::uint64_t capacity_bytes = 0);

  // The staging pool shared by the streaming loads to device `spec` with a
  // budget of `staging_bytes` (make_staging_pool). Throws
  // InvalidArgumentError for the host.
  std::shared_ptr<Pool> staging_pool(std::string_view spec, std::uint64_t staging_bytes);

  // A Loader for loads to `spec` with `options` (options.target.device is set
  // to the session's device): the session's pool of options.pool_bytes on the
  // options' NUMA node and, for a streaming device load, the staging pool
  // shared by loads to that device with its staging_bytes. Reads through
  // `env` (null: the session's). Throws as Loader's constructor.
  Loader loader(std::string_view spec, LoadOptions options, Env* env = nullptr);

  // The verbs: resolve paths into a checkpoint (headers read and checked),
  // and start a load of `paths` on a thread of its own.
  Checkpoint open(const std::vector<std::string>& paths, const ResolveOptions& options = {}) const;
  LoadHandle start(std::string_view spec, LoadOptions options, std::vector<std::string> paths,
                   HandOut hand_out = HandOut::kWhole);
  // Starts `request` (Note [Requests]) and returns at once: a kWhole or
  // kStream request of a device and paths that a kPrefetch request started
  // adopts what it read. Throws InvalidArgumentError for a request without
  // paths or a kShard request to a device, and what loader() throws.
  RequestHandle start(Request request);

 private:
  struct State;
  std::shared_ptr<Pool> shared_pool(Device* device, std::uint64_t capacity_bytes, int numa_node);
  std::shared_ptr<Pool> shared_staging_pool(const LoadOptions& options, int numa_node);
  std::shared_ptr<class ModelCache> model_cache(const Request& request);
  Env* env_;
  std::unique_ptr<State> state_;
};

}  // namespace pinload
