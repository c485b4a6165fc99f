// Internal to the command-line programs (pinload, pinload-bench): the
// spellings of LoadOptions::direct and LoadOptions::cached_read, the tables
// of load/option_spellings.h (the ones parse_direct_io and parse_cached_read
// in loader.h read).
#pragma once

#include <optional>
#include <string_view>

#include "load/option_spellings.h"
#include "pinload/loader.h"

namespace pinload::cli {

using detail::kCachedReadSpellings;
using detail::kDirectSpellings;
using detail::kPageCacheSpellings;
using detail::kZeroCopySpellings;
using detail::Spelling;
using detail::parse_spelling;
using detail::spelling_of;

// --direct auto|on|off
inline std::optional<DirectIo> parse_direct_arg(std::string_view text) { return parse_direct_io(text); }
inline const char* direct_arg_name(DirectIo d) { return direct_io_name(d); }

// --cached-read auto|map|pread
inline std::optional<CachedRead> parse_cached_read_arg(std::string_view text) { return parse_cached_read(text); }
inline const char* cached_read_arg_name(CachedRead c) { return cached_read_name(c); }

// --zero-copy auto|on|off (Note [Zero-copy loads] in loader.h)
inline std::optional<ZeroCopy> parse_zero_copy_arg(std::string_view text) {
  return parse_spelling(kZeroCopySpellings, text);
}
inline const char* zero_copy_arg_name(ZeroCopy z) { return spelling_of(kZeroCopySpellings, z); }

}  // namespace pinload::cli
