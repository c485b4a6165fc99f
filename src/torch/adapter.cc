// pinload::torch: StateDict tensors as zero-copy at::Tensors (pinload/torch.h),
// and a DeviceAllocator over torch's CUDA caching allocator.
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "pinload/error.h"
#include "pinload/torch.h"

#if PINLOAD_TORCH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace pinload {
namespace {

ErrorContext context_of(const Tensor& t) {
  ErrorContext context;
  context.tensor = t.name();
  return context;
}

// The CUDA ordinal that owns device memory `ptr`, or -1 when it is host memory
// (the "sim" device). See Note [Placement].
int cuda_ordinal_of(const Tensor& t, const void* ptr) {
#if PINLOAD_TORCH_CUDA
  if (!at::hasCUDA()) return -1;  // no GPU visible: device memory can only be "sim"
  cudaPointerAttributes attributes{};
  const cudaError_t err = cudaPointerGetAttributes(&attributes, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw DeviceError(std::string("cudaPointerGetAttributes: ") + cudaGetErrorString(err), context_of(t));
  }
  if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) return attributes.device;
  return -1;
#else
  (void)ptr;
  if (cuda_available()) {
    throw DeviceError(
        "pinload::torch was built against a torch without CUDA and cannot tell whether this "
        "device tensor is CUDA memory; use TorchPlacement::kHost or a CUDA build of torch",
        context_of(t));
  }
  return -1;
#endif
}

std::vector<std::int64_t> sizes_of(const Tensor& t) {
  std::vector<std::int64_t> sizes;
  sizes.reserve(t.shape().size());
  for (std::uint64_t dim : t.shape()) {
    if (dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      throw InvalidFileError("dimension " + std::to_string(dim) + " does not fit torch's int64 sizes", context_of(t));
    }
    sizes.push_back(static_cast<std::int64_t>(dim));
  }
  return sizes;
}

std::vector<std::int64_t> contiguous_strides(const std::vector<std::int64_t>& sizes) {
  std::vector<std::int64_t> strides(sizes.size());
  std::int64_t stride = 1;
  for (std::size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= sizes[i] > 0 ? sizes[i] : 1;
  }
  return strides;
}

}  // namespace

std::optional<at::ScalarType> torch_dtype(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBool:
      return at::kBool;
    case DType::kU8:
      return at::kByte;
    case DType::kI8:
      return at::kChar;
    case DType::kI16:
      return at::kShort;
    case DType::kU16:
      return at::kUInt16;
    case DType::kI32:
      return at::kInt;
    case DType::kU32:
      return at::kUInt32;
    case DType::kI64:
      return at::kLong;
    case DType::kU64:
      return at::kUInt64;
    case DType::kF16:
      return at::kHalf;
    case DType::kBF16:
      return at::kBFloat16;
    case DType::kF32:
      return at::kFloat;
    case DType::kF64:
      return at::kDouble;
    case DType::kC64:
      return at::kComplexFloat;
    case DType::kF8_E4M3:
      return at::ScalarType::Float8_e4m3fn;
    case DType::kF8_E5M2:
      return at::ScalarType::Float8_e5m2;
    case DType::kF8_E8M0:
      return at::ScalarType::Float8_e8m0fnu;
    case DType::kF8_E4M3FNUZ:
      return at::ScalarType::Float8_e4m3fnuz;
    case DType::kF8_E5M2FNUZ:
      return at::ScalarType::Float8_e5m2fnuz;
    case DType::kF4:
    case DType::kF6_E2M3:
    case DType::kF6_E3M2:
      return std::nullopt;
  }
  return std::nullopt;
}

at::Tensor to_torch(const Tensor& t, TorchPlacement where) {
  const std::optional<at::ScalarType> scalar = torch_dtype(t.dtype());
  if (!scalar) {
    throw InvalidFileError(
        "dtype " + std::string(dtype_name(t.dtype())) + " of tensor '" + t.name() + "' has no torch equivalent",
        context_of(t));
  }
  bool use_device = false;
  switch (where) {
    case TorchPlacement::kAuto:
      use_device = t.on_device();
      break;
    case TorchPlacement::kHost:
      if (!t.on_host()) throw InvalidArgumentError("tensor '" + t.name() + "' is not on the host", context_of(t));
      break;
    case TorchPlacement::kDevice:
      if (!t.on_device()) throw InvalidArgumentError("tensor '" + t.name() + "' is not on a device", context_of(t));
      use_device = true;
      break;
  }
  if (!use_device && !t.on_host()) {
    throw InvalidArgumentError("tensor '" + t.name() + "' has no memory to alias", context_of(t));
  }

  const std::vector<std::int64_t> sizes = sizes_of(t);
  void* data = use_device ? t.device_data() : const_cast<std::byte*>(t.data());
  at::TensorOptions options = at::TensorOptions().dtype(*scalar);
  if (use_device) {
    const int ordinal = cuda_ordinal_of(t, data);
    options = ordinal >= 0 ? options.device(at::Device(at::kCUDA, static_cast<at::DeviceIndex>(ordinal)))
                           : options.device(at::kCPU);
  } else {
    options = options.device(at::kCPU);
  }

  std::int64_t numel = 1;
  for (std::int64_t s : sizes) numel *= s;
  if (numel == 0) return at::empty(sizes, options);
  const std::uint64_t expected = static_cast<std::uint64_t>(numel) * at::elementSize(*scalar);
  if (expected != t.nbytes()) {
    throw InvalidFileError("tensor '" + t.name() + "' has " + std::to_string(t.nbytes()) + " bytes, its shape needs " +
                               std::to_string(expected),
                           context_of(t));
  }

  // The deleter owns a reference to the memory (Note [Aliasing]).
  std::function<void(void*)> deleter;
  if (use_device) {
    deleter = [keep = t.device_buffer()](void*) {};
  } else {
    deleter = [keep = t.block()](void*) {};
  }
  return at::from_blob(data, sizes, contiguous_strides(sizes), deleter, options);
}

std::vector<std::pair<std::string, at::Tensor>> to_torch(const StateDict& sd, TorchPlacement where) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.reserve(sd.size());
  for (const Tensor& t : sd) out.emplace_back(t.name(), to_torch(t, where));
  return out;
}

torch::OrderedDict<std::string, at::Tensor> to_torch_ordered_dict(const StateDict& sd, TorchPlacement where) {
  torch::OrderedDict<std::string, at::Tensor> out("Tensor");
  out.reserve(sd.size());
  for (const Tensor& t : sd) out.insert(t.name(), to_torch(t, where));
  return out;
}

std::unordered_map<std::string, at::Tensor> to_torch_map(const StateDict& sd, TorchPlacement where) {
  std::unordered_map<std::string, at::Tensor> out;
  out.reserve(sd.size());
  for (const Tensor& t : sd) out.emplace(t.name(), to_torch(t, where));
  return out;
}

bool torch_built_with_cuda() noexcept {
#if PINLOAD_TORCH_CUDA
  return true;
#else
  return false;
#endif
}

#if PINLOAD_TORCH_CUDA
namespace {

class TorchCudaAllocator final : public DeviceAllocator {
 public:
  explicit TorchCudaAllocator(int ordinal) : ordinal_(ordinal), name_("torch:cuda:" + std::to_string(ordinal)) {}

  void* allocate(std::size_t bytes) override {
    try {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(ordinal_));
      const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ordinal_)).stream();
      return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, stream);
    } catch (const c10::OutOfMemoryError& e) {
      throw OutOfMemoryError(std::string("torch CUDA caching allocator: ") + e.what_without_backtrace());
    } catch (const c10::Error& e) {
      throw DeviceError(std::string("torch CUDA caching allocator: ") + e.what_without_backtrace());
    }
  }
  void deallocate(void* data, std::size_t /*bytes*/) noexcept override {
    try {
      c10::cuda::CUDACachingAllocator::raw_delete(data);
    } catch (...) {  // never throws (device.h); the caching allocator keeps the block
    }
  }
  std::string_view name() const noexcept override { return name_; }

 private:
  int ordinal_;
  std::string name_;
};

}  // namespace

std::shared_ptr<DeviceAllocator> torch_cuda_allocator(int ordinal) {
  const int count = static_cast<int>(c10::cuda::device_count());
  if (ordinal < 0 || ordinal >= count) {
    throw DeviceError("torch_cuda_allocator: no CUDA device " + std::to_string(ordinal) + " (torch sees " +
                      std::to_string(count) + ")");
  }
  // The caching allocator is set up by torch's lazy CUDA initialisation, which a C++ program
  // that has made no CUDA tensor yet has not run ("Allocator not initialized for device").
  try {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  } catch (const c10::Error& e) {
    throw DeviceError(std::string("torch_cuda_allocator: torch's CUDA initialisation failed: ") +
                      e.what_without_backtrace());
  }
  return std::make_shared<TorchCudaAllocator>(ordinal);
}
#else
std::shared_ptr<DeviceAllocator> torch_cuda_allocator(int /*ordinal*/) {
  throw DeviceError("torch_cuda_allocator: pinload::torch was built against a torch without CUDA");
}
#endif

}  // namespace pinload
