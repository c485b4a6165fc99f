#include "registry.h"

#include <map>
#include <mutex>
#include <string>

namespace pinload::python {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, Device*> devices;  // by canonical name; never destroyed
  std::map<std::string, std::shared_ptr<Pool>> pools;
  std::map<std::string, std::shared_ptr<Pool>> staging_pools;  // by device and budget
};
Registry& registry() {
  static auto* r = new Registry;
  return *r;
}

}  // namespace

Device* device_for(std::string_view text, Placement* placement) {
  const DeviceSpec spec = parse_device_spec(text);
  *placement = Placement{spec};
  if (spec.is_host()) return nullptr;
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  Device*& device = r.devices[spec.name()];
  if (device == nullptr) {
    try {
      device = open_device(spec).release();
    } catch (...) {
      r.devices.erase(spec.name());
      throw;
    }
  }
  return device;
}

std::shared_ptr<Pool> pool_for(std::string_view spec, std::optional<std::uint64_t> pool_bytes) {
  Placement placement;
  Device* device = device_for(spec, &placement);
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  const std::string key = pool_bytes ? placement.device() + "#" + std::to_string(*pool_bytes) : placement.device();
  std::shared_ptr<Pool>& pool = r.pools[key];
  if (!pool) {
    PoolOptions options;
    options.capacity_bytes = pool_bytes.value_or(0);
    pool = device ? Pool::create(device->make_pinned_backend(), options) : Pool::create_default(options);
  }
  return pool;
}

std::shared_ptr<Pool> staging_pool_for(const LoadOptions& options, const std::string& device) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  std::shared_ptr<Pool>& pool = r.staging_pools[device + "#" + std::to_string(options.target.staging_bytes)];
  if (!pool) pool = make_staging_pool(options);
  return pool;
}

}  // namespace pinload::python
