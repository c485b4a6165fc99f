// pinload/device.h: the one seam between pinload and an accelerator.
//
// Everything the loader asks of a GPU goes through a Device: pinned host
// memory for the pool (make_pinned_backend), device memory (allocate, or a
// caller's DeviceAllocator), streams, events and asynchronous host-to-device
// copies. Two implementations:
//   "cuda:N"  the CUDA runtime API (src/device/cuda_device.cc), plus the
//             dtype conversion kernel (src/device/cuda_convert.cu)
//   "sim"     a CPU stand-in (src/device/sim_device.cc): each stream is a FIFO
//             of tasks run in order by a thread of its own, a copy is a memcpy
//             and device memory is host memory. Tests use it to slow copies
//             down or hold them (SimDeviceOptions) and so check that nothing
//             touches a host range before its copy has completed.
//
// Note [Ordering]
// Work on one stream runs in the order it was queued; streams run
// independently of each other. An Event recorded on a stream completes when
// all work queued on that stream before it has completed. A host range given
// to copy_to_device_async must stay valid and unchanged until an event
// recorded after the copy has completed (CopyEngine, copy_engine.h, tracks
// this for pool blocks).
//
// Note [Lifetimes]
// Streams and Events must be destroyed before the Device that made them.
// DeviceBuffers may outlive it: each holds what it needs to free itself.
//
// Errors: a device or driver failure throws DeviceError naming the call and the
// driver's message; exhausted device memory throws OutOfMemoryError; a range
// outside a buffer, or an object of another device, throws
// InvalidArgumentError. Nothing aborts.
//
// Thread safety: a Device and its Streams may be used from many threads at
// once; copies queued concurrently on one stream run in some order between
// them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "pinload/dtype.h"
#include "pinload/env.h"
#include "pinload/host_memory.h"
#include "pinload/numa.h"

namespace pinload {

class Device;

// Where device memory comes from. Device::allocate uses the device's own
// (cudaMalloc, or host memory for "sim") unless set_allocator installs
// another, e.g. an adapter over torch's caching allocator.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  // At least `bytes` (> 0) bytes of device memory, 256-byte aligned. Throws
  // OutOfMemoryError when the device is full, DeviceError on other failures.
  virtual void* allocate(std::size_t bytes) = 0;
  // Frees a pointer from allocate() of `bytes`. Never throws.
  virtual void deallocate(void* data, std::size_t bytes) noexcept = 0;
  virtual std::string_view name() const noexcept = 0;
};

// A range of device memory. Owns it: the release function given at
// construction runs once, when the buffer is destroyed.
class DeviceBuffer {
 public:
  using Release = std::function<void(void* data, std::size_t bytes)>;

  // `device` is Device::id() of the device the memory belongs to.
  DeviceBuffer(std::uint64_t device, void* data, std::size_t bytes, Release release) noexcept
      : device_id_(device), data_(data), bytes_(bytes), release_(std::move(release)) {}
  ~DeviceBuffer() {
    if (release_) release_(data_, bytes_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // A device address: never dereference it on the host (except for "sim").
  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }
  std::uint64_t device_id() const noexcept { return device_id_; }

 private:
  std::uint64_t device_id_;
  void* data_;
  std::size_t bytes_;
  Release release_;
};

namespace detail {
// What a Device backend implements behind the Stream and Event handles.
class StreamImpl {
 public:
  explicit StreamImpl(std::uint64_t device) : device_id_(device) {}
  virtual ~StreamImpl() = default;
  virtual void synchronize() = 0;
  virtual bool query() = 0;
  std::uint64_t device_id() const noexcept { return device_id_; }

 private:
  const std::uint64_t device_id_;
};
class EventImpl {
 public:
  virtual ~EventImpl() = default;
  virtual bool query() = 0;
  virtual void synchronize() = 0;
};
}  // namespace detail

// A queue of device work (a cudaStream_t; a worker thread for "sim"). Move-only;
// destroying it lets queued work finish (see Note [Lifetimes]).
class Stream {
 public:
  Stream() noexcept = default;
  explicit Stream(std::unique_ptr<detail::StreamImpl> impl) noexcept : impl_(std::move(impl)) {}
  Stream(Stream&&) noexcept = default;
  Stream& operator=(Stream&&) noexcept = default;

  bool valid() const noexcept { return impl_ != nullptr; }
  // Waits for all work queued so far. Throws DeviceError if any of it failed.
  void synchronize();
  // True when all work queued so far has completed. Throws DeviceError.
  bool query();
  detail::StreamImpl* impl() const noexcept { return impl_.get(); }

 private:
  std::unique_ptr<detail::StreamImpl> impl_;
};

// A point in a stream (a cudaEvent_t). Move-only.
class Event {
 public:
  Event() noexcept = default;
  explicit Event(std::unique_ptr<detail::EventImpl> impl) noexcept : impl_(std::move(impl)) {}
  Event(Event&&) noexcept = default;
  Event& operator=(Event&&) noexcept = default;

  bool valid() const noexcept { return impl_ != nullptr; }
  // True once all work queued before it on its stream has completed. Throws
  // DeviceError if that work failed.
  bool query();
  // Blocks (without spinning) until query() would be true.
  void synchronize();
  detail::EventImpl* impl() const noexcept { return impl_.get(); }

 private:
  std::unique_ptr<detail::EventImpl> impl_;
};

// How a CUDA device pins the pool's host memory ("sim" ignores it).
enum class PinMethod {
  kHostAlloc,     // cudaHostAlloc(cudaHostAllocPortable): the default for now
  kHostRegister,  // mmap (with huge_pages) + cudaHostRegister(cudaHostRegisterPortable)
};

struct PinnedMemoryOptions {
  PinMethod method = PinMethod::kHostAlloc;
  HugePages huge_pages = HugePages::kTransparent;  // kHostRegister and "sim" only
  Env* env = nullptr;                               // mmap/mlock; null: default_env()
  // >= 0: each reservation prefers this NUMA node (Note [NUMA placement],
  // numa.h): mmap'ed ranges are bound before they are touched or pinned;
  // cudaHostAlloc runs on a helper thread whose memory policy prefers the
  // node, since the driver allocates and pins inside the call. -1: none.
  int numa_node = -1;
};

enum class DeviceKind { kSim, kCuda };

// Note [Host copy counts]
// What a device saw of the host memory it copied from, so that tests can
// say by counts, not timing, whether a path copied with no staging copy:
//  - a range given to register_host is recorded (registrations, and the
//    live ranges in registered_ranges());
//  - a copy from memory the device copies from directly (its pinned
//    backend's slabs, or a live registration) is a direct copy;
//  - a copy from any other (pageable) host memory is staged: CUDA copies
//    such a range through a pinned bounce buffer of the driver's, a second
//    pass over host memory;
//  - a copy from a registered range that runs after its registration ended
//    fails its stream (expired_copies), as a DMA from unpinned memory would.
// "sim" counts all of them. CUDA counts registrations only (it cannot tell a
// staged copy from a direct one without asking the driver per copy).
struct HostCopyCounts {
  std::uint64_t registrations = 0;           // register_host calls that registered
  std::uint64_t registered_bytes = 0;        // their bytes, summed
  std::uint64_t registrations_refused = 0;   // register_host calls that returned null
  std::uint64_t live_registrations = 0;      // handles not gone yet
  std::uint64_t direct_copies = 0;           // from pinned or registered memory
  std::uint64_t direct_bytes = 0;
  std::uint64_t staged_copies = 0;           // from pageable memory
  std::uint64_t staged_bytes = 0;
  std::uint64_t expired_copies = 0;          // failed: their registration went first
};

struct RegisteredRange {
  const void* data = nullptr;
  std::size_t bytes = 0;
  bool operator==(const RegisteredRange&) const = default;
};

class Device {
 public:
  virtual ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // "cuda:0", "sim".
  virtual const std::string& name() const noexcept = 0;
  // One line for logs: "NVIDIA H200 (cuda:0, 139.8 GiB, cc 9.0)".
  virtual std::string description() const = 0;
  virtual DeviceKind kind() const noexcept = 0;
  // Unique among the devices of this process; tags DeviceBuffers and Streams.
  std::uint64_t id() const noexcept { return id_; }
  // The device's PCI address as sysfs spells it ("0000:19:00.0"; CUDA:
  // cudaDeviceGetPCIBusId), or empty when it has none.
  virtual std::string pci_bus_id() const { return {}; }
  // The NUMA node the device is attached to: by default the sysfs numa_node
  // of pci_bus_id() under `topology`'s root; -1 when unknown. Throws
  // InvalidFileError for a malformed sysfs file (numa.h).
  virtual int numa_node(const NumaTopology& topology) const;

  // A slab backend for Pool::create whose memory the device copies from at
  // full speed (CUDA: pinned; "sim": mmap + mlock).
  virtual std::unique_ptr<HostMemoryBackend> make_pinned_backend(PinnedMemoryOptions options = {}) = 0;

  // Device memory of `bytes` (> 0), from allocator(). Throws OutOfMemoryError,
  // DeviceError.
  std::shared_ptr<DeviceBuffer> allocate(std::size_t bytes);
  // Installs the allocator that allocate() uses from now on; null restores the
  // device's own. Buffers keep the allocator that made them alive.
  void set_allocator(std::shared_ptr<DeviceAllocator> allocator);
  std::shared_ptr<DeviceAllocator> allocator() const;
  // The device's own allocator (cudaMalloc/cudaFree; aligned host memory).
  virtual std::shared_ptr<DeviceAllocator> default_allocator() const = 0;
  // Adopts memory that belongs to this device, allocated elsewhere (a torch
  // tensor's storage, say); `release` (may be empty) runs when the buffer goes.
  std::shared_ptr<DeviceBuffer> wrap(void* data, std::size_t bytes, DeviceBuffer::Release release = {});

  // A new stream of this device (CUDA: non-blocking w.r.t. the legacy default stream).
  virtual Stream create_stream() = 0;
  // Records an event after all work queued on `stream` so far.
  Event record(Stream& stream);
  // Makes the work queued on `stream` from now on wait until `event` (of
  // this device, recorded on any of its streams) has completed, without
  // blocking the caller (cudaStreamWaitEvent). A failure of the work before
  // `event` fails `stream` too. `event` may be destroyed afterwards. Throws
  // InvalidFileError for a stream or event of another device (or an empty
  // event), DeviceError when the device fails.
  void wait(Stream& stream, const Event& event);
  // Queues a copy of `bytes` from host `src` to dst[dst_offset, +bytes) on
  // `stream` and returns at once; see Note [Ordering] for when `src` may be
  // reused. Throws InvalidArgumentError when the range leaves `dst` or `dst` or
  // `stream` belong to another device; DeviceError when the device fails.
  void copy_to_device_async(DeviceBuffer& dst, std::size_t dst_offset, const void* src, std::size_t bytes,
                            Stream& stream);
  // Registers host memory that was mapped by other means (a node-store
  // entry: store.h) so that copies from it run as from pinned memory, until
  // the returned handle goes. CUDA: cudaHostRegister, portable and
  // read-only (pinned without breaking the pages' copy-on-write sharing);
  // "sim": recorded, and a copy from the range that runs after the handle
  // went fails its stream, as a copy from unregistered memory would fault.
  // Keep the handle until the copies from the range have completed. Null
  // where the device cannot register the range (the reason in *why, when
  // given): copies from it then run as from pageable memory. Never throws.
  virtual std::shared_ptr<void> register_host(const void* data, std::size_t bytes,
                                              std::string* why = nullptr) noexcept;
  // Note [Host copy counts]: what this device counted since it was made.
  virtual HostCopyCounts host_copy_counts() const;
  // The ranges registered now (live handles), in registration order.
  virtual std::vector<RegisteredRange> registered_ranges() const;
  // Queues on `stream` the element conversion `c` (dtype.h) of the
  // c.elements elements at src[src_offset] into dst[dst_offset] (CUDA: a
  // kernel; "sim": the host loops, on the stream's thread), after the work
  // queued on `stream` before it. c.row_scales, when set, is an address in
  // this device's memory. The ranges must not overlap. Throws
  // InvalidFileError for a range outside its buffer, a buffer or stream of
  // another device or a pair is_convertible refuses; DeviceError when the
  // device fails (CUDA built without its kernels: "built without the CUDA
  // conversion kernels").
  void convert_async(DeviceBuffer& dst, std::size_t dst_offset, const DeviceBuffer& src, std::size_t src_offset,
                     const ElementConversion& c, Stream& stream);
  // Waits for all work on the device (every stream), then copies
  // src[src_offset, +bytes) to host `dst`. For tests and checks.
  void copy_to_host(void* dst, const DeviceBuffer& src, std::size_t src_offset, std::size_t bytes);
  // Waits for all work queued on every stream of this device.
  virtual void synchronize() = 0;

 protected:
  Device();
  virtual Event do_record(Stream& stream) = 0;
  virtual void do_copy_to_device_async(void* dst, const void* src, std::size_t bytes, Stream& stream) = 0;
  virtual void do_copy_to_host(void* dst, const void* src, std::size_t bytes) = 0;
  virtual void do_convert_async(void* dst, const void* src, const ElementConversion& c, Stream& stream) = 0;
  virtual void do_wait(Stream& stream, const Event& event) = 0;

 private:
  void check_stream(const Stream& stream) const;
  const std::uint64_t id_;
  mutable std::mutex allocator_mu_;
  std::shared_ptr<DeviceAllocator> allocator_;  // null: default_allocator()
};

// The CPU stand-in's knobs. Defaults: copies run at memcpy speed.
struct SimDeviceOptions {
  // Slept before each copy, and a throttle (0: none): copies of n bytes take
  // at least n / bytes_per_second longer.
  std::chrono::microseconds copy_delay{0};
  std::uint64_t bytes_per_second = 0;
  // A bus of this bandwidth (0: none) that the copies of every stream share,
  // as host-to-device copies share one PCIe link: a copy of n bytes holds
  // the bus for n / bus_bytes_per_second, after the copies that took it
  // before (of any stream), so streams add no bandwidth. Off by default.
  std::uint64_t bus_bytes_per_second = 0;
  // Called on the stream's thread before each copy, with its size. A test can
  // block in it to hold copies in flight, or throw to fail the copy: the
  // stream then fails like a CUDA stream with a sticky error (its later work
  // is skipped and its events, synchronize and new copies throw DeviceError).
  std::function<void(std::size_t bytes)> before_copy;
  // Called on the stream's thread before each conversion (convert_async),
  // with its element count; a throw fails the stream as before_copy's does.
  std::function<void(std::uint64_t elements)> before_convert;
  // Called by register_host and when its handle goes (registered false),
  // with the range's size. Must not throw.
  std::function<void(std::size_t bytes, bool registered)> on_register;
  // Asked by register_host before it registers: a reason (not empty) makes it
  // refuse the range, as a driver refuses a file-backed mapping; the reason
  // is logged. Must not throw.
  std::function<std::string(const void* data, std::size_t bytes)> refuse_register;
  // Device memory limit for the default allocator (0: none); past it,
  // allocate() throws OutOfMemoryError.
  std::uint64_t memory_bytes = 0;
  // Fill every allocation with 0xA5 so that tests see bytes no copy wrote.
  // Benchmarks turn it off: cudaMalloc writes nothing either.
  bool poison = true;
  // NUMA placement tests: the node numa_node() reports (-1: ask sysfs by
  // pci_bus_id, if any) and the PCI address it claims (empty: none).
  int numa_node = -1;
  std::string pci_bus_id;
};

// What a device string names. The one parser of device strings: the CLI, the
// bench, the bindings and Python all go through parse_device_spec.
//   "cpu"     host memory: no Device at all (LoadOptions::target.device null)
//   "sim"     the CPU stand-in (make_sim_device)
//   "cuda"    CUDA device 0 (ordinal_given false: torch's callers may pick
//             their current device instead)
//   "cuda:N"  CUDA device N
struct DeviceSpec {
  enum class Kind : std::uint8_t { kHost, kSim, kCuda };
  Kind kind = Kind::kHost;
  int ordinal = 0;             // kCuda: the CUDA ordinal
  bool ordinal_given = false;  // kCuda: spelled "cuda:N", not "cuda"

  bool is_host() const noexcept { return kind == Kind::kHost; }
  // The canonical spelling: "cpu", "sim" or "cuda:N".
  std::string name() const;
  friend bool operator==(const DeviceSpec&, const DeviceSpec&) = default;
};

// Parses `text` as above (exact spellings: no whitespace, lowercase). Throws
// InvalidArgumentError naming `option` ("device", "--device") and the text
// for anything else.
DeviceSpec parse_device_spec(std::string_view text, std::string_view option = "device");

// Opens the device `spec` names: a stand-in with `sim` options, or a CUDA
// device. Throws InvalidArgumentError for the host ("cpu" has no Device: a
// host load has a null target device), DeviceError when CUDA is unavailable
// (no driver, no device, N out of range, or built without CUDA), naming the
// reason.
std::unique_ptr<Device> open_device(const DeviceSpec& spec, SimDeviceOptions sim = {});
// open_device(parse_device_spec(spec)).
std::unique_ptr<Device> open_device(std::string_view spec);
std::unique_ptr<Device> make_sim_device(SimDeviceOptions options = {});
// The CUDA device `ordinal`; throws DeviceError as open_device does.
std::unique_ptr<Device> open_cuda_device(int ordinal);

// True when pinload was built with CUDA and at least one device is usable;
// otherwise false, with the reason in *why (when non-null): "built without
// CUDA", or the CUDA runtime's message ("CUDA driver version is insufficient
// for CUDA runtime version", "no CUDA-capable device is detected", ...).
bool cuda_available(std::string* why = nullptr);
// Whether this build has the CUDA device layer at all.
bool built_with_cuda() noexcept;

}  // namespace pinload
