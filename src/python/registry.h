// Internal to pinload._core: the devices and pools of the process's session
// (pinload/session.h), so that every load to "cuda:0" shares that device's
// pinned pool, with the C++ code of the same process too.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "pinload/device.h"
#include "pinload/loader.h"
#include "pinload/pool.h"

namespace pinload::python {

// Where a load's tensors are handed out from.
struct Placement {
  DeviceSpec spec;  // host, sim or cuda:N (ordinal resolved)
  // The pinload device: "cpu", "sim", "cuda:N".
  std::string device() const { return spec.name(); }
  // The torch device of exported tensors ("sim" memory is host memory).
  std::string torch_device() const { return spec.kind == DeviceSpec::Kind::kCuda ? spec.name() : "cpu"; }
};

// The device `spec` names (parse_device_spec), opened once and never
// destroyed (buffers and loads may outlive any Python object), with its
// placement in *placement; nullptr for the host ("cpu"). Thread-safe. Throws
// InvalidArgumentError for a malformed spec, DeviceError as open_device.
Device* device_for(std::string_view spec, Placement* placement);

// The pool shared by every load to `spec`: locked host memory for "cpu", the
// device's pinned memory otherwise. With `pool_bytes`, the pool shared by the
// loads to `spec` with that budget (PoolOptions::capacity_bytes).
// Thread-safe.
std::shared_ptr<Pool> pool_for(std::string_view spec, std::optional<std::uint64_t> pool_bytes = std::nullopt);

// The staging pool shared by the streaming loads to options.target.device
// (named `device`) with options.target.staging_bytes: its pinned blocks are
// made once and reused by every later load (make_staging_pool). Thread-safe.
std::shared_ptr<Pool> staging_pool_for(const LoadOptions& options, const std::string& device);

}  // namespace pinload::python
