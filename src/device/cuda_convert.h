// Internal: the dtype conversion kernel of the CUDA device
// (src/device/cuda_convert.cu, built by nvcc when the CUDA toolkit is found).
#pragma once

#include "pinload/dtype.h"

namespace pinload::cuda {

// Launches the conversion `c` (dtype.h) of src into dst, device memory
// both, on `stream` (a cudaStream_t). Returns the launch's cudaError_t as
// an int (0: queued). Rounds as dtype_bits.h (Note [Rounding as torch]).
int launch_convert(void* dst, const void* src, const ElementConversion& c, void* stream) noexcept;

}  // namespace pinload::cuda
