#include "registry.h"

#include <map>
#include <mutex>

namespace pinload::python {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, Device*> devices;  // by canonical name; never destroyed
  std::map<std::string, std::shared_ptr<Pool>> pools;
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

std::shared_ptr<Pool> pool_for(std::string_view spec) {
  Placement placement;
  Device* device = device_for(spec, &placement);
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  std::shared_ptr<Pool>& pool = r.pools[placement.device()];
  if (!pool) pool = device ? Pool::create(device->make_pinned_backend()) : Pool::create_default();
  return pool;
}

}  // namespace pinload::python
