// Internal to the command-line programs: CLI11's check of a --dtype, over
// the library's one table of spellings (conversion_dtype_spellings in dtype.h).
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "pinload/dtype.h"

namespace pinload::cli {

// Exactly the spellings parse_conversion_dtype takes.
inline CLI::Validator dtype_validator() {
  std::vector<std::string> spellings;
  for (const DTypeSpelling& s : conversion_dtype_spellings()) spellings.emplace_back(s.text);
  return CLI::IsMember(spellings).description("");
}

}  // namespace pinload::cli
