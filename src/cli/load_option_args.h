// Internal to the command-line programs (pinload, pinload-bench): the
// spellings of LoadOptions::direct and LoadOptions::cached_read.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

#include "pinload/loader.h"

namespace pinload::cli {

template <class E>
struct Spelling {
  std::string_view text;
  E value;
};

inline constexpr Spelling<DirectIo> kDirectSpellings[] = {
    {"auto", DirectIo::kAuto}, {"on", DirectIo::kOn}, {"off", DirectIo::kOff}};
inline constexpr Spelling<CachedRead> kCachedReadSpellings[] = {
    {"auto", CachedRead::kAuto}, {"map", CachedRead::kMap}, {"pread", CachedRead::kPread}};
inline constexpr Spelling<ZeroCopy> kZeroCopySpellings[] = {
    {"auto", ZeroCopy::kAuto}, {"on", ZeroCopy::kOn}, {"off", ZeroCopy::kOff}};

// The value spelled `text`; nullopt for anything else.
template <class E, std::size_t N>
std::optional<E> parse_spelling(const Spelling<E> (&spellings)[N], std::string_view text) {
  for (const auto& s : spellings) {
    if (s.text == text) return s.value;
  }
  return std::nullopt;
}

template <class E, std::size_t N>
const char* spelling_of(const Spelling<E> (&spellings)[N], E value) {
  for (const auto& s : spellings) {
    if (s.value == value) return s.text.data();  // literals: NUL-terminated
  }
  return "?";
}

// --direct auto|on|off
inline std::optional<DirectIo> parse_direct_arg(std::string_view text) { return parse_spelling(kDirectSpellings, text); }
inline const char* direct_arg_name(DirectIo d) { return spelling_of(kDirectSpellings, d); }

// --cached-read auto|map|pread
inline std::optional<CachedRead> parse_cached_read_arg(std::string_view text) {
  return parse_spelling(kCachedReadSpellings, text);
}
inline const char* cached_read_arg_name(CachedRead c) { return spelling_of(kCachedReadSpellings, c); }

// --zero-copy auto|on|off (Note [Zero-copy loads] in loader.h)
inline std::optional<ZeroCopy> parse_zero_copy_arg(std::string_view text) {
  return parse_spelling(kZeroCopySpellings, text);
}
inline const char* zero_copy_arg_name(ZeroCopy z) { return spelling_of(kZeroCopySpellings, z); }

}  // namespace pinload::cli
