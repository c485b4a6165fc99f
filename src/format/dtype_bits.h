// Internal: scalar conversions between float32 and the 8/16-bit float
// formats, as bit manipulations shared by the host loops
// (dtype_convert.cc) and the CUDA kernel (src/device/cuda_convert.cu), so
// that both round alike.
//
// Note [Rounding as torch]
// Every function here reproduces the scalar conversion torch (c10) uses for
// `.to()`: c10::BFloat16's round_to_nearest_even, c10's fp16_ieee_from_fp32
// / fp16_ieee_to_fp32 (the FP16 library's branch-free forms), and
// fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value. Widening (fp8, fp16,
// bf16 to float32) is exact. The only freedom taken is the NaN payload:
// torch's scalar and vector paths disagree on it (0x7FC0 against 0xFFFF for
// bf16), so a NaN here stays a quiet NaN with its sign; tests compare NaN as
// NaN and every other value bit for bit. These forms use float arithmetic in
// round-to-nearest with denormals kept: never build them with -ffast-math or
// nvcc --use_fast_math (flush-to-zero would break denormals).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PINLOAD_HD __host__ __device__ __forceinline__
#else
#define PINLOAD_HD inline __attribute__((always_inline))
#endif

namespace pinload::bits {

PINLOAD_HD std::uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

PINLOAD_HD float f32_from(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// ---- bf16 ----
PINLOAD_HD float bf16_to_f32(std::uint16_t h) { return f32_from(static_cast<std::uint32_t>(h) << 16); }

PINLOAD_HD std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t u = f32_bits(f);
  const std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<std::uint16_t>(nan ? ((u >> 16) | 0x0040u) : rounded);
}

// ---- fp16 (IEEE half) ----
PINLOAD_HD float f16_to_f32(std::uint16_t h) {
  const std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
  const std::uint32_t sign = w & 0x80000000u;
  const std::uint32_t two_w = w + w;
  const std::uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = f32_from(0x7800000u);  // 0x1.0p-112f
  const float normalized = f32_from((two_w >> 4) + exp_offset) * exp_scale;
  const std::uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = f32_from((two_w >> 17) | magic_mask) - magic_bias;
  const std::uint32_t denormalized_cutoff = 1u << 27;
  const std::uint32_t result = sign | (two_w < denormalized_cutoff ? f32_bits(denormalized) : f32_bits(normalized));
  return f32_from(result);
}

PINLOAD_HD std::uint16_t f32_to_f16(float f) {
  const float scale_to_inf = f32_from(0x77800000u);   // 0x1.0p+112f
  const float scale_to_zero = f32_from(0x08800000u);  // 0x1.0p-110f
  const std::uint32_t w = f32_bits(f);
  const float abs_f = f32_from(w & 0x7FFFFFFFu);
  float base = (abs_f * scale_to_inf) * scale_to_zero;
  const std::uint32_t shl1_w = w + w;
  const std::uint32_t sign = w & 0x80000000u;
  std::uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = f32_from((bias >> 1) + 0x07800000u) + base;
  const std::uint32_t b = f32_bits(base);
  const std::uint32_t exp_bits = (b >> 13) & 0x00007C00u;
  const std::uint32_t mantissa_bits = b & 0x00000FFFu;
  const std::uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<std::uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// ---- fp8 e4m3fn: bias 7, no infinities, 0x7F/0xFF are NaN ----
PINLOAD_HD float e4m3_to_f32(std::uint8_t b) {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t em = b & 0x7Fu;
  // Normal: rebias the exponent (7 -> 127) and widen the mantissa (3 -> 23).
  const std::uint32_t normal = (em << 20) + ((127u - 7u) << 23);
  // Subnormal: mantissa * 2^-9, exact in float.
  const float sub = static_cast<float>(em) * f32_from(0x3B000000u);  // 2^-9
  const std::uint32_t mag = em == 0x7Fu ? 0x7FC00000u : (em < 8u ? f32_bits(sub) : normal);
  return f32_from(sign | mag);
}

// Values of magnitude >= 480 saturate to 448 (torch >= 2.9); callers clamp
// to ±448 first anyway (Note [FP8 clamp] in convert.h).
PINLOAD_HD std::uint8_t f32_to_e4m3(float f) {
  const std::uint32_t fp8_max = 1087u << 20;
  const std::uint32_t denorm_mask = 141u << 23;
  std::uint32_t f_bits = f32_bits(f);
  const std::uint32_t sign = f_bits & 0x80000000u;
  f_bits ^= sign;
  std::uint8_t result;
  if (f_bits >= fp8_max) {
    result = f_bits > 0x7F800000u ? 0x7F : 0x7E;
  } else if (f_bits < (121u << 23)) {
    const std::uint32_t d = f32_bits(f32_from(f_bits) + f32_from(denorm_mask));
    result = static_cast<std::uint8_t>(d - denorm_mask);
  } else {
    const std::uint32_t mant_odd = (f_bits >> 20) & 1u;
    f_bits += ((7u - 127u) << 23) + 0x7FFFFu;
    f_bits += mant_odd;
    result = static_cast<std::uint8_t>(f_bits >> 20);
    if (result == 0x7F) result = 0x7E;
  }
  return static_cast<std::uint8_t>(result | (sign >> 24));
}

// ---- fp8 e5m2: the top byte of an fp16 ----
PINLOAD_HD float e5m2_to_f32(std::uint8_t b) { return f16_to_f32(static_cast<std::uint16_t>(b << 8)); }

PINLOAD_HD std::uint8_t f32_to_e5m2(float f) {
  const std::uint32_t fp32_inf = 255u << 23;
  const std::uint32_t fp8_max = 143u << 23;
  const std::uint32_t denorm_mask = 134u << 23;
  std::uint32_t f_bits = f32_bits(f);
  const std::uint32_t sign = f_bits & 0x80000000u;
  f_bits ^= sign;
  std::uint8_t result;
  if (f_bits >= fp8_max) {
    result = f_bits > fp32_inf ? 0x7F : 0x7C;
  } else if (f_bits < (113u << 23)) {
    const std::uint32_t d = f32_bits(f32_from(f_bits) + f32_from(denorm_mask));
    result = static_cast<std::uint8_t>(d - denorm_mask);
  } else {
    const std::uint32_t mant_odd = (f_bits >> 21) & 1u;
    f_bits += ((15u - 127u) << 23) + 0xFFFFFu;
    f_bits += mant_odd;
    result = static_cast<std::uint8_t>(f_bits >> 21);
  }
  return static_cast<std::uint8_t>(result | (sign >> 24));
}

}  // namespace pinload::bits
