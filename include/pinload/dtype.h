// pinload/dtype.h: the element types of the safetensors format.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
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

// A dtype a load may convert floating tensors to (DTypeOptions::to), as the
// CLI's --dtype, Python's dtype= (after a "torch." prefix) and the benches
// spell it.
struct DTypeSpelling {
  std::string_view text;
  DType dtype;
};
// Every spelling, ours, torch's and the format's: "bf16", "bfloat16",
// "BF16", "fp16", "float16", "half", "F16", "fp32", "float32", "float", "F32".
std::span<const DTypeSpelling> conversion_dtype_spellings() noexcept;
// The conversion dtype `text` spells; nullopt for anything else.
std::optional<DType> parse_conversion_dtype(std::string_view text) noexcept;

// One element-wise conversion (src/format/dtype_convert.h on the host, the
// device's convert_async on a device): each element becomes
// float(src) * scale, rounded to `to` exactly as torch's `.to()` rounds
// (round to nearest even; NaN stays NaN, ±Inf stays ±Inf). Sources and
// targets: F8_E4M3 and F8_E5M2 (sources only), BF16, F16, F32; see
// is_convertible. A scale other than 1 applies to fp8 sources only.
struct ElementConversion {
  DType from = DType::kF32;
  DType to = DType::kF32;
  std::uint64_t elements = 0;
  float scale = 1.0f;                 // per tensor
  // Per row, when set (float32; host or device memory as the call says):
  // element i of the tensor uses row_scales[i / row_elements]. `first` is the
  // index in its tensor of the first element converted.
  const float* row_scales = nullptr;
  std::uint64_t row_elements = 0;
  std::uint64_t first = 0;
};

// Whether an ElementConversion from `from` to `to` exists: from F8_E4M3,
// F8_E5M2, BF16, F16 or F32 to BF16, F16 or F32.
bool is_convertible(DType from, DType to) noexcept;
// Whether `dtype` is one of the floating types conversion knows.
bool is_float_dtype(DType dtype) noexcept;

}  // namespace pinload
