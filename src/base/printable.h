// Internal: bytes from a file, a server or a peer, escaped for a message.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace pinload {

// Note [Printable text]
// A tensor name, a metadata value, a server's header or a peer's request is
// whatever its sender says: it may hold a tab or newline (which would forge a
// whole line of `inspect` or `load --digest` output), an escape sequence
// (which a terminal would obey) or bytes that are not UTF-8 (which cannot be
// written as JSON: a store reply holding them would throw). Every message
// that quotes such bytes escapes them here, once, reversibly:
//   - a backslash becomes "\\";
//   - a byte below 0x20, 0x7f, a C1 control (U+0080..U+009F, which some
//     terminals obey as escapes) and any byte that is not part of valid UTF-8
//     become "\xNN" (lowercase hex), byte by byte;
//   - everything else (printable ASCII and valid UTF-8) is kept.
// So an escaped string is valid UTF-8 and holds no tab, newline or control
// byte. `inspect --json` is exact instead: JSON's own escaping.
inline std::string printable_text(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  auto escape = [&](unsigned char c) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  for (std::size_t i = 0; i < text.size();) {
    const unsigned char c = byte(i);
    if (c == '\\') {
      out += "\\\\";
      ++i;
      continue;
    }
    if (c < 0x20 || c == 0x7f) {
      escape(c);
      ++i;
      continue;
    }
    const std::size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    bool valid = len != 0 && i + len <= text.size();
    for (std::size_t k = 1; valid && k < len; ++k) valid = (byte(i + k) >> 6) == 2;
    if (valid && len == 2) {
      // Overlong forms and C1 controls (U+0080..U+009F: 0xC2 0x80..0x9F).
      valid = c >= 0xC2 && !(c == 0xC2 && byte(i + 1) < 0xA0);
    } else if (valid && len == 3) {
      // Overlong forms and UTF-16 surrogates (U+D800..U+DFFF).
      valid = !(c == 0xE0 && byte(i + 1) < 0xA0) && !(c == 0xED && byte(i + 1) >= 0xA0);
    } else if (valid && len == 4) {
      // Overlong forms and code points above U+10FFFF.
      valid = !(c == 0xF0 && byte(i + 1) < 0x90) && c <= 0xF4 && !(c == 0xF4 && byte(i + 1) >= 0x90);
    }
    if (!valid) {
      escape(c);
      ++i;
      continue;
    }
    out.append(text.substr(i, len));
    i += len;
  }
  return out;
}

// The same, of at most the first `max_bytes` bytes of `text` (cut back to a
// character's start), with "..." after it when `text` was longer.
inline std::string printable_text(std::string_view text, std::size_t max_bytes) {
  if (text.size() <= max_bytes) return printable_text(text);
  std::size_t cut = max_bytes;
  for (int k = 0; k < 3 && cut > 0 && (static_cast<unsigned char>(text[cut]) >> 6) == 2; ++k) --cut;
  return printable_text(text.substr(0, cut)) + "...";
}

}  // namespace pinload
