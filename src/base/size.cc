#include "pinload/size.h"

#include <charconv>
#include <limits>
#include <string>

#include "pinload/error.h"

namespace pinload {

std::optional<std::uint64_t> parse_size(std::string_view text) noexcept {
  std::uint64_t value = 0;
  const char* const end = text.data() + text.size();
  const auto [unit_begin, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || text.empty() || text.front() < '0' || text.front() > '9') return std::nullopt;
  const std::string_view unit(unit_begin, static_cast<std::size_t>(end - unit_begin));
  unsigned shift = 0;
  if (unit.empty()) {
    shift = 0;
  } else if (unit == "K" || unit == "k" || unit == "KiB") {
    shift = 10;
  } else if (unit == "M" || unit == "m" || unit == "MiB") {
    shift = 20;
  } else if (unit == "G" || unit == "g" || unit == "GiB") {
    shift = 30;
  } else {
    return std::nullopt;
  }
  if (value > (std::numeric_limits<std::uint64_t>::max() >> shift)) return std::nullopt;
  return value << shift;
}

std::uint64_t parse_size_option(std::string_view text, std::string_view option) {
  const std::optional<std::uint64_t> size = parse_size(text);
  if (!size) {
    throw InvalidArgumentError(std::string(option) + ": not a size: '" + std::string(text) +
                               "' (bytes, or a number with K, M or G)");
  }
  return *size;
}

}  // namespace pinload
