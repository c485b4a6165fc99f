// The CUDA device's dtype conversion kernel: one thread per element, with
// the same bit manipulations as the host loops (src/format/dtype_bits.h), so
// that both round alike (Note [Rounding as torch]). Built without
// --use_fast_math: flush-to-zero would break denormals.
#include <cuda_runtime.h>

#include <cstdint>

#include "device/cuda_convert.h"
#include "format/dtype_bits.h"

namespace pinload::cuda {
namespace {

struct E4M3 { __device__ static float get(const std::uint8_t* p, std::uint64_t i) { return bits::e4m3_to_f32(p[i]); } };
struct E5M2 { __device__ static float get(const std::uint8_t* p, std::uint64_t i) { return bits::e5m2_to_f32(p[i]); } };
struct BF16 {
  __device__ static float get(const std::uint8_t* p, std::uint64_t i) {
    return bits::bf16_to_f32(reinterpret_cast<const std::uint16_t*>(p)[i]);
  }
  __device__ static void put(std::uint8_t* p, std::uint64_t i, float f) {
    reinterpret_cast<std::uint16_t*>(p)[i] = bits::f32_to_bf16(f);
  }
};
struct F16 {
  __device__ static float get(const std::uint8_t* p, std::uint64_t i) {
    return bits::f16_to_f32(reinterpret_cast<const std::uint16_t*>(p)[i]);
  }
  __device__ static void put(std::uint8_t* p, std::uint64_t i, float f) {
    reinterpret_cast<std::uint16_t*>(p)[i] = bits::f32_to_f16(f);
  }
};
struct F32 {
  __device__ static float get(const std::uint8_t* p, std::uint64_t i) { return reinterpret_cast<const float*>(p)[i]; }
  __device__ static void put(std::uint8_t* p, std::uint64_t i, float f) { reinterpret_cast<float*>(p)[i] = f; }
};

// Scaled: fp8 sources (x * scale); unscaled: widening and narrowing.
template <class In, class Out, bool kScaled>
__global__ void convert_kernel(const std::uint8_t* src, std::uint8_t* dst, std::uint64_t n, float scale,
                               const float* row_scales, std::uint64_t row_elements, std::uint64_t first) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v = In::get(src, i);
    if constexpr (kScaled) v *= row_scales != nullptr ? row_scales[(first + i) / row_elements] : scale;
    Out::put(dst, i, v);
  }
}

template <class In, class Out, bool kScaled>
int launch(void* dst, const void* src, const ElementConversion& c, cudaStream_t stream) {
  constexpr unsigned kThreads = 256;
  const std::uint64_t blocks_needed = (c.elements + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(blocks_needed < 65535u * 8 ? blocks_needed : 65535u * 8);
  const float* rows = c.row_elements != 0 ? c.row_scales : nullptr;
  convert_kernel<In, Out, kScaled><<<blocks, kThreads, 0, stream>>>(static_cast<const std::uint8_t*>(src),
                                                                    static_cast<std::uint8_t*>(dst), c.elements,
                                                                    c.scale, rows, c.row_elements, c.first);
  return static_cast<int>(cudaGetLastError());
}

template <class Out>
int launch_to(void* dst, const void* src, const ElementConversion& c, cudaStream_t stream) {
  switch (c.from) {
    case DType::kF8_E4M3: return launch<E4M3, Out, true>(dst, src, c, stream);
    case DType::kF8_E5M2: return launch<E5M2, Out, true>(dst, src, c, stream);
    case DType::kBF16: return launch<BF16, Out, false>(dst, src, c, stream);
    case DType::kF16: return launch<F16, Out, false>(dst, src, c, stream);
    case DType::kF32: return launch<F32, Out, false>(dst, src, c, stream);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace

int launch_convert(void* dst, const void* src, const ElementConversion& c, void* stream) noexcept {
  auto s = static_cast<cudaStream_t>(stream);
  switch (c.to) {
    case DType::kBF16: return launch_to<BF16>(dst, src, c, s);
    case DType::kF16: return launch_to<F16>(dst, src, c, s);
    case DType::kF32: return launch_to<F32>(dst, src, c, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace pinload::cuda
