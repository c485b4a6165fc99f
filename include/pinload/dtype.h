// pinload/dtype.h: the element types of the safetensors format.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace pinload {

enum class DType : std::uint8_t {
  kBool, kU8, kI8, kI16, kU16, kI32, kU32, kI64, kU64,
  kF16, kBF16, kF32, kF64, kC64,
  kF8_E4M3, kF8_E5M2, kF8_E8M0, kF8_E4M3FNUZ, kF8_E5M2FNUZ,
  kF4, kF6_E2M3, kF6_E3M2,
};

inline constexpr int kDTypeCount = 22;

// The format's spelling: "BF16", "F8_E4M3", ...
std::string_view dtype_name(DType dtype) noexcept;
// Parses the format's spelling (case-sensitive); nullopt when unknown.
std::optional<DType> dtype_from_name(std::string_view name) noexcept;
// Size of one element in bits: 4 for F4, 6 for F6_*, 8..128 otherwise.
unsigned dtype_bits(DType dtype) noexcept;

}  // namespace pinload
