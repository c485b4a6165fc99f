// Finds and launches the conversion kernels of the embedded fat binary
// (device/cuda_convert.h).
#include "device/cuda_convert.h"

#include <mutex>
#include <string>

#include "device/cuda_runtime.h"
#include "pinload/error.h"

#if defined(PINLOAD_CUDA_FATBIN)
// nvcc's fat binary of cuda_convert.cu (CMakeLists.txt), kept in this object's read-only data.
__asm__(".pushsection .rodata\n"
        ".balign 64\n"
        ".globl pinload_cuda_convert_fatbin\n"
        ".hidden pinload_cuda_convert_fatbin\n"
        "pinload_cuda_convert_fatbin:\n"
        ".incbin \"" PINLOAD_CUDA_FATBIN "\"\n"
        ".popsection\n");
extern "C" __attribute__((visibility("hidden"))) const unsigned char pinload_cuda_convert_fatbin[];
#endif

namespace pinload::cuda {
namespace {

const char* type_name(DType t) {
  switch (t) {
    case DType::kF8_E4M3: return "E4M3";
    case DType::kF8_E5M2: return "E5M2";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF32: return "F32";
    default: return nullptr;
  }
}

bool is_target(DType t) { return t == DType::kBF16 || t == DType::kF16 || t == DType::kF32; }

#if defined(PINLOAD_CUDA_FATBIN)
// The library, loaded once for every device (cudaLibraryLoadData is context-independent).
cudaLibrary_t library(const Runtime& rt) {
  static std::once_flag once;
  static cudaLibrary_t loaded = nullptr;
  static cudaError_t error = cudaSuccess;
  std::call_once(once, [&] {
    error = rt.cudaLibraryLoadData(&loaded, pinload_cuda_convert_fatbin, nullptr, nullptr, 0, nullptr, nullptr, 0);
    if (error != cudaSuccess) (void)rt.cudaGetLastError();
  });
  if (error != cudaSuccess) {
    throw DeviceError(std::string("cudaLibraryLoadData (the conversion kernels) failed: ") + rt.cudaGetErrorName(error) +
                      ": " + rt.cudaGetErrorString(error));
  }
  return loaded;
}
#endif

}  // namespace

KernelLaunch convert_launch(void* dst, const void* src, const ElementConversion& c) {
  const char* from = type_name(c.from);
  if (from == nullptr || !is_target(c.to)) {
    throw DeviceError(std::string("no CUDA conversion kernel from ") + std::string(dtype_name(c.from)) + " to " +
                      std::string(dtype_name(c.to)));
  }
#if defined(PINLOAD_CUDA_FATBIN)
  const Runtime& rt = require_runtime("the CUDA conversion kernels");
  const std::string name = std::string("pinload_convert_") + from + "_to_" + type_name(c.to);
  KernelLaunch launch;
  cudaKernel_t kernel = nullptr;
  if (const cudaError_t err = rt.cudaLibraryGetKernel(&kernel, library(rt), name.c_str()); err != cudaSuccess) {
    (void)rt.cudaGetLastError();
    throw DeviceError("cudaLibraryGetKernel(" + name + ") failed: " + rt.cudaGetErrorName(err) + ": " +
                      rt.cudaGetErrorString(err));
  }
  constexpr unsigned kThreads = 256;
  constexpr std::uint64_t kMaxBlocks = 65535u * 8;
  const std::uint64_t blocks = (c.elements + kThreads - 1) / kThreads;
  launch.kernel = reinterpret_cast<const void*>(kernel);
  launch.grid = dim3(static_cast<unsigned>(blocks < kMaxBlocks ? (blocks == 0 ? 1 : blocks) : kMaxBlocks));
  launch.block = dim3(kThreads);
  launch.src = src;
  launch.dst = dst;
  launch.elements = c.elements;
  launch.scale = c.scale;
  launch.row_scales = c.row_elements != 0 ? c.row_scales : nullptr;
  launch.row_elements = c.row_elements;
  launch.first = c.first;
  return launch;
#else
  (void)dst, (void)src;
  throw DeviceError("pinload was built without the CUDA conversion kernels (no nvcc)");
#endif
}

}  // namespace pinload::cuda
