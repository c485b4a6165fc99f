// Internal: the CUDA device's dtype conversion kernels. They are built by nvcc
// into a fat binary (src/device/cuda_convert.cu, device code only) that is
// embedded in the library and loaded with cudaLibraryLoadData on first use, so
// that no pinload binary links the CUDA runtime (Note [CUDA at run time]).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>

#include "pinload/dtype.h"

namespace pinload::cuda {

// One launch of a conversion kernel: what cudaLaunchKernel takes, with the
// kernel's arguments held here (args() points into this object).
struct KernelLaunch {
  const void* kernel = nullptr;  // a cudaKernel_t, which cudaLaunchKernel accepts as its function
  dim3 grid;
  dim3 block;
  const void* src = nullptr;
  void* dst = nullptr;
  std::uint64_t elements = 0;
  float scale = 1.0f;
  const float* row_scales = nullptr;  // device memory, or null
  std::uint64_t row_elements = 0;
  std::uint64_t first = 0;

  std::array<void*, 7> args() { return {&src, &dst, &elements, &scale, &row_scales, &row_elements, &first}; }
};

// The launch of conversion `c` (dtype.h) of src into dst, device memory both;
// rounds as dtype_bits.h (Note [Rounding as torch]). Loads the kernels on the
// first call. Throws DeviceError where pinload was built without them, where
// the pair has no kernel, or where the runtime cannot load them.
KernelLaunch convert_launch(void* dst, const void* src, const ElementConversion& c);

}  // namespace pinload::cuda
