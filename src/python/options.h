// Internal to pinload._core: load options as Python sees them
// (pinload.LoadOptions), checked by LoadOptions::validate() and nothing else.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>

#include "pinload/loader.h"

namespace pinload::python {

// One load's options from Python: pinload::LoadOptions without a device (the
// device comes with each load), and whether the load streams.
struct PyLoadOptions {
  LoadOptions load;                            // validated; target.device null, mode kCached
  std::optional<std::uint64_t> staging_bytes;  // set: kStreaming with this budget (target.staging_bytes)
  // set: the load's blocks come from the shared pool of this budget (> 0)
  // instead of the device's shared pool (pool_for in registry.h).
  std::optional<std::uint64_t> pool_bytes;

  // The options of a load to `device` (null: host memory). A device load
  // streams (kStreaming, the default staging budget unless staging_bytes) when
  // staging_bytes is set or `stream_by_default`: a load's host memory is then
  // only its staging, not a pinned copy of the whole model.
  LoadOptions for_device(Device* device, bool stream_by_default = false) const;
};

// A size from Python: an int >= 0, or a string parse_size takes ("64K",
// "8M"). Raises TypeError for other types (bool included) and
// InvalidArgumentError naming `option` for a negative int or a bad string.
std::uint64_t size_from_python(const pybind11::handle& value, const char* option);

// Binds LoadOptions, DeviceSpec, parse_device_spec and parse_size.
void register_options(pybind11::module_& m);

}  // namespace pinload::python
