// pinload._core: the Python extension module behind python/pinload.
//
// It exposes loads (Loader::load_async on a module-wide pool per device),
// safetensors headers, pool statistics and pinload's errors, and hands tensor
// memory to Python as DLPack capsules, so that torch.from_dlpack() aliases
// pool or device memory without a copy and without this module linking
// libtorch. No raw address ever crosses into Python: only capsules do.
//
// Note [DLPack export]
// Each tensor goes out as a 1-D uint8 DLPack tensor over its bytes (the
// unversioned "dltensor" capsule, which every torch since 1.10 accepts);
// Python then views it as the real dtype and reshapes it (python/pinload/
// torch.py). The DLManagedTensor's manager_ctx owns a copy of the
// pinload::Tensor, which holds the pool Block (host) or DeviceBuffer (device):
// the memory lives exactly as long as the consumer keeps the tensor. A host
// export holds only the block; a device export holds only the device buffer,
// so a cached-mode device load's pinned staging copy goes back to the pool
// once the load's own StateDict is dropped. Device kinds:
//   host tensors          kDLCPU
//   "sim" device tensors  kDLCPU (sim device memory is host memory)
//   "cuda:N" tensors      kDLCUDA, device_id N
// The deleter only destroys C++ objects, so it may run on any thread, with or
// without the GIL (torch frees tensors from its own threads).
//
// Note [GIL]
// Every call that may block (header reads, loads, waits, pool trims, the
// destruction of a load in flight) releases the GIL. Objects handed to Python
// (StateDict, LoadHandle) are only touched with the GIL held.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pinload/checkpoint.h"
#include "pinload/copy_engine.h"
#include "pinload/device.h"
#include "pinload/dtype.h"
#include "pinload/env.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "pinload/model_cache.h"
#include "pinload/prefetch.h"
#include "pinload/shard.h"
#include "pinload/pool.h"
#include "pinload/state_dict.h"
#include "cli/load_option_args.h"
#include "io/held_file_env.h"

#ifndef PINLOAD_VERSION
#define PINLOAD_VERSION "0.0.0"
#endif

namespace py = pybind11;

namespace pinload::python {
namespace {

// ---- DLPack ABI (dlpack.h 0.8; stable since 0.2) ----
// Declared here so that the module needs no dlpack headers.
enum : std::int32_t { kDLCPU = 1, kDLCUDA = 2 };
enum : std::uint8_t { kDLUInt = 1 };
struct DLDevice {
  std::int32_t device_type;  // DLDeviceType, a C enum
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
static_assert(sizeof(DLDevice) == 8 && sizeof(DLDataType) == 4, "DLPack ABI");

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

// What a capsule owns: the tensor (and so its block or buffer), the shape
// array DLPack points at, and the managed tensor itself.
struct Exported {
  Tensor tensor;
  std::int64_t shape[1];
  DLManagedTensor managed;
};

void delete_exported(DLManagedTensor* managed) noexcept { delete static_cast<Exported*>(managed->manager_ctx); }

// A capsule that nobody consumed frees what it owns; a consumed one
// ("used_dltensor") belongs to its consumer, which calls the deleter.
void capsule_destructor(PyObject* capsule) noexcept {
  if (PyCapsule_IsValid(capsule, kUsedCapsuleName)) return;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed != nullptr) {
    managed->deleter(managed);
  } else {
    PyErr_WriteUnraisable(capsule);
  }
  PyErr_Restore(type, value, traceback);
}

// Where a load's tensors are handed out from.
struct Placement {
  enum Kind { kHost, kSim, kCuda } kind = kHost;
  int ordinal = 0;
  std::string device = "cpu";  // canonical: "cpu", "sim", "cuda:N"
  // The torch device the exported tensors are on.
  std::string torch_device() const { return kind == kCuda ? device : "cpu"; }
};

// A capsule over `t`'s bytes, or None for a tensor with no bytes.
py::object export_tensor(const Tensor& t, const Placement& placement) {
  if (t.nbytes() == 0) return py::none();
  std::unique_ptr<Exported> ctx;
  void* data = nullptr;
  DLDevice device{kDLCPU, 0};
  if (placement.kind == Placement::kHost) {
    if (!t.on_host()) throw InvalidFileError("tensor has no host copy", ErrorContext{{}, t.name()});
    ctx.reset(new Exported{Tensor(t.name(), t.dtype(), t.shape(), t.block(), t.block_offset(), t.nbytes()), {}, {}});
    data = const_cast<std::byte*>(ctx->tensor.data());
  } else {
    if (!t.on_device()) throw InvalidFileError("tensor has no device copy", ErrorContext{{}, t.name()});
    ctx.reset(
        new Exported{Tensor(t.name(), t.dtype(), t.shape(), t.device_buffer(), t.device_offset(), t.nbytes()), {}, {}});
    data = ctx->tensor.device_data();
    if (placement.kind == Placement::kCuda) device = DLDevice{kDLCUDA, placement.ordinal};
  }
  ctx->shape[0] = static_cast<std::int64_t>(t.nbytes());
  ctx->managed.dl_tensor = DLTensor{data, device, 1, DLDataType{kDLUInt, 8, 1}, ctx->shape, nullptr, 0};
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = &delete_exported;
  PyObject* capsule = PyCapsule_New(&ctx->managed, kCapsuleName, &capsule_destructor);
  if (capsule == nullptr) throw py::error_already_set();
  ctx.release();  // the capsule owns it now
  return py::reinterpret_steal<py::object>(capsule);
}

// ---- strings: file names are bytes to the OS ----

py::str decode(const std::string& text, const char* errors = "surrogateescape") {
  PyObject* s = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), errors);
  if (s == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(s);
}

py::list shape_list(const std::vector<std::uint64_t>& shape) {
  py::list out;
  for (std::uint64_t d : shape) out.append(py::int_(d));
  return out;
}

// ---- errors ----

struct ErrorTypes {
  py::object base;
  py::object by_code[6];
};
ErrorTypes& error_types() {
  static auto* types = new ErrorTypes;  // leaked: lives as long as the interpreter
  return *types;
}

void raise_error(const Error& e) {
  const auto code = static_cast<std::size_t>(e.code());
  py::object type = code < 6 ? error_types().by_code[code] : error_types().base;
  py::object instance = type(decode(e.what(), "backslashreplace"));
  const ErrorContext& ctx = e.context();
  instance.attr("file") = ctx.file.empty() ? py::object(py::none()) : py::object(decode(ctx.file));
  instance.attr("tensor") = ctx.tensor.empty() ? py::object(py::none()) : py::object(decode(ctx.tensor));
  instance.attr("begin") = ctx.begin ? py::object(py::int_(*ctx.begin)) : py::object(py::none());
  instance.attr("end") = ctx.end ? py::object(py::int_(*ctx.end)) : py::object(py::none());
  instance.attr("code") = py::str(error_code_name(e.code()));
  instance.attr("message") = decode(e.message(), "backslashreplace");
  PyErr_SetObject(type.ptr(), instance.ptr());
}

// Note [SafetensorError]: pinload's errors derive from
// safetensors.SafetensorError where safetensors can be imported, so that code
// written against the reference (`except SafetensorError`) catches them when
// it switches to pinload's drop-in; without safetensors, from Exception.
py::object error_base_class() {
  try {
    return py::module_::import("safetensors").attr("SafetensorError");
  } catch (const py::error_already_set&) {
    return py::reinterpret_borrow<py::object>(PyExc_Exception);
  }
}

py::object make_error_type(py::module_& m, const char* name, const char* doc, py::object bases) {
  const std::string qualified = std::string("pinload.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (type == nullptr) throw py::error_already_set();
  py::object out = py::reinterpret_steal<py::object>(type);
  m.attr(name) = out;
  return out;
}

void register_errors(py::module_& m) {
  ErrorTypes& t = error_types();
  t.base = make_error_type(m, "Error",
                           "Base class of every pinload error. Attributes: code (str), message (the text without "
                           "the context), file, tensor, begin, end (None where they do not apply). A "
                           "safetensors.SafetensorError too when safetensors is installed.",
                           error_base_class());
  for (const char* attr : {"file", "tensor", "begin", "end", "message"}) t.base.attr(attr) = py::none();
  t.base.attr("code") = py::str("error");
  struct Spec {
    ErrorCode code;
    const char* name;
    PyObject* extra_base;
    const char* doc;
  };
  const Spec specs[] = {
      {ErrorCode::kInvalidFile, "InvalidFileError", PyExc_ValueError,
       "A malformed safetensors file, index or argument (also a ValueError)."},
      {ErrorCode::kNotFound, "NotFoundError", PyExc_FileNotFoundError,
       "A path or tensor that does not exist (also a FileNotFoundError)."},
      {ErrorCode::kIo, "IoError", PyExc_OSError, "The OS failed a read, open or stat (also an OSError)."},
      {ErrorCode::kOutOfMemory, "OutOfMemoryError", PyExc_MemoryError,
       "The OS or the pool's budget refused memory (also a MemoryError)."},
      {ErrorCode::kDevice, "DeviceError", nullptr, "The accelerator or its driver failed, or is unavailable."},
      {ErrorCode::kCancelled, "CancelledError", nullptr, "The load was cancelled."},
  };
  for (const Spec& s : specs) {
    py::object bases = s.extra_base != nullptr
                           ? py::object(py::make_tuple(t.base, py::reinterpret_borrow<py::object>(s.extra_base)))
                           : py::object(py::make_tuple(t.base));
    py::object type = make_error_type(m, s.name, s.doc, bases);
    type.attr("code") = py::str(error_code_name(s.code));
    t.by_code[static_cast<std::size_t>(s.code)] = type;
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      raise_error(e);
    }
  });
}

// ---- devices and pools: one of each per device, for the whole process ----

struct Registry {
  std::mutex mu;
  std::map<std::string, Device*> devices;  // never destroyed: buffers and loads may outlive any Python object
  std::map<std::string, std::shared_ptr<Pool>> pools;
};
Registry& registry() {
  static auto* r = new Registry;
  return *r;
}

// Opens (once) the device `spec` names and returns it with its placement;
// nullptr for "cpu".
Device* device_for(const std::string& spec, Placement* placement) {
  if (spec == "cpu") {
    *placement = Placement{};
    return nullptr;
  }
  std::string key = spec == "cuda" ? "cuda:0" : spec;
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  Device*& device = r.devices[key];
  if (device == nullptr) {
    try {
      device = open_device(key).release();
    } catch (...) {
      r.devices.erase(key);
      throw;
    }
  }
  if (device->kind() == DeviceKind::kCuda) {
    placement->kind = Placement::kCuda;
    placement->device = device->name();  // "cuda:N"
    placement->ordinal = std::stoi(placement->device.substr(5));
  } else {
    placement->kind = Placement::kSim;
    placement->device = "sim";
  }
  return device;
}

// The pool shared by every load to `spec` (locked host memory for "cpu",
// the device's pinned memory otherwise). With `pool_bytes`, the pool shared by
// the loads to `spec` with that budget (PoolOptions::capacity_bytes).
std::shared_ptr<Pool> pool_for(const std::string& spec, std::optional<std::uint64_t> pool_bytes = std::nullopt) {
  Placement placement;
  Device* device = device_for(spec, &placement);
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  const std::string key = pool_bytes ? placement.device + "#" + std::to_string(*pool_bytes) : placement.device;
  std::shared_ptr<Pool>& pool = r.pools[key];
  if (!pool) {
    PoolOptions options;
    options.capacity_bytes = pool_bytes.value_or(0);
    pool = device ? Pool::create(device->make_pinned_backend(), options) : Pool::create_default(options);
  }
  return pool;
}

py::dict stats_dict(const PoolStats& s, std::string_view backend) {
  py::dict d;
  d["backend"] = py::str(std::string(backend));
  d["capacity"] = s.capacity_bytes;
  d["reserved"] = s.reserved_bytes;
  d["in_use"] = s.in_use_bytes;
  d["peak"] = s.peak_in_use_bytes;
  d["peak_reserved"] = s.peak_reserved_bytes;
  d["allocations"] = s.allocations;
  d["free_list_hits"] = s.free_list_hits;
  d["os_reservations"] = s.os_reservations;
  d["os_releases"] = s.os_releases;
  d["budget_waits"] = s.budget_waits;
  d["live_blocks"] = s.live_blocks;
  return d;
}

// ---- the objects handed to Python ----

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
  // (name, dtype, shape, capsule or None) of one tensor.
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
  if (with_copies) d["bytes_copied"] = p.bytes_copied;
  return d;
}

// Destroys *owned with the GIL released where that is allowed (not while the
// interpreter shuts down): its destructor joins threads that never need the
// GIL, and other Python threads may run meanwhile.
template <typename T>
void reset_without_gil(std::unique_ptr<T>& owned) {
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing();
#else
  const bool finalizing = _Py_IsFinalizing();
#endif
  if (!finalizing && PyGILState_Check()) {
    py::gil_scoped_release release;
    owned.reset();
  } else {
    owned.reset();
  }
}

class PyLoadHandle {
 public:
  // `env`: the Env the load reads through, kept until the load is gone (a
  // safe_open's HeldFileEnv); null for the default one.
  PyLoadHandle(LoadHandle handle, Placement placement, std::shared_ptr<Env> env = nullptr)
      : env_(std::move(env)), handle_(std::make_unique<LoadHandle>(std::move(handle))), placement_(std::move(placement)) {}
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
    if (!handle_) throw InvalidFileError("result() was already taken from this load");
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
    if (!handle_) throw InvalidFileError("result() was already taken from this load");
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
// in io/held_file_env.h): what safe_open reads through.
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

// The spellings are the command line's (cli/load_option_args.h).
DirectIo parse_direct(const std::string& direct) {
  if (std::optional<DirectIo> d = cli::parse_direct_arg(direct)) return *d;
  throw InvalidFileError("direct must be 'auto', 'on' or 'off', not '" + direct + "'");
}

CachedRead parse_cached_read(const std::string& cached_read) {
  if (std::optional<CachedRead> c = cli::parse_cached_read_arg(cached_read)) return *c;
  throw InvalidFileError("cached_read must be 'auto', 'map' or 'pread', not '" + cached_read + "'");
}

ZeroCopy parse_zero_copy(const std::string& zero_copy) {
  if (std::optional<ZeroCopy> z = cli::parse_zero_copy_arg(zero_copy)) return *z;
  throw InvalidFileError("zero_copy must be 'auto', 'on' or 'off', not '" + zero_copy + "'");
}

// The reader's options as Python passes them, checked.
LoadOptions reader_options(unsigned threads, std::size_t block_size, const std::string& direct,
                           std::size_t files_in_flight, const std::string& variant) {
  if (threads == 0 || threads > 1024) throw InvalidFileError("threads must be 1..1024");
  if (block_size < 4096 || block_size > (std::size_t{1} << 30)) throw InvalidFileError("block_size must be 4 KiB..1 GiB");
  if (files_in_flight == 0) throw InvalidFileError("files_in_flight must be > 0");
  LoadOptions options;
  options.threads = threads;
  options.block_size = block_size;
  options.direct = parse_direct(direct);
  options.files_in_flight = files_in_flight;
  options.resolve.variant = variant;
  return options;
}

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
    return prefetch_ && paths == paths_ && placement.device == placement_.device;
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

// The loader of a load or prefetch with these options, on the device's shared pool.
Loader make_loader(const std::vector<std::string>& paths, const std::string& device_spec, unsigned threads,
                   std::size_t block_size, const std::string& direct, std::size_t files_in_flight, std::size_t streams,
                   std::size_t chunk_bytes, std::optional<std::uint64_t> staging_bytes, const std::string& variant,
                   std::optional<std::uint64_t> pool_bytes, Placement* placement, Env* env = nullptr,
                   const DTypeOptions& dtype = {}, const std::string& cached_read = "auto",
                   const std::string& zero_copy = "auto") {
  if (paths.empty()) throw InvalidFileError("no path given");
  if (streams == 0 || streams > 64) throw InvalidFileError("streams must be 1..64");
  if (chunk_bytes == 0) throw InvalidFileError("chunk_bytes must be > 0");
  LoadOptions options = reader_options(threads, block_size, direct, files_in_flight, variant);
  options.dtype = dtype;
  options.cached_read = parse_cached_read(cached_read);
  options.zero_copy = parse_zero_copy(zero_copy);
  Device* device = device_for(device_spec, placement);
  if (staging_bytes && device == nullptr) throw InvalidFileError("staging_bytes (streaming mode) needs a device");
  options.target.device = device;
  options.target.copy.streams = streams;
  options.target.copy.chunk_bytes = chunk_bytes;
  if (staging_bytes) {
    options.target.mode = DeviceMode::kStreaming;
    options.target.staging_bytes = *staging_bytes;
  }
  return Loader(options, pool_for(device_spec, pool_bytes), env);
}

std::unique_ptr<PyLoadHandle> load_async(const std::vector<std::string>& paths, const std::string& device_spec, unsigned threads,
                         std::size_t block_size, const std::string& direct, std::size_t files_in_flight,
                         std::size_t streams, std::size_t chunk_bytes, std::optional<std::uint64_t> staging_bytes,
                         const std::string& variant, PyPrefetch* prefetch, const std::string& dtype,
                         const std::vector<std::string>& keep, const std::string& keep_dtype,
                         const std::string& cached_read, bool stream, std::optional<std::uint64_t> pool_bytes,
                         const PyHeldFile* held, const std::string& zero_copy) {
  Placement placement;
  const HandOut hand_out = stream ? HandOut::kStream : HandOut::kWhole;
  DTypeOptions conversion;  // Note [Conversion on load] in convert.h
  if (!dtype.empty()) {
    conversion.to = dtype_from_name(dtype);
    if (!conversion.to) throw InvalidFileError("unknown dtype '" + dtype + "'");
    conversion.keep = keep;
    if (!keep_dtype.empty()) {
      conversion.keep_to = dtype_from_name(keep_dtype);
      if (!conversion.keep_to) throw InvalidFileError("unknown dtype '" + keep_dtype + "'");
    }
  }
  std::shared_ptr<Env> env;
  LoadHandle handle = [&] {
    py::gil_scoped_release release;
    if (held != nullptr) {
      if (paths.size() != 1 || paths[0] != held->env()->path()) throw InvalidFileError("held file of other paths");
      env = held->env();
    }
    Loader loader = make_loader(paths, device_spec, threads, block_size, direct, files_in_flight, streams, chunk_bytes,
                                staging_bytes, variant, pool_bytes, &placement, env.get(), conversion, cached_read,
                                zero_copy);
    // The prefetch's own loader, so that its blocks and budget are the ones
    // adopted (a conversion load adopts none: its options differ).
    if (prefetch != nullptr && held == nullptr && !conversion.active() && prefetch->matches(paths, placement)) {
      return prefetch->adopt(hand_out);
    }
    // A held file: its header is read again through `env`, from the same file.
    return loader.load_async(paths, hand_out);  // the load's thread holds what it needs
  }();
  return std::make_unique<PyLoadHandle>(std::move(handle), std::move(placement), std::move(env));
}

// A ModelCache (model_cache.h) whose host copies live in the shared pool of
// `pool_device` ("cpu": host memory; "cuda:N": that GPU's pinned memory, so
// that copies to it go at full speed).
class PyModelCache {
 public:
  PyModelCache(std::uint64_t budget_bytes, const std::string& pool_device, unsigned threads, std::size_t block_size,
               const std::string& direct, std::size_t files_in_flight, const std::string& variant) {
    const LoadOptions options = reader_options(threads, block_size, direct, files_in_flight, variant);
    py::gil_scoped_release release;
    cache_ = std::make_unique<ModelCache>(budget_bytes, std::make_shared<const Loader>(options, pool_for(pool_device)));
  }

  // The model on `device_spec` ("cpu": the cached host copy itself).
  PyStateDict get(const std::vector<std::string>& paths, const std::string& device_spec, std::size_t streams,
                  std::size_t chunk_bytes) {
    if (paths.empty()) throw InvalidFileError("no path given");
    if (streams == 0 || streams > 64) throw InvalidFileError("streams must be 1..64");
    if (chunk_bytes == 0) throw InvalidFileError("chunk_bytes must be > 0");
    Placement placement;
    StateDict sd;
    {
      py::gil_scoped_release release;
      Device* device = device_for(device_spec, &placement);
      sd = device ? cache_->get_on(*device, paths, CopyOptions{streams, chunk_bytes, 0}) : cache_->get(paths);
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
  void set_budget(std::uint64_t budget_bytes) {
    py::gil_scoped_release release;
    cache_->set_budget(budget_bytes);
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
  std::unique_ptr<ModelCache> cache_;
};
std::unique_ptr<PyPrefetch> start_prefetch(const std::vector<std::string>& paths, const std::string& device_spec,
                                           unsigned threads, std::size_t block_size, const std::string& direct,
                                           std::size_t files_in_flight, std::size_t streams, std::size_t chunk_bytes,
                                           std::optional<std::uint64_t> staging_bytes, const std::string& variant,
                                           std::optional<std::uint64_t> pool_bytes) {
  Placement placement;
  py::gil_scoped_release release;
  Loader loader = make_loader(paths, device_spec, threads, block_size, direct, files_in_flight, streams, chunk_bytes,
                              staging_bytes, variant, pool_bytes, &placement);
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
  if (mode != "slice" && mode != "share") throw InvalidFileError("shard mode must be 'slice' or 'share', not '" + mode + "'");
  ShardSpec spec{rank, world_size, mode == "slice" ? ShardMode::kSlice : ShardMode::kShare, {}, window_bytes};
  for (const auto& [pattern, dim] : rules) spec.rules.push_back(ShardRule{pattern, dim});
  ShardLoadOptions options{threads, block_size, parse_direct(direct) != DirectIo::kOff, max_gap, batch_bytes};
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

py::dict read_header(const std::string& path) {
  CheckpointFile file;
  {
    py::gil_scoped_release release;
    file = read_checkpoint_file(default_env(), path);
  }
  return header_dict(file);
}

}  // namespace
}  // namespace pinload::python

namespace pinload::python {
void bind_convert(py::module_& m);  // convert_bindings.cc
}

PYBIND11_MODULE(_core, m) {
  using namespace pinload;
  using namespace pinload::python;
  m.doc() = "pinload's native core: parallel direct-I/O loads into pinned pools, handed out as DLPack capsules.";
  m.attr("__version__") = PINLOAD_VERSION;
  m.attr("DEFAULT_THREADS") = kDefaultThreads;
  m.attr("DEFAULT_BLOCK_SIZE") = kDefaultBlockSize;
  m.attr("DEFAULT_STREAMS") = kDefaultCopyStreams;
  m.attr("DEFAULT_CHUNK_BYTES") = kDefaultCopyChunkBytes;
  m.attr("DEFAULT_STAGING_BYTES") = kDefaultStagingBytes;
  register_errors(m);
  bind_convert(m);

  py::class_<PyStateDict>(m, "StateDict", "A loaded checkpoint: tensors in pool or device memory.")
      .def("__len__", &PyStateDict::size)
      .def("__contains__", &PyStateDict::contains, py::arg("name"))
      .def("names", &PyStateDict::names, "Tensor names in load order.")
      .def("metadata", &PyStateDict::metadata, "The files' __metadata__, merged (the first file wins a key).")
      .def("infos", &PyStateDict::infos, "(name, dtype, shape) of every tensor, in load order.")
      .def("export", &PyStateDict::export_one, py::arg("name"),
           "(name, dtype, shape, capsule) of one tensor; the capsule is None when it has no bytes. "
           "Raises NotFoundError for an unknown name.")
      .def("export_all", &PyStateDict::export_all, "export() of every tensor, in load order.")
      .def_property_readonly("total_bytes", &PyStateDict::total_bytes)
      .def_property_readonly("device", [](const PyStateDict& s) { return s.placement().device; },
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
      .def_property_readonly("device", [](const PyLoadHandle& h) { return h.placement().device; });

  py::class_<PyPrefetch>(m, "Prefetch",
                         "Reads started before the load that adopts them. Dropping it stops it and frees its memory.")
      .def("done", &PyPrefetch::done, "True once the readers have finished (all read, cancelled, failed or adopted).")
      .def("cancel", &PyPrefetch::cancel,
           "Stops the readers promptly and waits for them; what was read stays for a load to adopt.")
      .def("progress", &PyPrefetch::progress, "dict: bytes_done, bytes_total, files_direct, files_buffered, files_mapped.")
      .def("wait", &PyPrefetch::wait, py::arg("timeout") = py::none(),
           "Waits up to timeout seconds (None: until done), without the GIL; True once done.")
      .def_property_readonly("adopted", &PyPrefetch::adopted, "True once a load has taken it over.")
      .def_property_readonly("device", [](const PyPrefetch& p) { return p.placement().device; })
      .def_property_readonly("paths", [](const PyPrefetch& p) {
        py::list out;
        for (const std::string& path : p.paths()) out.append(decode(path));
        return out;
      });

  m.def("load_async", &load_async, py::arg("paths"), py::arg("device") = "cpu",
        py::arg("threads") = kDefaultThreads, py::arg("block_size") = kDefaultBlockSize, py::arg("direct") = "auto",
        py::arg("files_in_flight") = 2, py::arg("streams") = kDefaultCopyStreams,
        py::arg("chunk_bytes") = kDefaultCopyChunkBytes, py::arg("staging_bytes") = py::none(),
        py::arg("variant") = "", py::arg("prefetch") = nullptr, py::arg("dtype") = "",
        py::arg("keep") = std::vector<std::string>{}, py::arg("keep_dtype") = "",
        py::arg("cached_read") = "auto", py::arg("stream") = false, py::arg("pool_bytes") = py::none(),
        py::arg("held") = nullptr, py::arg("zero_copy") = "auto",
        "Starts loading `paths` (bytes: files, indexes, folders) to `device` ('cpu', 'sim', 'cuda', 'cuda:N') "
        "on the device's shared pool (with `pool_bytes`: the shared pool of that budget); returns a LoadHandle at once. A `prefetch` of the same paths and device "
        "is adopted: what it read is not read again (its own options then apply). `dtype` ('BF16', 'F16', 'F32'; "
        "'' as stored) converts floating tensors inside the load, except names matching a `keep` pattern "
        "(those become `keep_dtype`, or stay as stored when it is ''). cached_read: how a file "
        "in the page cache is read ('auto', 'map', 'pread'). stream=True: tensors come only from next_ready() "
        "and the load keeps none of them (HandOut::kStream), so each file's block goes back to the pool once "
        "the caller has dropped its tensors; result() is then empty. `held`: a HeldFile of the one path, whose header and bytes are read. "
        "zero_copy ('auto', 'on', 'off'): host files handed out as leased file mappings (Note [Zero-copy loads]).");
  m.def("prefetch", &start_prefetch, py::arg("paths"), py::arg("device") = "cpu",
        py::arg("threads") = kDefaultThreads, py::arg("block_size") = kDefaultBlockSize, py::arg("direct") = "auto",
        py::arg("files_in_flight") = 2, py::arg("streams") = kDefaultCopyStreams,
        py::arg("chunk_bytes") = kDefaultCopyChunkBytes, py::arg("staging_bytes") = py::none(),
        py::arg("variant") = "", py::arg("pool_bytes") = py::none(),
        "Starts reading `paths` for a later load to `device` in the background; returns a Prefetch at once.");
  py::class_<PyHeldFile>(m, "HeldFile",
                         "One safetensors file held open from its header to its load (safe_open): a replaced path "
                         "does not change what is read.")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def("header", [](const PyHeldFile& f) { return header_dict(f.file()); }, "As read_header().");
  py::class_<PyModelCache>(m, "ModelCache",
                           "Host copies of recently used checkpoints in a shared pinned pool, LRU under a budget "
                           "(include/pinload/model_cache.h).")
      .def(py::init<std::uint64_t, const std::string&, unsigned, std::size_t, const std::string&, std::size_t,
                    const std::string&>(),
           py::arg("budget_bytes"), py::arg("pool_device") = "cpu", py::arg("threads") = kDefaultThreads,
           py::arg("block_size") = kDefaultBlockSize, py::arg("direct") = "auto", py::arg("files_in_flight") = 2,
           py::arg("variant") = "")
      .def("get", &PyModelCache::get, py::arg("paths"), py::arg("device") = "cpu",
           py::arg("streams") = kDefaultCopyStreams, py::arg("chunk_bytes") = kDefaultCopyChunkBytes,
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
  m.def("read_header", &read_header, py::arg("path"),
        "Reads and validates one file's header: dict with path, tensors [(name, dtype, shape, begin, end)] in "
        "offset order, metadata (dict or None), data_offset, file_size.");
  m.def(
      "pool_stats", [](const std::string& device) { auto pool = pool_for(device); return stats_dict(pool->stats(), pool->backend_name()); },
      py::arg("device") = "cpu", "Statistics of the pool shared by loads to `device`.");
  m.def(
      "trim_pool",
      [](const std::string& device) {
        auto pool = pool_for(device);
        py::gil_scoped_release release;
        pool->trim();
      },
      py::arg("device") = "cpu", "Returns the idle memory of `device`'s pool to the OS.");
  m.def("dtype_names", [] {
    py::list out;
    for (int i = 0; i < kDTypeCount; ++i) out.append(py::str(std::string(dtype_name(static_cast<DType>(i)))));
    return out;
  });
  m.def("built_with_cuda", &built_with_cuda);
  m.def("cuda_available", [] {
    std::string why;
    bool ok = false;
    {
      py::gil_scoped_release release;
      ok = cuda_available(&why);
    }
    return py::make_tuple(ok, why);
  }, "(available, reason): whether pinload can use a CUDA device, and why not.");
}
