// Internal to the command-line programs: the spellings of a load's --dtype.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pinload/dtype.h"

namespace pinload::cli {

// Every spelling of a --dtype: ours, torch's and the format's.
inline constexpr std::pair<std::string_view, DType> kDTypeSpellings[] = {
    {"bf16", DType::kBF16}, {"bfloat16", DType::kBF16}, {"BF16", DType::kBF16},
    {"fp16", DType::kF16},  {"float16", DType::kF16},   {"half", DType::kF16},  {"F16", DType::kF16},
    {"fp32", DType::kF32},  {"float32", DType::kF32},   {"float", DType::kF32}, {"F32", DType::kF32},
};

// The dtype `text` spells; nullopt for anything else.
inline std::optional<DType> parse_dtype_arg(std::string_view text) {
  for (const auto& [spelling, dtype] : kDTypeSpellings) {
    if (text == spelling) return dtype;
  }
  return std::nullopt;
}

// CLI11's check of a --dtype: exactly the spellings above.
inline CLI::Validator dtype_validator() {
  std::vector<std::string> spellings;
  for (const auto& [spelling, dtype] : kDTypeSpellings) spellings.emplace_back(spelling);
  return CLI::IsMember(spellings).description("");
}

}  // namespace pinload::cli
