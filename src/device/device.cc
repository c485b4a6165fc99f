// The backend-independent half of device.h: handles, checks, open_device.
#include "pinload/device.h"

#include <atomic>
#include <charconv>
#include <string>
#include <utility>

#include "pinload/error.h"

namespace pinload {
namespace {

std::atomic<std::uint64_t> g_next_device_id{1};

void check_range(const char* what, std::size_t offset, std::size_t bytes, std::size_t size) {
  if (offset > size || bytes > size - offset) {
    throw InvalidArgumentError(std::string(what) + " of " + std::to_string(bytes) + " bytes at offset " +
                           std::to_string(offset) + " leaves the device buffer of " + std::to_string(size) +
                           " bytes");
  }
}

}  // namespace

void Stream::synchronize() {
  if (!impl_) throw InvalidArgumentError("synchronize on an empty Stream");
  impl_->synchronize();
}

bool Stream::query() {
  if (!impl_) throw InvalidArgumentError("query on an empty Stream");
  return impl_->query();
}

bool Event::query() {
  if (!impl_) throw InvalidArgumentError("query on an empty Event");
  return impl_->query();
}

void Event::synchronize() {
  if (!impl_) throw InvalidArgumentError("synchronize on an empty Event");
  impl_->synchronize();
}

Device::Device() : id_(g_next_device_id.fetch_add(1, std::memory_order_relaxed)) {}
Device::~Device() = default;

std::shared_ptr<void> Device::register_host(const void*, std::size_t, std::string* why) noexcept {
  try {
    if (why != nullptr) *why = name() + " does not register host memory";
  } catch (...) {
  }
  return nullptr;
}

HostCopyCounts Device::host_copy_counts() const { return {}; }

std::vector<RegisteredRange> Device::registered_ranges() const { return {}; }

int Device::numa_node(const NumaTopology& topology) const {
  const std::string bus_id = pci_bus_id();
  return bus_id.empty() ? -1 : topology.node_of_pci_device(bus_id);
}

void Device::set_allocator(std::shared_ptr<DeviceAllocator> allocator) {
  std::lock_guard lock(allocator_mu_);
  allocator_ = std::move(allocator);
}

std::shared_ptr<DeviceAllocator> Device::allocator() const {
  {
    std::lock_guard lock(allocator_mu_);
    if (allocator_) return allocator_;
  }
  return default_allocator();
}

std::shared_ptr<DeviceBuffer> Device::allocate(std::size_t bytes) {
  if (bytes == 0) throw InvalidArgumentError("device allocation of 0 bytes on " + name());
  std::shared_ptr<DeviceAllocator> alloc = allocator();
  void* data = alloc->allocate(bytes);
  try {
    return std::make_shared<DeviceBuffer>(id_, data, bytes,
                                          [alloc](void* d, std::size_t n) { alloc->deallocate(d, n); });
  } catch (...) {
    alloc->deallocate(data, bytes);
    throw;
  }
}

std::shared_ptr<DeviceBuffer> Device::wrap(void* data, std::size_t bytes, DeviceBuffer::Release release) {
  if (data == nullptr && bytes != 0) throw InvalidArgumentError("wrap of a null device pointer on " + name());
  return std::make_shared<DeviceBuffer>(id_, data, bytes, std::move(release));
}

void Device::check_stream(const Stream& stream) const {
  if (!stream.valid()) throw InvalidArgumentError("empty Stream given to " + name());
  if (stream.impl()->device_id() != id_) throw InvalidArgumentError("a Stream of another device given to " + name());
}

Event Device::record(Stream& stream) {
  check_stream(stream);
  return do_record(stream);
}

void Device::copy_to_device_async(DeviceBuffer& dst, std::size_t dst_offset, const void* src, std::size_t bytes,
                                  Stream& stream) {
  check_stream(stream);
  if (dst.device_id() != id_) throw InvalidArgumentError("a DeviceBuffer of another device given to " + name());
  check_range("host-to-device copy", dst_offset, bytes, dst.size());
  if (bytes == 0) return;
  if (src == nullptr) throw InvalidArgumentError("host-to-device copy from a null pointer");
  do_copy_to_device_async(static_cast<std::byte*>(dst.data()) + dst_offset, src, bytes, stream);
}

void Device::wait(Stream& stream, const Event& event) {
  check_stream(stream);
  if (!event.valid()) throw InvalidArgumentError("wait on an empty event on " + name());
  do_wait(stream, event);
}

void Device::convert_async(DeviceBuffer& dst, std::size_t dst_offset, const DeviceBuffer& src, std::size_t src_offset,
                           const ElementConversion& c, Stream& stream) {
  check_stream(stream);
  if (dst.device_id() != id_ || src.device_id() != id_) {
    throw InvalidArgumentError("a DeviceBuffer of another device given to " + name());
  }
  if (!is_convertible(c.from, c.to)) {
    throw InvalidArgumentError("no conversion from " + std::string(dtype_name(c.from)) + " to " +
                           std::string(dtype_name(c.to)));
  }
  check_range("conversion source", src_offset, c.elements * (dtype_bits(c.from) / 8), src.size());
  check_range("conversion target", dst_offset, c.elements * (dtype_bits(c.to) / 8), dst.size());
  if (c.elements == 0) return;
  do_convert_async(static_cast<std::byte*>(dst.data()) + dst_offset,
                   static_cast<const std::byte*>(src.data()) + src_offset, c, stream);
}

void Device::copy_to_host(void* dst, const DeviceBuffer& src, std::size_t src_offset, std::size_t bytes) {
  if (src.device_id() != id_) throw InvalidArgumentError("a DeviceBuffer of another device given to " + name());
  check_range("device-to-host copy", src_offset, bytes, src.size());
  if (bytes == 0) return;
  if (dst == nullptr) throw InvalidArgumentError("device-to-host copy to a null pointer");
  do_copy_to_host(dst, static_cast<const std::byte*>(src.data()) + src_offset, bytes);
}

std::string DeviceSpec::name() const {
  switch (kind) {
    case Kind::kHost: return "cpu";
    case Kind::kSim: return "sim";
    case Kind::kCuda: return "cuda:" + std::to_string(ordinal);
  }
  return "?";
}

DeviceSpec parse_device_spec(std::string_view text, std::string_view option) {
  if (text == "cpu") return DeviceSpec{DeviceSpec::Kind::kHost};
  if (text == "sim") return DeviceSpec{DeviceSpec::Kind::kSim};
  if (text == "cuda") return DeviceSpec{DeviceSpec::Kind::kCuda, 0, false};
  if (text.starts_with("cuda:")) {
    const std::string_view digits = text.substr(5);
    int ordinal = -1;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), ordinal);
    // from_chars takes a '-' sign but no '+' and no space: "cuda:-1" is caught below.
    if (!digits.empty() && ec == std::errc() && end == digits.data() + digits.size() && ordinal >= 0) {
      return DeviceSpec{DeviceSpec::Kind::kCuda, ordinal, true};
    }
  }
  throw InvalidArgumentError(std::string(option) + ": unknown device '" + std::string(text) +
                             "': expected cpu, sim, cuda or cuda:N");
}

std::unique_ptr<Device> open_device(const DeviceSpec& spec, SimDeviceOptions sim) {
  switch (spec.kind) {
    case DeviceSpec::Kind::kHost: break;
    case DeviceSpec::Kind::kSim: return make_sim_device(std::move(sim));
    case DeviceSpec::Kind::kCuda: return open_cuda_device(spec.ordinal);
  }
  throw InvalidArgumentError("device 'cpu' is host memory, not a Device: load with no target device instead");
}

std::unique_ptr<Device> open_device(std::string_view spec) { return open_device(parse_device_spec(spec)); }

}  // namespace pinload
