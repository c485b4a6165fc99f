// Internal: the spellings of LoadOptions::direct ("auto", "on", "off") and
// LoadOptions::cached_read ("auto", "map", "pread"), one table each, read by
// parse_direct_io and parse_cached_read (loader.h) and by the CLI's choices.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

#include "pinload/loader.h"

namespace pinload::detail {

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
inline constexpr Spelling<PageCache> kPageCacheSpellings[] = {
    {"auto", PageCache::kAuto}, {"keep", PageCache::kKeep}, {"bypass", PageCache::kBypass}};

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

}  // namespace pinload::detail
