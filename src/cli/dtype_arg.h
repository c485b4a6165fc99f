// Internal to the command-line programs: the spellings of a load's --dtype.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string_view>

#include "pinload/dtype.h"

namespace pinload::cli {

// bf16|bfloat16, fp16|float16|half, fp32|float32|float, or the format's
// spelling (BF16, F16, F32); nullopt for anything else.
inline std::optional<DType> parse_dtype_arg(std::string_view text) {
  if (text == "bf16" || text == "bfloat16" || text == "BF16") return DType::kBF16;
  if (text == "fp16" || text == "float16" || text == "half" || text == "F16") return DType::kF16;
  if (text == "fp32" || text == "float32" || text == "float" || text == "F32") return DType::kF32;
  return std::nullopt;
}

// CLI11's check of a --dtype: exactly the spellings parse_dtype_arg takes.
inline CLI::Validator dtype_validator() {
  return CLI::IsMember({"bf16", "bfloat16", "BF16", "fp16", "float16", "half", "F16", "fp32", "float32", "float", "F32"})
      .description("");
}

}  // namespace pinload::cli
