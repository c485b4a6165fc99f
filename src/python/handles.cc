#include "handles.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"
#include "dlpack_export.h"
#include "errors.h"
#include "options.h"
#include "pinload/batch.h"
#include "pinload/checkpoint.h"
#include "pinload/copy_engine.h"
#include "pinload/device.h"
#include "pinload/dtype.h"
#include "pinload/env.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "pinload/model_cache.h"
#include "pinload/prefetch.h"
#include "pinload/safetensors.h"
#include "pinload/shard.h"
#include "pinload/state_dict.h"
#include "registry.h"
#include "pinload/session.h"

namespace pinload::python {
namespace {

class PyStateDict {
 public:
  PyStateDict(StateDict sd, Placement placement) : sd_(std::move(sd)), placement_(std::move(placement)) {}

  std::size_t size() const { return sd_.size(); }
  bool contains(const std::string& name) const { return sd_.find(name) != nullptr; }
  py::list names() const {
    py::list out;
    for (const Tensor& t : sd_) out.append(decode(t.name()));
    return out;
  }
  py::dict metadata() const {
    py::dict out;
    for (const auto& [k, v] : sd_.metadata()) out[decode(k)] = decode(v);
    return out;
  }
  py::tuple entry(const Tensor& t) const {
    return py::make_tuple(decode(t.name()), py::str(std::string(dtype_name(t.dtype()))), shape_list(t.shape()),
                          export_tensor(t, placement_));
  }
  // (name, dtype, shape, TensorExport or None) of one tensor.
  py::tuple export_one(const std::string& name) const { return entry(sd_.at(name)); }
  // The same for every tensor, in load order.
  py::list export_all() const {
    py::list out;
    for (const Tensor& t : sd_) out.append(entry(t));
    return out;
  }
  // (name, dtype, shape) of every tensor, in load order; exports nothing.
  py::list infos() const {
    py::list out;
    for (const Tensor& t : sd_) {
      out.append(py::make_tuple(decode(t.name()), py::str(std::string(dtype_name(t.dtype()))), shape_list(t.shape())));
    }
    return out;
  }
  std::uint64_t total_bytes() const { return sd_.total_bytes(); }
  const Placement& placement() const { return placement_; }

 private:
  StateDict sd_;
  Placement placement_;
};

// A load's or a prefetch's counters for Python; a prefetch copies nothing.
py::dict progress_dict(const LoadProgress& p, bool with_copies) {
  py::dict d;
  d["bytes_done"] = p.bytes_done;
  d["bytes_total"] = p.bytes_total;
  d["files_direct"] = p.files_direct;
  d["files_buffered"] = p.files_buffered;
  d["files_mapped"] = p.files_mapped;
  d["files_zero_copy"] = p.files_zero_copy;
  d["files_store"] = p.files_store;
  if (with_copies) d["bytes_copied"] = p.bytes_copied;
  return d;
}

class PyLoadHandle {
 public:
  // `env`: the Env the load reads through, kept until the load is gone (a
  // safe_open's HeldFileEnv); null for the default one.
  PyLoadHandle(LoadHandle handle, Placement placement, std::shared_ptr<Env> env = nullptr)
      : env_(std::move(env)), handle_(std::make_unique<LoadHandle>(std::move(handle))),
        placement_(std::move(placement)) {}
  PyLoadHandle(const PyLoadHandle&) = delete;
  PyLoadHandle& operator=(const PyLoadHandle&) = delete;
  // Dropping a load in flight cancels it and joins its thread (which never
  // needs the GIL); let other Python threads run meanwhile.
  ~PyLoadHandle() {
    if (!handle_) return;
    handle_->cancel();
    reset_without_gil(handle_);
  }

  bool done() const { return !handle_ || handle_->done(); }
  void cancel() {
    if (handle_) handle_->cancel();
  }
  py::dict progress() const { return progress_dict(handle_ ? handle_->progress() : last_, true); }
  // Waits up to `timeout` seconds (None: until done) with the GIL released;
  // true once the load has finished.
  bool wait(std::optional<double> timeout) {
    if (!handle_) return true;
    py::gil_scoped_release release;
    // Woken as the load ends: a small load's call is not rounded up to a
    // polling interval.
    if (timeout) {
      return handle_->wait_done(
          std::chrono::microseconds(static_cast<std::int64_t>(std::clamp(*timeout, 0.0, 86400.0) * 1e6)));
    }
    while (!handle_->wait_done(std::chrono::hours(1))) {
    }
    return true;
  }
  // Tensors ready since the last call (Note [Ready tensors] in loader.h), as
  // a state dict; None once every tensor has been handed out. Waits up to
  // `timeout` seconds (None: until some are ready) and returns an empty state
  // dict when the time is up.
  std::optional<PyStateDict> next_ready(std::optional<double> timeout) {
    if (!handle_) throw InvalidArgumentError("result() was already taken from this load");
    std::vector<Tensor> ready;
    {
      py::gil_scoped_release release;
      if (timeout) {
        const auto ms = std::chrono::milliseconds(static_cast<std::int64_t>(std::max(*timeout, 0.0) * 1000));
        if (!handle_->wait_ready(ms)) return PyStateDict(StateDict(), placement_);
      }
      ready = handle_->next_ready();
    }
    if (ready.empty()) return std::nullopt;
    return PyStateDict(StateDict(std::move(ready)), placement_);
  }
  // The loaded state dict, or the load's error. Call once.
  PyStateDict result() {
    if (!handle_) throw InvalidArgumentError("result() was already taken from this load");
    last_ = handle_->progress();
    std::unique_ptr<LoadHandle> handle = std::move(handle_);
    StateDict sd;
    {
      py::gil_scoped_release release;
      try {
        sd = handle->wait();
      } catch (...) {
        handle.reset();
        throw;
      }
      last_ = handle->progress();
      handle.reset();
    }
    return PyStateDict(std::move(sd), placement_);
  }
  const Placement& placement() const { return placement_; }

 private:
  std::shared_ptr<Env> env_;  // destroyed after handle_
  std::unique_ptr<LoadHandle> handle_;
  Placement placement_;
  LoadProgress last_;
};

// One file held open from its header read to its load (Note [Holding a file]
// in pinload/env.h): what safe_open reads through.
class PyHeldFile {
 public:
  explicit PyHeldFile(const std::string& path) {
    py::gil_scoped_release release;
    env_ = std::make_shared<HeldFileEnv>(default_env(), path);
    file_ = read_checkpoint_file(env_.get(), path);
  }
  const std::shared_ptr<HeldFileEnv>& env() const { return env_; }
  const CheckpointFile& file() const { return file_; }

 private:
  std::shared_ptr<HeldFileEnv> env_;
  CheckpointFile file_;
};

// A prefetch in flight (pinload.prefetch). Dropping it stops it and frees what it read.
class PyPrefetch {
 public:
  PyPrefetch(Prefetch prefetch, Loader loader, Placement placement, std::vector<std::string> paths)
      : prefetch_(std::make_unique<Prefetch>(std::move(prefetch))), loader_(std::move(loader)),
        placement_(std::move(placement)), paths_(std::move(paths)) {}
  PyPrefetch(const PyPrefetch&) = delete;
  PyPrefetch& operator=(const PyPrefetch&) = delete;
  // Stopping joins reader threads that never need the GIL.
  ~PyPrefetch() { reset_without_gil(prefetch_); }

  bool done() const { return !prefetch_ || prefetch_->done(); }
  bool adopted() const { return !prefetch_; }
  void cancel() {
    if (!prefetch_) return;
    py::gil_scoped_release release;
    prefetch_->cancel();
  }
  py::dict progress() const { return progress_dict(prefetch_ ? prefetch_->progress() : last_, false); }
  // Waits up to `timeout` seconds (None: until done) without the GIL.
  bool wait(std::optional<double> timeout) {
    if (!prefetch_) return true;
    py::gil_scoped_release release;
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                           std::chrono::duration<double>(timeout.value_or(0)));
    while (!prefetch_->done()) {
      if (timeout && std::chrono::steady_clock::now() >= end) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }
  // Whether a load of `paths` to `placement` can adopt this prefetch.
  bool matches(const std::vector<std::string>& paths, const Placement& placement) const {
    return prefetch_ && paths == paths_ && placement.spec == placement_.spec;
  }
  // Starts the load that adopts it; the prefetch is consumed.
  LoadHandle adopt(HandOut hand_out) {
    last_ = prefetch_->progress();
    std::unique_ptr<Prefetch> p = std::move(prefetch_);
    return loader_.load_async(std::move(*p), hand_out);
  }
  const Placement& placement() const { return placement_; }
  const std::vector<std::string>& paths() const { return paths_; }

 private:
  std::unique_ptr<Prefetch> prefetch_;
  Loader loader_;
  Placement placement_;
  std::vector<std::string> paths_;
  LoadProgress last_;
};

// Note [Device loads from Python]
// A fresh worker's first device load should make new host memory only for
// its staging, not a pinned copy of the model (pinning runs at a few GB/s:
// it is what fresh memory costs on a GPU machine). So a load to a device
// streams by default (DeviceMode::kStreaming) through a staging pool shared by
// every streaming load to that device with that budget (staging_pool_for):
// the first load pins DEFAULT_STAGING_BYTES (or staging_bytes), later loads
// reuse those blocks. A prefetch, which reads the whole model ahead of its
// load, still reads into the device's pinned pool unless given staging_bytes;
// the load that adopts it uses the prefetch's loader.

// The loader of a load or prefetch with `options`, on the device's shared pool
// (of the options' pool_bytes budget), reading through `env` (null: the
// default Env). A load to a device streams through the device's shared
// staging pool (Note [Device loads from Python]); a prefetch reads into pool
// blocks (the whole model ahead of its load) unless given staging_bytes.
Loader make_loader(const std::vector<std::string>& paths, const std::string& device_spec, const PyLoadOptions& options,
                   Placement* placement, Env* env = nullptr, CachedRead cached_read = CachedRead::kAuto,
                   bool prefetching = false) {
  if (paths.empty()) throw InvalidArgumentError("paths: no path given");
  Device* device = device_for(device_spec, placement);
  LoadOptions load = options.for_device(device, !prefetching);
  load.cached_read = cached_read;
  load.pool_bytes = options.pool_bytes.value_or(0);  // the session's pool of that budget
  return Session::process().loader(device_spec, std::move(load), env);
}

CachedRead cached_read_from_python(const std::string& text) {
  const std::optional<CachedRead> c = parse_cached_read(text);
  if (!c) throw InvalidArgumentError("cached_read must be 'auto', 'map' or 'pread', not '" + text + "'");
  return *c;
}

// The LoadOptions class bound by register_options.
py::object load_options_type() { return py::type::of<PyLoadOptions>(); }

// `options` (a LoadOptions), or LoadOptions(**keywords) when it is None;
// TypeError for both at once.
PyLoadOptions options_or_keywords(const py::object& type, const py::object& options, const py::kwargs& keywords) {
  if (options.is_none()) return type(**keywords).cast<PyLoadOptions>();
  if (keywords.size() != 0) throw py::type_error("pass load options as options= or as keywords, not both");
  return options.cast<PyLoadOptions>();
}

std::unique_ptr<PyLoadHandle> load_async(const std::vector<std::string>& paths, const std::string& device_spec,
                                         const PyLoadOptions& options, PyPrefetch* prefetch,
                                         const std::string& cached_read, bool stream, const PyHeldFile* held) {
  Placement placement;
  const HandOut hand_out = stream ? HandOut::kStream : HandOut::kWhole;
  const CachedRead cached = cached_read_from_python(cached_read);
  std::shared_ptr<Env> env;
  LoadHandle handle = [&] {
    py::gil_scoped_release release;
    if (held != nullptr) {
      if (paths.size() != 1 || paths[0] != held->env()->path()) {
        throw InvalidArgumentError("held: a HeldFile of other paths");
      }
      env = held->env();
    }
    Loader loader = make_loader(paths, device_spec, options, &placement, env.get(), cached);
    // The prefetch's own loader, so that its blocks and budget are the ones
    // adopted (a conversion load adopts none: its options differ).
    if (prefetch != nullptr && held == nullptr && !options.load.dtype.active() && prefetch->matches(paths, placement)) {
      return prefetch->adopt(hand_out);
    }
    // A held file: its header is read again through `env`, from the same file.
    return loader.load_async(paths, hand_out);  // the load's thread holds what it needs
  }();
  return std::make_unique<PyLoadHandle>(std::move(handle), std::move(placement), std::move(env));
}

// A load on the calling thread with the GIL released: no thread of its own
// and no hand-off, for a small file's per-call cost (pinload.torch.load_file
// below its size threshold). Not interruptible: only for loads that end soon.
PyStateDict load_now(const std::vector<std::string>& paths, const std::string& device_spec,
                     const PyLoadOptions& options, const std::string& cached_read) {
  Placement placement;
  const CachedRead cached = cached_read_from_python(cached_read);
  StateDict sd;
  {
    py::gil_scoped_release release;
    const Loader loader = make_loader(paths, device_spec, options, &placement, nullptr, cached);
    sd = loader.load(paths);
  }
  return PyStateDict(std::move(sd), std::move(placement));
}

// load_batch (pinload/batch.h) on a thread of its own, so that Ctrl-C (any
// pending signal) cancels it: one entry per path, a StateDict or the path's
// error as an exception instance (not raised).
py::list load_batch_py(const std::vector<std::string>& paths, const std::string& device_spec,
                       const PyLoadOptions& options, const std::string& cached_read) {
  if (options.load.dtype.active()) throw InvalidArgumentError("load_batch: no dtype conversion");
  Placement placement;
  const CachedRead cached = cached_read_from_python(cached_read);
  std::optional<Loader> loader;
  {
    py::gil_scoped_release release;
    loader.emplace(make_loader(paths, device_spec, options, &placement, nullptr, cached));
  }
  std::promise<std::vector<BatchItem>> promise;
  std::future<std::vector<BatchItem>> done = promise.get_future();
  std::jthread worker([&](std::stop_token stop) {
    try {
      promise.set_value(load_batch(*loader, paths, stop));
    } catch (...) {
      promise.set_exception(std::current_exception());
    }
  });
  for (;;) {
    {
      py::gil_scoped_release release;
      if (done.wait_for(std::chrono::milliseconds(50)) == std::future_status::ready) break;
    }
    if (PyErr_CheckSignals() != 0) {
      py::gil_scoped_release release;
      worker.request_stop();
      worker.join();
      throw py::error_already_set();
    }
  }
  std::vector<BatchItem> items;
  {
    py::gil_scoped_release release;
    worker.join();
    items = done.get();  // CancelledError only
  }
  py::list out;
  for (BatchItem& item : items) {
    if (item.ok()) {
      out.append(py::cast(PyStateDict(std::move(item.state), placement)));
      continue;
    }
    try {
      std::rethrow_exception(item.error);
    } catch (const Error& e) {
      out.append(error_object(e));
    } catch (const std::exception& e) {
      out.append(error_object(IoError(e.what(), ErrorContext{item.path})));
    }
  }
  return out;
}

// A ModelCache (model_cache.h) whose host copies live in the shared pool of
// `pool_device` ("cpu": host memory; "cuda:N": that GPU's pinned memory, so
// that copies to it go at full speed).
class PyModelCache {
 public:
  PyModelCache(const py::object& budget_bytes, const std::string& pool_device, const PyLoadOptions& options)
      : copy_(options.load.target.copy) {
    const std::uint64_t budget = size_from_python(budget_bytes, "budget_bytes");
    if (options.staging_bytes) {
      throw InvalidArgumentError("staging_bytes: a ModelCache keeps host copies; it has no streaming mode");
    }
    py::gil_scoped_release release;
    cache_ = std::make_unique<ModelCache>(budget, std::make_shared<const Loader>(options.load, pool_for(pool_device)));
  }

  // The model on `device_spec` ("cpu": the cached host copy itself).
  PyStateDict get(const std::vector<std::string>& paths, const std::string& device_spec) {
    if (paths.empty()) throw InvalidArgumentError("paths: no path given");
    Placement placement;
    StateDict sd;
    {
      py::gil_scoped_release release;
      Device* device = device_for(device_spec, &placement);
      sd = device ? cache_->get_on(*device, paths, copy_) : cache_->get(paths);
    }
    return PyStateDict(std::move(sd), std::move(placement));
  }
  bool contains(const std::vector<std::string>& paths) const {
    py::gil_scoped_release release;
    return cache_->contains(paths);
  }
  bool evict(const std::vector<std::string>& paths) {
    py::gil_scoped_release release;
    return cache_->evict(paths);
  }
  void clear() {
    py::gil_scoped_release release;
    cache_->clear();
  }
  void set_budget(const py::object& budget_bytes) {
    const std::uint64_t budget = size_from_python(budget_bytes, "budget_bytes");
    py::gil_scoped_release release;
    cache_->set_budget(budget);
  }
  py::dict stats() const {
    const ModelCacheStats s = cache_->stats();
    py::dict d;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["waits"] = s.waits;
    d["evictions"] = s.evictions;
    d["invalidations"] = s.invalidations;
    d["too_large"] = s.too_large;
    d["entries"] = s.entries;
    d["cached_bytes"] = s.cached_bytes;
    d["budget_bytes"] = s.budget_bytes;
    d["evicted_live_bytes"] = s.evicted_live_bytes;
    return d;
  }

  // Dropping the cache releases its blocks: let other threads run meanwhile.
  ~PyModelCache() {
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      cache_.reset();
    }
  }

 private:
  CopyOptions copy_;  // of get() to a device
  std::unique_ptr<ModelCache> cache_;
};
std::unique_ptr<PyPrefetch> start_prefetch(const std::vector<std::string>& paths, const std::string& device_spec,
                                           const PyLoadOptions& options) {
  Placement placement;
  // A prefetch reads as stored: a load with a dtype conversion adopts none.
  PyLoadOptions reader = options;
  reader.load.dtype = {};
  py::gil_scoped_release release;
  Loader loader = make_loader(paths, device_spec, reader, &placement, nullptr, CachedRead::kAuto, true);
  Prefetch p = prefetch(loader, paths);
  return std::make_unique<PyPrefetch>(std::move(p), std::move(loader), std::move(placement), paths);
}

// Rank-aware loading (pinload/shard.h), driven by python/pinload/distributed.py.
class PyShardLoad {
 public:
  explicit PyShardLoad(std::unique_ptr<ShardLoad> load) : load_(std::move(load)) {}
  ~PyShardLoad() { reset_without_gil(load_); }
  // The next batch's StateDict, or None after the last.
  std::optional<PyStateDict> next() {
    StateDict sd;
    {
      py::gil_scoped_release release;
      sd = load_->next();
    }
    if (sd.empty()) return std::nullopt;
    return PyStateDict(std::move(sd), Placement{});
  }
  // (name, dtype, shape, dim, begin, end, owner, window, read, batch) of every tensor, in load order.
  py::list tensors() const {
    py::list out;
    for (const ShardTensor& t : load_->plan().tensors) {
      out.append(py::make_tuple(decode(t.name), py::str(std::string(dtype_name(t.dtype))), shape_list(t.shape), t.dim,
                                t.begin, t.end, t.owner, t.window, t.read, t.batch));
    }
    return out;
  }
  std::uint64_t planned_bytes() const { return load_->plan().read_bytes; }
  std::uint64_t bytes_read() const { return load_->bytes_read(); }

 private:
  std::unique_ptr<ShardLoad> load_;
};

std::unique_ptr<PyShardLoad> start_shard_load(const std::vector<std::string>& paths, int rank, int world_size,
                                              const std::string& mode, const std::vector<std::pair<std::string, int>>& rules,
                                              std::uint64_t window_bytes, unsigned threads, std::size_t block_size,
                                              const std::string& direct, std::uint64_t max_gap, std::uint64_t batch_bytes) {
  if (mode != "slice" && mode != "share") {
    throw InvalidArgumentError("mode must be 'slice' or 'share', not '" + mode + "'");
  }
  const std::optional<DirectIo> direct_io = parse_direct_io(direct);
  if (!direct_io) throw InvalidArgumentError("direct must be 'auto', 'on' or 'off', not '" + direct + "'");
  ShardSpec spec{rank, world_size, mode == "slice" ? ShardMode::kSlice : ShardMode::kShare, {}, window_bytes};
  for (const auto& [pattern, dim] : rules) spec.rules.push_back(ShardRule{pattern, dim});
  ShardLoadOptions options{threads, block_size, *direct_io != DirectIo::kOff, max_gap, batch_bytes};
  std::shared_ptr<Pool> pool = pool_for("cpu");
  py::gil_scoped_release release;
  return std::make_unique<PyShardLoad>(std::make_unique<ShardLoad>(paths, spec, options, std::move(pool)));
}

py::dict header_dict(const CheckpointFile& file) {
  py::list tensors;
  for (const TensorInfo& t : file.header.tensors) {
    tensors.append(py::make_tuple(decode(t.name), py::str(std::string(dtype_name(t.dtype))), shape_list(t.shape),
                                  py::int_(t.begin), py::int_(t.end)));
  }
  py::object metadata = py::none();
  if (file.header.has_metadata) {
    py::dict md;
    for (const auto& [k, v] : file.header.metadata) md[decode(k)] = decode(v);
    metadata = md;
  }
  py::dict out;
  out["path"] = decode(file.path);
  out["tensors"] = tensors;  // file order: by offset
  out["metadata"] = metadata;
  out["data_offset"] = file.header.data_offset();
  out["file_size"] = file.header.file_size;
  return out;
}

py::dict read_header(const std::string& path, const PyLoadOptions* options) {
  const RemoteOptions remote = options != nullptr ? options->load.resolve.remote : RemoteOptions{};
  CheckpointFile file;
  {
    py::gil_scoped_release release;
    file = read_checkpoint_file(default_env(), path, remote);
  }
  return header_dict(file);
}

}  // namespace

void register_handles(py::module_& m) {
  py::class_<PyStateDict>(m, "StateDict", "A loaded checkpoint: tensors in pool or device memory.")
      .def("__len__", &PyStateDict::size)
      .def("__contains__", &PyStateDict::contains, py::arg("name"))
      .def("names", &PyStateDict::names, "Tensor names in load order.")
      .def("metadata", &PyStateDict::metadata, "The files' __metadata__, merged (the first file wins a key).")
      .def("infos", &PyStateDict::infos, "(name, dtype, shape) of every tensor, in load order.")
      .def("export", &PyStateDict::export_one, py::arg("name"),
           "(name, dtype, shape, export) of one tensor: a TensorExport (DLPack), None when it has no bytes. "
           "Raises NotFoundError for an unknown name.")
      .def("export_all", &PyStateDict::export_all, "export() of every tensor, in load order.")
      .def_property_readonly("total_bytes", &PyStateDict::total_bytes)
      .def_property_readonly("device", [](const PyStateDict& s) { return s.placement().device(); },
                             "The pinload device: 'cpu', 'sim' or 'cuda:N'.")
      .def_property_readonly("torch_device", [](const PyStateDict& s) { return s.placement().torch_device(); },
                             "The torch device of exported tensors: 'cpu' or 'cuda:N'.");

  py::class_<PyLoadHandle>(m, "LoadHandle", "A load in flight. Dropping it cancels the load.")
      .def("done", &PyLoadHandle::done)
      .def("cancel", &PyLoadHandle::cancel)
      .def("progress", &PyLoadHandle::progress,
           "dict: bytes_done, bytes_total, files_direct, files_buffered, files_mapped, bytes_copied.")
      .def("wait", &PyLoadHandle::wait, py::arg("timeout") = py::none(),
           "Waits up to timeout seconds (None: until done), without the GIL; True once finished.")
      .def("result", &PyLoadHandle::result, "The StateDict, or raises the load's error. Call once.")
      .def("next_ready", &PyLoadHandle::next_ready, py::arg("timeout") = py::none(),
           "Tensors ready since the last call, as a StateDict (empty when `timeout` seconds pass first); "
           "None once every tensor has been handed out. Raises the load's error.")
      .def_property_readonly("device", [](const PyLoadHandle& h) { return h.placement().device(); });

  py::class_<PyPrefetch>(m, "Prefetch",
                         "Reads started before the load that adopts them. Dropping it stops it and frees its memory.")
      .def("done", &PyPrefetch::done, "True once the readers have finished (all read, cancelled, failed or adopted).")
      .def("cancel", &PyPrefetch::cancel,
           "Stops the readers promptly and waits for them; what was read stays for a load to adopt.")
      .def("progress", &PyPrefetch::progress, "dict: bytes_done, bytes_total, files_direct, files_buffered, files_mapped.")
      .def("wait", &PyPrefetch::wait, py::arg("timeout") = py::none(),
           "Waits up to timeout seconds (None: until done), without the GIL; True once done.")
      .def_property_readonly("adopted", &PyPrefetch::adopted, "True once a load has taken it over.")
      .def_property_readonly("device", [](const PyPrefetch& p) { return p.placement().device(); })
      .def_property_readonly("paths", [](const PyPrefetch& p) {
        py::list out;
        for (const std::string& path : p.paths()) out.append(decode(path));
        return out;
      });

  py::class_<PyHeldFile>(m, "HeldFile",
                         "One safetensors file held open from its header to its load (safe_open): a replaced path "
                         "does not change what is read.")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def("header", [](const PyHeldFile& f) { return header_dict(f.file()); }, "As read_header().");
  m.def(
      "load_async",
      [](const std::vector<std::string>& paths, const std::string& device, const py::object& options,
         PyPrefetch* prefetch, const std::string& cached_read, bool stream, const PyHeldFile* held,
         const py::kwargs& load_options) {
        return load_async(paths, device, options_or_keywords(load_options_type(), options, load_options), prefetch,
                          cached_read, stream, held);
      },
      py::arg("paths"), py::arg("device") = "cpu", py::arg("options") = py::none(), py::arg("prefetch") = nullptr,
      py::arg("cached_read") = "auto", py::arg("stream") = false, py::arg("held") = nullptr,
      "Starts loading `paths` (bytes: files, indexes, folders) to `device` ('cpu', 'sim', 'cuda', 'cuda:N') "
      "on the device's shared pool (with options.pool_bytes: the shared pool of that budget); returns a "
      "LoadHandle at once. A `prefetch` of the same paths and device is adopted: what it read is not read "
      "again (its own options then apply; a load with a dtype conversion adopts none). cached_read: how a "
      "file in the page cache is read ('auto', 'map', 'pread'). stream=True: tensors come only from "
      "next_ready() and the load keeps none of them (HandOut::kStream), so each file's block goes back to the "
      "pool once the caller has dropped its tensors; result() is then empty. `held`: a HeldFile of the one "
      "path, whose header and bytes are read. The options: `options` (a LoadOptions) or LoadOptions' "
      "keywords, not both.");
  m.def(
      "load_now",
      [](const std::vector<std::string>& paths, const std::string& device, const py::object& options,
         const std::string& cached_read, const py::kwargs& load_options) {
        return load_now(paths, device, options_or_keywords(load_options_type(), options, load_options), cached_read);
      },
      py::arg("paths"), py::arg("device") = "cpu", py::arg("options") = py::none(), py::arg("cached_read") = "auto",
      "Loads `paths` on the calling thread (GIL released) and returns the StateDict: load_async without a "
      "thread or a handle, for small files. Not interruptible.");
  m.def(
      "load_batch",
      [](const std::vector<std::string>& paths, const std::string& device, const py::object& options,
         const std::string& cached_read, const py::kwargs& load_options) {
        return load_batch_py(paths, device, options_or_keywords(load_options_type(), options, load_options),
                             cached_read);
      },
      py::arg("paths"), py::arg("device") = "cpu", py::arg("options") = py::none(), py::arg("cached_read") = "auto",
      "Loads every path (bytes) as its own state dict in one parallel sweep (pinload/batch.h); blocks, and a "
      "pending signal (Ctrl-C) cancels it. Returns one entry per path, in order: a StateDict, or the path's "
      "pinload.Error instance (not raised).");
  m.def(
      "prefetch",
      [](const std::vector<std::string>& paths, const std::string& device, const py::object& options,
         const py::kwargs& load_options) {
        return start_prefetch(paths, device, options_or_keywords(load_options_type(), options, load_options));
      },
      py::arg("paths"), py::arg("device") = "cpu", py::arg("options") = py::none(),
      "Starts reading `paths` for a later load to `device` in the background; returns a Prefetch at once.");
  py::class_<PyModelCache>(m, "ModelCache",
                           "Host copies of recently used checkpoints in a shared pinned pool, LRU under a budget "
                           "(include/pinload/model_cache.h).")
      .def(py::init<const py::object&, const std::string&, const PyLoadOptions&>(), py::arg("budget_bytes"),
           py::arg("pool_device") = "cpu", py::arg("options") = PyLoadOptions{},
           "budget_bytes: an int or a size string. `options` are the reader's; their streams and chunk_bytes "
           "are those of get() to a device.")
      .def("get", &PyModelCache::get, py::arg("paths"), py::arg("device") = "cpu",
           "The StateDict of `paths` on `device`: from the cache on a hit (no read), else loaded and cached.")
      .def("contains", &PyModelCache::contains, py::arg("paths"))
      .def("evict", &PyModelCache::evict, py::arg("paths"))
      .def("clear", &PyModelCache::clear)
      .def("set_budget", &PyModelCache::set_budget, py::arg("budget_bytes"))
      .def("stats", &PyModelCache::stats,
           "dict: hits, misses, waits, evictions, invalidations, too_large, entries, cached_bytes, budget_bytes, "
           "evicted_live_bytes.");

  py::class_<PyShardLoad>(m, "ShardLoad", "One rank's share of a checkpoint, read batch by batch (pinload/shard.h).")
      .def("next", &PyShardLoad::next, "The next batch as a StateDict, or None after the last. Raises the reads' error.")
      .def("tensors", &PyShardLoad::tensors,
           "(name, dtype, shape, dim, begin, end, owner, window, read, batch) of every tensor, in load order.")
      .def_property_readonly("planned_bytes", &PyShardLoad::planned_bytes)
      .def_property_readonly("bytes_read", &PyShardLoad::bytes_read);
  m.def("shard_load", &start_shard_load, py::arg("paths"), py::arg("rank"), py::arg("world_size"),
        py::arg("mode") = "slice", py::arg("rules") = std::vector<std::pair<std::string, int>>{},
        py::arg("window_bytes") = 0, py::arg("threads") = kDefaultThreads, py::arg("block_size") = kDefaultBlockSize,
        py::arg("direct") = "auto", py::arg("max_gap") = 0, py::arg("batch_bytes") = 0,
        "Plans and starts rank `rank`'s share of `paths` (bytes); rules are (regex, dim) pairs (dim -1: replicated).");
  m.def(
      "header_length",
      [](const py::bytes& prefix, std::uint64_t file_size, const std::string& file) {
        const std::string_view bytes(prefix);
        return parse_header_prefix(std::as_bytes(std::span(bytes.data(), bytes.size())), file_size, file);
      },
      py::arg("prefix"), py::arg("file_size"), py::arg("file"),
      "The JSON header's length N from a safetensors file's first 8 bytes (the C++ parser's "
      "parse_header_prefix and its cap): InvalidFileError naming `file` where N is 0, above the cap or "
      "past the end of a `file_size`-byte file.");
  m.def("read_header", &read_header, py::arg("path"), py::arg("options") = nullptr,
        "Reads and validates one file's header: dict with path, tensors [(name, dtype, shape, begin, end)] in "
        "offset order, metadata (dict or None), data_offset, file_size. A remote object's is read with "
        "`options`' remote settings (a LoadOptions; None: the defaults).");

}

}  // namespace pinload::python
