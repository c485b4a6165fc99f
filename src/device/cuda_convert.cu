// The CUDA device's dtype conversion kernels (device code only: nvcc -fatbin,
// embedded and loaded by src/device/cuda_convert.cc): one thread per element,
// with the same bit manipulations as the host loops (src/format/dtype_bits.h),
// so that both round alike (Note [Rounding as torch]). Built without
// --use_fast_math: flush-to-zero would break denormals.
#include <cstdint>
#include <cstring>

#include "format/dtype_bits.h"

namespace pinload::cuda {
namespace {

// Elements of 2 and 4 bytes may sit at any offset: a safetensors file packs its tensors with
// no padding, and the device copy keeps the file's layout. Whether a pointer is aligned is the
// same for every thread of a launch, so the branch costs nothing where it is.
template <class T>
__device__ T load(const std::uint8_t* p, std::uint64_t i) {
  if ((reinterpret_cast<std::uintptr_t>(p) & (sizeof(T) - 1)) == 0) return reinterpret_cast<const T*>(p)[i];
  T v;
  memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}
template <class T>
__device__ void store(std::uint8_t* p, std::uint64_t i, T v) {
  if ((reinterpret_cast<std::uintptr_t>(p) & (sizeof(T) - 1)) == 0) {
    reinterpret_cast<T*>(p)[i] = v;
  } else {
    memcpy(p + i * sizeof(T), &v, sizeof(T));
  }
}

struct E4M3 { __device__ static float get(const std::uint8_t* p, std::uint64_t i) { return bits::e4m3_to_f32(p[i]); } };
struct E5M2 { __device__ static float get(const std::uint8_t* p, std::uint64_t i) { return bits::e5m2_to_f32(p[i]); } };
struct BF16 {
  __device__ static float get(const std::uint8_t* p, std::uint64_t i) { return bits::bf16_to_f32(load<std::uint16_t>(p, i)); }
  __device__ static void put(std::uint8_t* p, std::uint64_t i, float f) { store<std::uint16_t>(p, i, bits::f32_to_bf16(f)); }
};
struct F16 {
  __device__ static float get(const std::uint8_t* p, std::uint64_t i) { return bits::f16_to_f32(load<std::uint16_t>(p, i)); }
  __device__ static void put(std::uint8_t* p, std::uint64_t i, float f) { store<std::uint16_t>(p, i, bits::f32_to_f16(f)); }
};
struct F32 {
  __device__ static float get(const std::uint8_t* p, std::uint64_t i) { return load<float>(p, i); }
  __device__ static void put(std::uint8_t* p, std::uint64_t i, float f) { store<float>(p, i, f); }
};

// Scaled: fp8 sources (x * scale, or x * the row's scale); unscaled: widening and narrowing.
template <class In, class Out, bool kScaled>
__device__ void convert(const std::uint8_t* src, std::uint8_t* dst, std::uint64_t n, float scale,
                        const float* row_scales, std::uint64_t row_elements, std::uint64_t first) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v = In::get(src, i);
    if constexpr (kScaled) v *= row_scales != nullptr ? row_scales[(first + i) / row_elements] : scale;
    Out::put(dst, i, v);
  }
}

}  // namespace
}  // namespace pinload::cuda

// One unmangled kernel per pair, found by name (cuda_convert.cc's kernel_name).
#define PINLOAD_CONVERT_KERNEL(in, out, scaled)                                                                 \
  extern "C" __global__ void pinload_convert_##in##_to_##out(                                                   \
      const std::uint8_t* src, std::uint8_t* dst, std::uint64_t n, float scale, const float* row_scales,        \
      std::uint64_t row_elements, std::uint64_t first) {                                                        \
    pinload::cuda::convert<pinload::cuda::in, pinload::cuda::out, scaled>(src, dst, n, scale, row_scales,       \
                                                                          row_elements, first);                 \
  }
#define PINLOAD_CONVERT_KERNELS_TO(out)   \
  PINLOAD_CONVERT_KERNEL(E4M3, out, true) \
  PINLOAD_CONVERT_KERNEL(E5M2, out, true) \
  PINLOAD_CONVERT_KERNEL(BF16, out, false) \
  PINLOAD_CONVERT_KERNEL(F16, out, false) \
  PINLOAD_CONVERT_KERNEL(F32, out, false)
PINLOAD_CONVERT_KERNELS_TO(BF16)
PINLOAD_CONVERT_KERNELS_TO(F16)
PINLOAD_CONVERT_KERNELS_TO(F32)
