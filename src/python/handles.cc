#include "handles.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"
#include "dlpack_export.h"
#include "options.h"
#include "pinload/copy_engine.h"
#include "pinload/device.h"
#include "pinload/dtype.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "pinload/model_cache.h"
#include "pinload/prefetch.h"
#include "pinload/state_dict.h"
#include "registry.h"

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
  if (with_copies) d["bytes_copied"] = p.bytes_copied;
  return d;
}

class PyLoadHandle {
 public:
  PyLoadHandle(LoadHandle handle, Placement placement)
      : handle_(std::make_unique<LoadHandle>(std::move(handle))), placement_(std::move(placement)) {}
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
    const auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::microseconds(100);
    while (!handle_->done()) {
      auto sleep = pause;
      if (timeout) {
        const auto left = std::chrono::duration<double>(*timeout) - (std::chrono::steady_clock::now() - start);
        if (left <= std::chrono::duration<double>::zero()) return false;
        sleep = std::min(sleep, std::chrono::duration_cast<std::chrono::microseconds>(left) +
                                    std::chrono::microseconds(1));
      }
      std::this_thread::sleep_for(sleep);
      pause = std::min(pause * 2, std::chrono::microseconds(5000));
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
  std::unique_ptr<LoadHandle> handle_;
  Placement placement_;
  LoadProgress last_;
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
  LoadHandle adopt() {
    last_ = prefetch_->progress();
    std::unique_ptr<Prefetch> p = std::move(prefetch_);
    return loader_.load_async(std::move(*p));
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

// The loader of a load or prefetch with `options`, on the device's shared pool.
Loader make_loader(const std::vector<std::string>& paths, const std::string& device_spec, const PyLoadOptions& options,
                   Placement* placement) {
  if (paths.empty()) throw InvalidArgumentError("paths: no path given");
  Device* device = device_for(device_spec, placement);
  return Loader(options.for_device(device), pool_for(device_spec));
}

std::unique_ptr<PyLoadHandle> load_async(const std::vector<std::string>& paths, const std::string& device_spec,
                                         const PyLoadOptions& options, PyPrefetch* prefetch) {
  Placement placement;
  LoadHandle handle = [&] {
    py::gil_scoped_release release;
    Loader loader = make_loader(paths, device_spec, options, &placement);
    // The prefetch's own loader, so that its blocks and budget are the ones adopted.
    if (prefetch != nullptr && prefetch->matches(paths, placement)) return prefetch->adopt();
    return loader.load_async(paths);  // the load's thread holds what it needs
  }();
  return std::make_unique<PyLoadHandle>(std::move(handle), std::move(placement));
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
  py::gil_scoped_release release;
  Loader loader = make_loader(paths, device_spec, options, &placement);
  Prefetch p = prefetch(loader, paths);
  return std::make_unique<PyPrefetch>(std::move(p), std::move(loader), std::move(placement), paths);
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

  m.def("load_async", &load_async, py::arg("paths"), py::arg("device") = "cpu", py::arg("options") = PyLoadOptions{},
        py::arg("prefetch") = nullptr,
        "Starts loading `paths` (bytes: files, indexes, folders) to `device` ('cpu', 'sim', 'cuda', 'cuda:N') "
        "on the device's shared pool; returns a LoadHandle at once. A `prefetch` of the same paths and device "
        "is adopted: what it read is not read again (its own options then apply).");
  m.def("prefetch", &start_prefetch, py::arg("paths"), py::arg("device") = "cpu", py::arg("options") = PyLoadOptions{},
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

}

}  // namespace pinload::python
