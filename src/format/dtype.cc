#include "pinload/dtype.h"

#include <array>

namespace pinload {
namespace {

struct DTypeSpec {
  DType dtype;
  std::string_view name;
  unsigned bits;
};

constexpr std::array<DTypeSpec, kDTypeCount> kSpecs{{
    {DType::kBool, "BOOL", 8},
    {DType::kU8, "U8", 8},
    {DType::kI8, "I8", 8},
    {DType::kI16, "I16", 16},
    {DType::kU16, "U16", 16},
    {DType::kI32, "I32", 32},
    {DType::kU32, "U32", 32},
    {DType::kI64, "I64", 64},
    {DType::kU64, "U64", 64},
    {DType::kF16, "F16", 16},
    {DType::kBF16, "BF16", 16},
    {DType::kF32, "F32", 32},
    {DType::kF64, "F64", 64},
    {DType::kC64, "C64", 64},
    {DType::kF8_E4M3, "F8_E4M3", 8},
    {DType::kF8_E5M2, "F8_E5M2", 8},
    {DType::kF8_E8M0, "F8_E8M0", 8},
    {DType::kF8_E4M3FNUZ, "F8_E4M3FNUZ", 8},
    {DType::kF8_E5M2FNUZ, "F8_E5M2FNUZ", 8},
    {DType::kF4, "F4", 4},
    {DType::kF6_E2M3, "F6_E2M3", 6},
    {DType::kF6_E3M2, "F6_E3M2", 6},
}};

constexpr bool specs_in_enum_order() {
  for (std::size_t i = 0; i < kSpecs.size(); ++i) {
    if (static_cast<std::size_t>(kSpecs[i].dtype) != i) return false;
  }
  return true;
}
static_assert(specs_in_enum_order(), "kSpecs must list DType in declaration order");

}  // namespace

std::string_view dtype_name(DType dtype) noexcept {
  return kSpecs[static_cast<std::size_t>(dtype)].name;
}

std::optional<DType> dtype_from_name(std::string_view name) noexcept {
  for (const DTypeSpec& spec : kSpecs) {
    if (spec.name == name) return spec.dtype;
  }
  return std::nullopt;
}

unsigned dtype_bits(DType dtype) noexcept { return kSpecs[static_cast<std::size_t>(dtype)].bits; }

std::span<const DTypeSpelling> conversion_dtype_spellings() noexcept {
  static constexpr DTypeSpelling kSpellings[] = {
      {"bf16", DType::kBF16}, {"bfloat16", DType::kBF16}, {"BF16", DType::kBF16},
      {"fp16", DType::kF16},  {"float16", DType::kF16},   {"half", DType::kF16},  {"F16", DType::kF16},
      {"fp32", DType::kF32},  {"float32", DType::kF32},   {"float", DType::kF32}, {"F32", DType::kF32},
  };
  return kSpellings;
}

std::optional<DType> parse_conversion_dtype(std::string_view text) noexcept {
  for (const DTypeSpelling& s : conversion_dtype_spellings()) {
    if (s.text == text) return s.dtype;
  }
  return std::nullopt;
}

}  // namespace pinload
