// Internal to the command-line programs (pinload, pinload-bench): sizes such
// as "4096", "256K", "2M" or "1GiB" on the command line.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace pinload::cli {

// The size `text` names, in bytes; nullopt when it is not a size.
inline std::optional<std::uint64_t> parse_size_arg(const std::string& text) {
  std::size_t pos = 0;
  std::uint64_t value = 0;
  try {
    value = std::stoull(text, &pos);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const std::string unit = text.substr(pos);
  if (unit.empty()) return value;
  if (unit == "K" || unit == "k" || unit == "KiB") return value << 10;
  if (unit == "M" || unit == "m" || unit == "MiB") return value << 20;
  if (unit == "G" || unit == "g" || unit == "GiB") return value << 30;
  return std::nullopt;
}

}  // namespace pinload::cli
