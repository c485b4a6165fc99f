// Internal to pinload._core: tensors handed to Python through DLPack.
//
// Note [DLPack export]
// Each tensor goes out as a TensorExport, an object with __dlpack__ and
// __dlpack_device__ (the Python array API's protocol), so that
// torch.from_dlpack() and numpy.from_dlpack() alias pool or device memory
// without a copy and without this module linking libtorch. No raw address
// ever crosses into Python: only capsules do. A capsule describes the tensor
// as it is: its dtype (dlpack.h's codes) and shape, compact row-major strides.
// Two exceptions go out as 1-D uint8 over the tensor's bytes, for the
// consumer to view as it can: the sub-byte types (F4, F6_*), and, when
// dlpack.h predates 1.0, BOOL and the F8 types; and any tensor exported
// through as_bytes() (numpy views BF16 and F8 bytes with ml_dtypes). A consumer that asks for
// max_version >= 1.0 gets a "dltensor_versioned" capsule, others the legacy
// "dltensor" one.
//
// The capsule's manager_ctx owns a copy of the pinload::Tensor, which holds
// the pool Block (host) or DeviceBuffer (device): the memory lives exactly
// as long as the consumer keeps the tensor. A host export holds only the
// block; a device export holds only the device buffer, so a cached-mode
// device load's pinned staging copy goes back to the pool once the load's own
// StateDict is dropped. Device kinds:
//   host tensors          kDLCPU
//   "sim" device tensors  kDLCPU (sim device memory is host memory)
//   "cuda:N" tensors      kDLCUDA, device_id N
// Device tensors are handed out once the load's copies have completed, so a
// consumer's `stream` needs no synchronization and is ignored. The deleter
// only destroys C++ objects, so it may run on any thread, with or without the
// GIL (torch frees tensors from its own threads).
#pragma once

#include <pybind11/pybind11.h>

#include "pinload/state_dict.h"
#include "registry.h"

namespace pinload::python {

// A tensor's memory for one or more DLPack consumers (Note [DLPack export]).
class TensorExport {
 public:
  // `tensor` holds only what the export needs: the host block or the device buffer.
  TensorExport(Tensor tensor, Placement placement) : tensor_(std::move(tensor)), placement_(std::move(placement)) {}

  // A new capsule over the tensor. Raises BufferError for a dl_device other
  // than dlpack_device() or copy=True (pinload exports without copying).
  pybind11::object dlpack(const pybind11::object& stream, const pybind11::object& max_version,
                          const pybind11::object& dl_device, const pybind11::object& copy) const;
  // (DLDeviceType, device_id).
  pybind11::tuple dlpack_device() const;
  const Tensor& tensor() const noexcept { return tensor_; }
  // The same memory, exported as 1-D uint8 bytes.
  TensorExport as_bytes() const {
    TensorExport out = *this;
    out.as_bytes_ = true;
    return out;
  }

 private:
  Tensor tensor_;
  Placement placement_;
  bool as_bytes_ = false;  // export 1-D uint8 whatever the dtype
};

// A TensorExport of `t` on `placement` (its host copy for the host, its
// device copy otherwise), or None for a tensor with no bytes. Throws
// InvalidArgumentError when `t` lacks the copy `placement` asks for.
pybind11::object export_tensor(const Tensor& t, const Placement& placement);

// Binds TensorExport as _core.TensorExport.
void register_dlpack(pybind11::module_& m);

}  // namespace pinload::python
