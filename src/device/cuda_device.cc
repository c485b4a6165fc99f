// The CUDA device (device.h), on the CUDA runtime API, which it opens at run
// time (device/cuda_runtime.h): plain C++ built by the host compiler, linked to
// no CUDA library. The conversion kernel comes as a fat binary built by nvcc
// and loaded with cudaLibraryLoadData (device/cuda_convert.h). Without
// PINLOAD_HAVE_CUDA it builds the stubs at the bottom instead.
//
// Every call is checked; a failure throws DeviceError (OutOfMemoryError for
// cudaErrorMemoryAllocation) as "<call> failed on cuda:N: <cudaErrorName>:
// <cudaGetErrorString>", after clearing the runtime's last-error slot so that
// a later, unrelated check (torch's, say) is not blamed for it.
//
// The current device is per thread in CUDA. Each call here sets this device
// for its duration and restores the caller's (DeviceGuard), so pinload never
// changes which device a caller's thread is on.
#include "pinload/device.h"

#include <string>

#include "pinload/error.h"

#if PINLOAD_HAVE_CUDA

#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

#include "base/log.h"
#include "device/cuda_convert.h"
#include "device/cuda_runtime.h"

namespace pinload {
namespace {

// The runtime, opened by open_cuda_device before anything here runs (kept once found).
const cuda::Runtime& rt() {
  static const cuda::Runtime& runtime = cuda::require_runtime("CUDA");
  return runtime;
}

constexpr std::size_t kHugePage = 2u << 20;

std::string cuda_message(cudaError_t err) {
  return std::string(rt().cudaGetErrorName(err)) + ": " + rt().cudaGetErrorString(err);
}

[[noreturn]] void throw_cuda(const char* call, cudaError_t err, const std::string& where) {
  (void)rt().cudaGetLastError();  // clear a non-sticky error; sticky ones stay regardless
  std::string message = std::string(call) + " failed" + (where.empty() ? "" : " on " + where) + ": " +
                        cuda_message(err);
  if (err == cudaErrorMemoryAllocation) throw OutOfMemoryError(std::move(message));
  throw DeviceError(std::move(message));
}

void check(cudaError_t err, const char* call, const std::string& where) {
  if (err != cudaSuccess) throw_cuda(call, err, where);
}

std::string where(int ordinal) { return "cuda:" + std::to_string(ordinal); }

// Makes `ordinal` the calling thread's device for a scope, then restores the
// previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) {
    check(rt().cudaGetDevice(&previous_), "cudaGetDevice", where(ordinal));
    if (previous_ != ordinal) {
      check(rt().cudaSetDevice(ordinal), "cudaSetDevice", where(ordinal));
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) (void)rt().cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// The same for noexcept paths (destructors, release): never throws.
class QuietDeviceGuard {
 public:
  explicit QuietDeviceGuard(int ordinal) noexcept {
    if (rt().cudaGetDevice(&previous_) == cudaSuccess && previous_ != ordinal) {
      changed_ = rt().cudaSetDevice(ordinal) == cudaSuccess;
    }
  }
  ~QuietDeviceGuard() {
    if (changed_) (void)rt().cudaSetDevice(previous_);
  }
  QuietDeviceGuard(const QuietDeviceGuard&) = delete;
  QuietDeviceGuard& operator=(const QuietDeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

class CudaStream final : public detail::StreamImpl {
 public:
  CudaStream(std::uint64_t device, int ordinal) : StreamImpl(device), ordinal_(ordinal) {
    DeviceGuard guard(ordinal_);
    check(rt().cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", where(ordinal_));
  }
  // cudaStreamDestroy returns at once; queued work still completes.
  ~CudaStream() override {
    QuietDeviceGuard guard(ordinal_);
    (void)rt().cudaStreamDestroy(stream);
  }
  void synchronize() override {
    DeviceGuard guard(ordinal_);
    check(rt().cudaStreamSynchronize(stream), "cudaStreamSynchronize", where(ordinal_));
  }
  bool query() override {
    DeviceGuard guard(ordinal_);
    const cudaError_t err = rt().cudaStreamQuery(stream);
    if (err == cudaErrorNotReady) {
      (void)rt().cudaGetLastError();
      return false;
    }
    check(err, "cudaStreamQuery", where(ordinal_));
    return true;
  }
  int ordinal() const noexcept { return ordinal_; }

  cudaStream_t stream = nullptr;

 private:
  int ordinal_;
};

class CudaEvent final : public detail::EventImpl {
 public:
  CudaEvent(int ordinal, cudaStream_t stream) : ordinal_(ordinal) {
    DeviceGuard guard(ordinal_);
    // BlockingSync: a waiting thread sleeps instead of spinning a core.
    check(rt().cudaEventCreateWithFlags(&event_, cudaEventDisableTiming | cudaEventBlockingSync), "cudaEventCreateWithFlags",
          where(ordinal_));
    const cudaError_t err = rt().cudaEventRecord(event_, stream);
    if (err != cudaSuccess) {
      (void)rt().cudaEventDestroy(event_);
      throw_cuda("cudaEventRecord", err, where(ordinal_));
    }
  }
  ~CudaEvent() override {
    QuietDeviceGuard guard(ordinal_);
    (void)rt().cudaEventDestroy(event_);
  }
  bool query() override {
    DeviceGuard guard(ordinal_);
    const cudaError_t err = rt().cudaEventQuery(event_);
    if (err == cudaErrorNotReady) {
      (void)rt().cudaGetLastError();
      return false;
    }
    check(err, "cudaEventQuery", where(ordinal_));
    return true;
  }
  void synchronize() override {
    DeviceGuard guard(ordinal_);
    check(rt().cudaEventSynchronize(event_), "cudaEventSynchronize", where(ordinal_));
  }
  cudaEvent_t event() const noexcept { return event_; }

 private:
  int ordinal_;
  cudaEvent_t event_ = nullptr;
};

class CudaAllocator final : public DeviceAllocator {
 public:
  explicit CudaAllocator(int ordinal) : ordinal_(ordinal) {}
  void* allocate(std::size_t bytes) override {
    DeviceGuard guard(ordinal_);
    void* data = nullptr;
    check(rt().cudaMalloc(&data, bytes), "cudaMalloc", where(ordinal_) + " (" + std::to_string(bytes) + " bytes)");
    return data;
  }
  void deallocate(void* data, std::size_t) noexcept override {
    QuietDeviceGuard guard(ordinal_);
    (void)rt().cudaFree(data);  // fails only at process teardown (cudaErrorCudartUnloading)
  }
  std::string_view name() const noexcept override { return "cudaMalloc"; }

 private:
  int ordinal_;
};

// Asks once per backend, warning on the first refusal, that memory prefer a
// NUMA node; see PinnedMemoryOptions::numa_node.
class NodeBinding {
 public:
  NodeBinding(Env* env, int node) : env_(env), node_(node) {}
  int node() const { return node_; }
  void bind(void* data, std::size_t bytes) { report(env_->bind_memory(data, bytes, node_)); }
  void prefer_for_this_thread() { report(env_->set_thread_memory_node(node_)); }

 private:
  void report(int rc) {
    if (rc != 0 && !refused_.exchange(true)) {
      log::warn("placing pinned memory on NUMA node {} failed ({}); its pages go where the OS puts them", node_,
                log::errno_text(-rc));
    }
  }
  Env* env_;
  int node_;
  std::atomic<bool> refused_{false};
};

// cudaHostAlloc(cudaHostAllocPortable): pinned for every device; page-aligned.
class HostAllocBackend final : public HostMemoryBackend {
 public:
  HostAllocBackend(int ordinal, Env* env, int numa_node) : ordinal_(ordinal), binding_(env, numa_node) {}
  HostRange reserve(std::size_t bytes) override {
    if (binding_.node() < 0) return allocate(bytes);
    // The driver allocates and pins the pages inside cudaHostAlloc, so mbind
    // would come too late: allocate on a thread of our own whose memory
    // policy prefers the node, leaving the caller's policy alone.
    HostRange range;
    std::exception_ptr error;
    std::thread helper;
    try {
      helper = std::thread([&] {
        try {
          binding_.prefer_for_this_thread();
          range = allocate(bytes);
        } catch (...) {
          error = std::current_exception();
        }
      });
    } catch (const std::system_error& e) {
      log::debug("no helper thread for a NUMA-placed cudaHostAlloc ({}); allocating unplaced", e.what());
      return allocate(bytes);
    }
    helper.join();
    if (error) std::rethrow_exception(error);
    return range;
  }
  void release(const HostRange& range) noexcept override {
    QuietDeviceGuard guard(ordinal_);
    (void)rt().cudaFreeHost(range.data);
  }
  std::size_t alignment() const noexcept override { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }
  std::string_view name() const noexcept override { return "cuda-host-alloc"; }

 private:
  HostRange allocate(std::size_t bytes) {
    DeviceGuard guard(ordinal_);
    void* data = nullptr;
    check(rt().cudaHostAlloc(&data, bytes, cudaHostAllocPortable), "cudaHostAlloc",
          where(ordinal_) + " (" + std::to_string(bytes) + " bytes)");
    if (reinterpret_cast<std::uintptr_t>(data) % alignment() != 0) {
      (void)rt().cudaFreeHost(data);
      throw DeviceError("cudaHostAlloc returned memory that is not page-aligned");
    }
    return HostRange{data, bytes, /*locked=*/true, /*huge_pages=*/false};
  }

  int ordinal_;
  NodeBinding binding_;
};

// mmap (huge pages as asked) + cudaHostRegister(cudaHostRegisterPortable).
class HostRegisterBackend final : public HostMemoryBackend {
 public:
  HostRegisterBackend(int ordinal, Env* env, HugePages huge_pages, int numa_node)
      : ordinal_(ordinal), env_(env), huge_pages_(huge_pages), binding_(env, numa_node) {}
  HostRange reserve(std::size_t bytes) override {
    HostRange range;
    range.bytes = bytes;
    int err = 0;
    if (huge_pages_ == HugePages::kExplicit && bytes % kHugePage == 0) {
      range.data = env_->map_anonymous(bytes, MAP_HUGETLB, &err);
      range.huge_pages = range.data != nullptr;
    }
    if (range.data == nullptr) {
      range.data = env_->map_anonymous(bytes, 0, &err);
      if (range.data == nullptr) throw_os_error("cannot map " + std::to_string(bytes) + " bytes of host memory", err);
      if (huge_pages_ != HugePages::kOff) env_->advise(range.data, bytes, MADV_HUGEPAGE);
    }
    if (binding_.node() >= 0) binding_.bind(range.data, bytes);  // before cudaHostRegister faults the pages in
    DeviceGuard guard(ordinal_);
    const cudaError_t rc = rt().cudaHostRegister(range.data, bytes, cudaHostRegisterPortable);
    if (rc != cudaSuccess) {
      env_->unmap(range.data, bytes);
      throw_cuda("cudaHostRegister", rc, where(ordinal_) + " (" + std::to_string(bytes) + " bytes)");
    }
    range.locked = true;
    return range;
  }
  void release(const HostRange& range) noexcept override {
    {
      QuietDeviceGuard guard(ordinal_);
      (void)rt().cudaHostUnregister(range.data);
    }
    env_->unmap(range.data, range.bytes);
  }
  std::size_t alignment() const noexcept override {
    return huge_pages_ == HugePages::kOff ? static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)) : kHugePage;
  }
  std::string_view name() const noexcept override { return "cuda-host-register"; }

 private:
  int ordinal_;
  Env* env_;
  HugePages huge_pages_;
  NodeBinding binding_;
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int ordinal)
      : ordinal_(ordinal), name_(where(ordinal)), allocator_(std::make_shared<CudaAllocator>(ordinal)) {
    DeviceGuard guard(ordinal_);
    check(rt().cudaFree(nullptr), "cudaFree(nullptr) (context creation)", name_);  // create the context now
    cudaDeviceProp prop{};
    check(rt().cudaGetDeviceProperties(&prop, ordinal_), "cudaGetDeviceProperties", name_);
    char gib[32];
    std::snprintf(gib, sizeof gib, "%.1f GiB", static_cast<double>(prop.totalGlobalMem) / (1u << 30));
    description_ = std::string(prop.name) + " (" + name_ + ", " + gib + ", cc " + std::to_string(prop.major) + "." +
                   std::to_string(prop.minor) + ", " + std::to_string(prop.asyncEngineCount) + " copy engines)";
    // Only NUMA placement needs it: without it the device's node is unknown.
    char bus_id[32] = {};
    if (const cudaError_t rc = rt().cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, ordinal_); rc != cudaSuccess) {
      (void)rt().cudaGetLastError();
      log::debug("{}: cudaDeviceGetPCIBusId failed ({}); NUMA node unknown", name_, cuda_message(rc));
    } else {
      try {
        pci_bus_id_ = normalize_pci_bus_id(bus_id);
      } catch (const InvalidFileError& e) {
        log::debug("{}: {}; NUMA node unknown", name_, e.what());
      }
    }
  }

  const std::string& name() const noexcept override { return name_; }
  std::string description() const override { return description_; }
  DeviceKind kind() const noexcept override { return DeviceKind::kCuda; }

  // Read-only: pinning a private mapping for writing would break its
  // copy-on-write sharing, page by page.
  std::shared_ptr<void> register_host(const void* data, std::size_t bytes, std::string* why) noexcept override {
    if (data == nullptr || bytes == 0) return nullptr;
    void* p = const_cast<void*>(data);
    const int ordinal = ordinal_;
    {
      QuietDeviceGuard guard(ordinal);
      if (const cudaError_t rc = rt().cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterReadOnly);
          rc != cudaSuccess) {
        (void)rt().cudaGetLastError();
        log::debug("{}: cudaHostRegister of {} bytes failed ({}): copies from them run from pageable memory", name_,
                   bytes, cuda_message(rc));
        if (why != nullptr) {
          try {
            *why = "cudaHostRegister: " + cuda_message(rc);
          } catch (...) {
          }
        }
        std::lock_guard lock(registry_->mu);
        registry_->counts.registrations_refused++;
        return nullptr;
      }
    }
    const auto unregister = [ordinal, registry = registry_](void* q) noexcept {
      {
        QuietDeviceGuard guard(ordinal);
        (void)rt().cudaHostUnregister(q);
      }
      std::lock_guard lock(registry->mu);
      registry->counts.live_registrations--;
      std::erase_if(registry->live, [q](const RegisteredRange& r) { return r.data == q; });
    };
    bool listed = false;
    try {
      {
        std::lock_guard lock(registry_->mu);
        registry_->live.push_back({p, bytes});
        listed = true;
        registry_->counts.registrations++;
        registry_->counts.registered_bytes += bytes;
        registry_->counts.live_registrations++;
      }
      return std::shared_ptr<void>(p, unregister);
    } catch (...) {
      // The control block's allocation failed: the deleter has run. The
      // list's: nothing holds the registration, so it is undone here.
      if (!listed) {
        QuietDeviceGuard guard(ordinal);
        (void)rt().cudaHostUnregister(p);
      }
      return nullptr;
    }
  }

  // Note [Host copy counts]: registrations only.
  HostCopyCounts host_copy_counts() const override {
    std::lock_guard lock(registry_->mu);
    return registry_->counts;
  }
  std::vector<RegisteredRange> registered_ranges() const override {
    std::lock_guard lock(registry_->mu);
    return registry_->live;
  }
  std::string pci_bus_id() const override { return pci_bus_id_; }

  std::unique_ptr<HostMemoryBackend> make_pinned_backend(PinnedMemoryOptions options) override {
    Env* env = options.env != nullptr ? options.env : default_env();
    if (options.method == PinMethod::kHostRegister) {
      return std::make_unique<HostRegisterBackend>(ordinal_, env, options.huge_pages, options.numa_node);
    }
    return std::make_unique<HostAllocBackend>(ordinal_, env, options.numa_node);
  }

  std::shared_ptr<DeviceAllocator> default_allocator() const override { return allocator_; }

  Stream create_stream() override { return Stream(std::make_unique<CudaStream>(id(), ordinal_)); }

  void synchronize() override {
    DeviceGuard guard(ordinal_);
    check(rt().cudaDeviceSynchronize(), "cudaDeviceSynchronize", name_);
  }

 protected:
  Event do_record(Stream& stream) override {
    return Event(std::make_unique<CudaEvent>(ordinal_, static_cast<CudaStream*>(stream.impl())->stream));
  }

  void do_copy_to_device_async(void* dst, const void* src, std::size_t bytes, Stream& stream) override {
    DeviceGuard guard(ordinal_);
    check(rt().cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<CudaStream*>(stream.impl())->stream),
          "cudaMemcpyAsync", name_);
  }

  void do_wait(Stream& stream, const Event& event) override {
    auto* e = dynamic_cast<CudaEvent*>(event.impl());
    if (e == nullptr) throw InvalidFileError("an event of another device given to " + name_);
    DeviceGuard guard(ordinal_);
    check(rt().cudaStreamWaitEvent(static_cast<CudaStream*>(stream.impl())->stream, e->event(), 0), "cudaStreamWaitEvent",
          where(ordinal_));
  }

  void do_convert_async(void* dst, const void* src, const ElementConversion& c, Stream& stream) override {
    DeviceGuard guard(ordinal_);
    cuda::KernelLaunch launch;
    try {
      launch = cuda::convert_launch(dst, src, c);
    } catch (const DeviceError& e) {
      throw DeviceError(name_ + ": " + e.what());
    }
    auto args = launch.args();
    check(rt().cudaLaunchKernel(launch.kernel, launch.grid, launch.block, args.data(), 0,
                                static_cast<CudaStream*>(stream.impl())->stream),
          "dtype conversion kernel launch", name_);
  }

  void do_copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    DeviceGuard guard(ordinal_);
    check(rt().cudaDeviceSynchronize(), "cudaDeviceSynchronize", name_);
    check(rt().cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy", name_);
  }

 private:
  int ordinal_;
  std::string name_;
  std::string description_;
  std::string pci_bus_id_;
  // register_host's counts and live ranges; handles may outlive the device.
  struct Registry {
    std::mutex mu;
    HostCopyCounts counts;
    std::vector<RegisteredRange> live;
  };
  std::shared_ptr<Registry> registry_ = std::make_shared<Registry>();
  std::shared_ptr<CudaAllocator> allocator_;
};

}  // namespace

bool built_with_cuda() noexcept { return true; }

bool cuda_available(std::string* why) {
  const cuda::Runtime* runtime = cuda::runtime(why);
  if (runtime == nullptr) return false;
  int count = 0;
  const cudaError_t err = runtime->cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)runtime->cudaGetLastError();
    if (why != nullptr) *why = runtime->cudaGetErrorString(err);
    return false;
  }
  if (count == 0) {
    if (why != nullptr) *why = "no CUDA device is visible";
    return false;
  }
  if (why != nullptr) why->clear();
  return true;
}

std::unique_ptr<Device> open_cuda_device(int ordinal) {
  const cuda::Runtime& runtime = cuda::require_runtime("cannot open " + where(ordinal));
  int count = 0;
  const cudaError_t err = runtime.cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)runtime.cudaGetLastError();
    throw DeviceError("cannot open " + where(ordinal) + ": no CUDA device: " + runtime.cudaGetErrorString(err) +
                      " (cudaGetDeviceCount: " + runtime.cudaGetErrorName(err) + ")");
  }
  if (ordinal < 0 || ordinal >= count) {
    throw DeviceError("cannot open " + where(ordinal) + ": " + std::to_string(count) + " CUDA device(s) visible");
  }
  return std::make_unique<CudaDevice>(ordinal);
}

}  // namespace pinload

#else  // !PINLOAD_HAVE_CUDA

namespace pinload {

bool built_with_cuda() noexcept { return false; }

bool cuda_available(std::string* why) {
  if (why != nullptr) *why = "built without CUDA";
  return false;
}

std::unique_ptr<Device> open_cuda_device(int ordinal) {
  throw DeviceError("cannot open cuda:" + std::to_string(ordinal) + ": pinload was built without CUDA");
}

}  // namespace pinload

#endif  // PINLOAD_HAVE_CUDA
