#include "registry.h"

#include "pinload/session.h"

namespace pinload::python {

// The bindings' devices and pools are the process session's (Note [Sessions]
// in pinload/session.h): shared with the C++ code of the same process.

Device* device_for(std::string_view text, Placement* placement) {
  *placement = Placement{parse_device_spec(text)};
  return Session::process().device(text);
}

std::shared_ptr<Pool> pool_for(std::string_view spec, std::optional<std::uint64_t> pool_bytes) {
  return Session::process().pool(spec, pool_bytes.value_or(0));
}

std::shared_ptr<Pool> staging_pool_for(const LoadOptions& options, const std::string& device) {
  return Session::process().staging_pool(device, options.target.staging_bytes);
}

}  // namespace pinload::python
