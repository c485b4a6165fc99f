// pinload/size.h: byte sizes as people write them ("4096", "256K", "8M", "1GiB").
//
// The one size parser of pinload: the command-line programs and the Python
// options (pinload.LoadOptions, ModelCache budgets) all use it.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace pinload {

// The bytes `text` names: decimal digits, then nothing (bytes) or one unit of
// K, k, KiB (2^10), M, m, MiB (2^20), G, g, GiB (2^30). No sign, no space, no
// fraction. nullopt for anything else, or a size beyond 2^64 - 1.
std::optional<std::uint64_t> parse_size(std::string_view text) noexcept;

// parse_size, or InvalidArgumentError naming `option` and the text.
std::uint64_t parse_size_option(std::string_view text, std::string_view option);

}  // namespace pinload
