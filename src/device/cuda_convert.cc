// Finds and launches the conversion kernels of the embedded fat binary
// (device/cuda_convert.h).
#include "device/cuda_convert.h"

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

// The kernels' dtypes, in the order of the table below; -1: none.
int source_index(DType t) {
  switch (t) {
    case DType::kF8_E4M3: return 0;
    case DType::kF8_E5M2: return 1;
    case DType::kBF16: return 2;
    case DType::kF16: return 3;
    case DType::kF32: return 4;
    default: return -1;
  }
}
int target_index(DType t) { return t == DType::kBF16 ? 0 : t == DType::kF16 ? 1 : t == DType::kF32 ? 2 : -1; }

#if defined(PINLOAD_CUDA_FATBIN)
constexpr const char* kSourceNames[] = {"E4M3", "E5M2", "BF16", "F16", "F32"};
constexpr const char* kTargetNames[] = {"BF16", "F16", "F32"};

// The library, loaded once for every device (cudaLibraryLoadData is context-independent), and
// each of its kernels, found by name once.
struct Kernels {
  cudaKernel_t by_pair[5][3] = {};
  std::string error;  // why they could not be loaded; "" once they are
};

const Kernels& kernels(const Runtime& rt) {
  static const Kernels loaded = [&] {
    Kernels k;
    const auto failed = [&](const std::string& call, cudaError_t err) {
      (void)rt.cudaGetLastError();
      k.error = call + " failed: " + rt.cudaGetErrorName(err) + ": " + rt.cudaGetErrorString(err);
      return k;
    };
    cudaLibrary_t library = nullptr;
    if (const cudaError_t err =
            rt.cudaLibraryLoadData(&library, pinload_cuda_convert_fatbin, nullptr, nullptr, 0, nullptr, nullptr, 0);
        err != cudaSuccess) {
      return failed("cudaLibraryLoadData (the conversion kernels)", err);
    }
    for (int i = 0; i < 5; ++i) {
      for (int j = 0; j < 3; ++j) {
        const std::string name = std::string("pinload_convert_") + kSourceNames[i] + "_to_" + kTargetNames[j];
        if (const cudaError_t err = rt.cudaLibraryGetKernel(&k.by_pair[i][j], library, name.c_str()); err != cudaSuccess) {
          return failed("cudaLibraryGetKernel(" + name + ")", err);
        }
      }
    }
    return k;
  }();
  if (!loaded.error.empty()) throw DeviceError(loaded.error);
  return loaded;
}
#endif

}  // namespace

KernelLaunch convert_launch(void* dst, const void* src, const ElementConversion& c) {
  const int from = source_index(c.from), to = target_index(c.to);
  if (from < 0 || to < 0) {
    throw DeviceError(std::string("no CUDA conversion kernel from ") + std::string(dtype_name(c.from)) + " to " +
                      std::string(dtype_name(c.to)));
  }
#if defined(PINLOAD_CUDA_FATBIN)
  const Runtime& rt = require_runtime("the CUDA conversion kernels");
  KernelLaunch launch;
  const cudaKernel_t kernel = kernels(rt).by_pair[from][to];
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
