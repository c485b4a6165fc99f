// Internal to the command-line programs (pinload, pinload-bench): sizes such
// as "4096", "256K", "2M" or "1GiB" on the command line (pinload/size.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "pinload/size.h"

namespace pinload::cli {

// The size `text` names, in bytes; nullopt when it is not a size.
inline std::optional<std::uint64_t> parse_size_arg(const std::string& text) { return parse_size(text); }

}  // namespace pinload::cli
