// Internal to the command-line programs (pinload, pinload-bench): the
// spellings of LoadOptions::direct and LoadOptions::cached_read.
#pragma once

#include <optional>
#include <string_view>

#include "pinload/loader.h"

namespace pinload::cli {

// --direct auto|on|off; nullopt for anything else.
inline std::optional<DirectIo> parse_direct_arg(std::string_view text) {
  if (text == "auto") return DirectIo::kAuto;
  if (text == "on") return DirectIo::kOn;
  if (text == "off") return DirectIo::kOff;
  return std::nullopt;
}

inline const char* direct_arg_name(DirectIo d) {
  return d == DirectIo::kAuto ? "auto" : d == DirectIo::kOn ? "on" : "off";
}

// --cached-read auto|map|pread; nullopt for anything else.
inline std::optional<CachedRead> parse_cached_read_arg(std::string_view text) {
  if (text == "auto") return CachedRead::kAuto;
  if (text == "map") return CachedRead::kMap;
  if (text == "pread") return CachedRead::kPread;
  return std::nullopt;
}

inline const char* cached_read_arg_name(CachedRead c) {
  return c == CachedRead::kAuto ? "auto" : c == CachedRead::kMap ? "map" : "pread";
}

}  // namespace pinload::cli
