#include "dlpack_export.h"

#include <dlpack/dlpack.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "common.h"
#include "pinload/dtype.h"
#include "pinload/error.h"

namespace pinload::python {
namespace {

#if defined(DLPACK_MAJOR_VERSION) && DLPACK_MAJOR_VERSION >= 1
#define PINLOAD_DLPACK_VERSIONED 1
#else
#define PINLOAD_DLPACK_VERSIONED 0
#endif

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";
#if PINLOAD_DLPACK_VERSIONED
constexpr const char* kVersionedCapsuleName = "dltensor_versioned";
constexpr const char* kUsedVersionedCapsuleName = "used_dltensor_versioned";
#endif

// The DLPack type of `dtype`; nullopt where it goes out as bytes.
std::optional<DLDataType> dl_dtype(DType dtype) {
  auto t = [](std::uint8_t code, std::uint8_t bits) { return DLDataType{code, bits, 1}; };
  switch (dtype) {
    case DType::kU8: return t(kDLUInt, 8);
    case DType::kI8: return t(kDLInt, 8);
    case DType::kI16: return t(kDLInt, 16);
    case DType::kU16: return t(kDLUInt, 16);
    case DType::kI32: return t(kDLInt, 32);
    case DType::kU32: return t(kDLUInt, 32);
    case DType::kI64: return t(kDLInt, 64);
    case DType::kU64: return t(kDLUInt, 64);
    case DType::kF16: return t(kDLFloat, 16);
    case DType::kBF16: return t(kDLBfloat, 16);
    case DType::kF32: return t(kDLFloat, 32);
    case DType::kF64: return t(kDLFloat, 64);
    case DType::kC64: return t(kDLComplex, 64);
#if PINLOAD_DLPACK_VERSIONED
    case DType::kBool: return t(kDLBool, 8);
    case DType::kF8_E4M3: return t(kDLFloat8_e4m3fn, 8);
    case DType::kF8_E5M2: return t(kDLFloat8_e5m2, 8);
    case DType::kF8_E8M0: return t(kDLFloat8_e8m0fnu, 8);
    case DType::kF8_E4M3FNUZ: return t(kDLFloat8_e4m3fnuz, 8);
    case DType::kF8_E5M2FNUZ: return t(kDLFloat8_e5m2fnuz, 8);
#endif
    default: return std::nullopt;  // sub-byte types, and what an old dlpack.h lacks
  }
}

// What a capsule owns: the tensor (and so its block or buffer), the shape and
// stride arrays DLPack points at, and the managed tensor itself.
struct Exported {
  Tensor tensor;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  DLManagedTensor legacy{};
#if PINLOAD_DLPACK_VERSIONED
  DLManagedTensorVersioned versioned{};
#endif
};

void delete_legacy(DLManagedTensor* managed) noexcept { delete static_cast<Exported*>(managed->manager_ctx); }

// A capsule that nobody consumed frees what it owns; a consumed one (renamed
// "used_...") belongs to its consumer, which calls the deleter.
void legacy_capsule_destructor(PyObject* capsule) noexcept {
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

#if PINLOAD_DLPACK_VERSIONED
void delete_versioned(DLManagedTensorVersioned* managed) noexcept {
  delete static_cast<Exported*>(managed->manager_ctx);
}

void versioned_capsule_destructor(PyObject* capsule) noexcept {
  if (PyCapsule_IsValid(capsule, kUsedVersionedCapsuleName)) return;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  auto* managed = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, kVersionedCapsuleName));
  if (managed != nullptr) {
    managed->deleter(managed);
  } else {
    PyErr_WriteUnraisable(capsule);
  }
  PyErr_Restore(type, value, traceback);
}
#endif

DLDevice dl_device_of(const Placement& placement) {
  if (placement.spec.kind == DeviceSpec::Kind::kCuda) return DLDevice{kDLCUDA, placement.spec.ordinal};
  return DLDevice{kDLCPU, 0};
}

// Whether a consumer's max_version (None or (major, minor)) takes versioned capsules.
bool wants_versioned(const py::object& max_version) {
  if (max_version.is_none()) return false;
  const py::tuple version = py::reinterpret_borrow<py::object>(max_version).cast<py::tuple>();
  if (version.size() < 1) throw py::value_error("max_version must be a (major, minor) tuple");
  return version[0].cast<long>() >= 1;
}

}  // namespace

py::object TensorExport::dlpack(const py::object& /*stream: Note [DLPack export]*/, const py::object& max_version,
                                const py::object& dl_device, const py::object& copy) const {
  const DLDevice device = dl_device_of(placement_);
  if (!dl_device.is_none()) {
    const py::tuple asked = dl_device.cast<py::tuple>();
    if (asked.size() != 2 || asked[0].cast<int>() != device.device_type || asked[1].cast<int>() != device.device_id) {
      PyErr_SetString(PyExc_BufferError, "pinload exports a tensor only on the device that holds it");
      throw py::error_already_set();
    }
  }
  if (!copy.is_none() && copy.cast<bool>()) {
    PyErr_SetString(PyExc_BufferError, "pinload exports its memory without copying (copy=True asked)");
    throw py::error_already_set();
  }
  std::unique_ptr<Exported> ctx(new Exported{tensor_, {}, {}});
  const Tensor& t = ctx->tensor;
  void* data = t.on_host() ? const_cast<std::byte*>(t.data()) : t.device_data();
  const std::optional<DLDataType> typed = as_bytes_ ? std::nullopt : dl_dtype(t.dtype());
  DLDataType dtype{kDLUInt, 8, 1};
  if (typed) {
    dtype = *typed;
    ctx->shape.assign(t.shape().begin(), t.shape().end());
  } else {
    ctx->shape.push_back(static_cast<std::int64_t>(t.nbytes()));
  }
  ctx->strides.assign(ctx->shape.size(), 1);
  for (std::size_t i = ctx->shape.size(); i-- > 1;) ctx->strides[i - 1] = ctx->strides[i] * ctx->shape[i];
  const auto ndim = static_cast<std::int32_t>(ctx->shape.size());
  const DLTensor dl{data, device, ndim, dtype, ndim ? ctx->shape.data() : nullptr,
                    ndim ? ctx->strides.data() : nullptr, 0};
  PyObject* capsule = nullptr;
#if PINLOAD_DLPACK_VERSIONED
  if (wants_versioned(max_version)) {
    ctx->versioned.version = DLPackVersion{DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
    ctx->versioned.manager_ctx = ctx.get();
    ctx->versioned.deleter = &delete_versioned;
    ctx->versioned.flags = 0;
    ctx->versioned.dl_tensor = dl;
    capsule = PyCapsule_New(&ctx->versioned, kVersionedCapsuleName, &versioned_capsule_destructor);
  }
#else
  (void)wants_versioned(max_version);
#endif
  if (capsule == nullptr && !PyErr_Occurred()) {
    ctx->legacy.dl_tensor = dl;
    ctx->legacy.manager_ctx = ctx.get();
    ctx->legacy.deleter = &delete_legacy;
    capsule = PyCapsule_New(&ctx->legacy, kCapsuleName, &legacy_capsule_destructor);
  }
  if (capsule == nullptr) throw py::error_already_set();
  ctx.release();  // the capsule owns it now
  return py::reinterpret_steal<py::object>(capsule);
}

py::tuple TensorExport::dlpack_device() const {
  const DLDevice device = dl_device_of(placement_);
  return py::make_tuple(static_cast<int>(device.device_type), device.device_id);
}

py::object export_tensor(const Tensor& t, const Placement& placement) {
  if (t.nbytes() == 0) return py::none();
  if (placement.spec.is_host()) {
    if (!t.on_host()) throw InvalidArgumentError("tensor has no host copy", ErrorContext{{}, t.name()});
    return py::cast(TensorExport(Tensor(t.name(), t.dtype(), t.shape(), t.block(), t.block_offset(), t.nbytes()),
                                 placement));
  }
  if (!t.on_device()) throw InvalidArgumentError("tensor has no device copy", ErrorContext{{}, t.name()});
  return py::cast(TensorExport(
      Tensor(t.name(), t.dtype(), t.shape(), t.device_buffer(), t.device_offset(), t.nbytes()), placement));
}

void register_dlpack(py::module_& m) {
  py::class_<TensorExport>(m, "TensorExport",
                           "One tensor's memory for DLPack consumers (torch.from_dlpack, numpy.from_dlpack): its "
                           "dtype and shape, aliased without a copy. Sub-byte dtypes go out as 1-D uint8 bytes.")
      .def("__dlpack__", &TensorExport::dlpack, py::kw_only(), py::arg("stream") = py::none(),
           py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(), py::arg("copy") = py::none())
      .def("__dlpack_device__", &TensorExport::dlpack_device)
      .def("as_bytes", &TensorExport::as_bytes,
           "The same memory as a 1-D uint8 export (for consumers that view bytes as a dtype of their own, such as "
           "numpy with ml_dtypes).")
      .def_property_readonly("nbytes", [](const TensorExport& e) { return e.tensor().nbytes(); })
      .def("__repr__", [](const TensorExport& e) {
        return "<pinload.TensorExport " + std::string(dtype_name(e.tensor().dtype())) + " " +
               std::to_string(e.tensor().nbytes()) + " bytes>";
      });
}

}  // namespace pinload::python
