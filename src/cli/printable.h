// Internal to the command-line program: how names, metadata and paths from a
// file are printed on a terminal.
//
// Note [Printable text]
// A tensor name or metadata value is whatever the file says: it may hold a
// tab or newline (which would forge a whole line of `inspect` or `load
// --digest` output) or an escape sequence (which a terminal would obey). The
// plain-text output prints each such string escaped, reversibly:
//   - a backslash becomes "\\";
//   - a byte below 0x20, 0x7f, a C1 control (U+0080..U+009F, which some
//     terminals obey as escapes) and any byte that is not part of valid UTF-8
//     become "\xNN" (lowercase hex), byte by byte;
//   - everything else (printable ASCII and valid UTF-8) is kept.
// So an escaped string holds no tab, newline or control byte. `inspect
// --json` is exact instead: JSON's own escaping, which every JSON reader
// undoes. Error messages are escaped the same way.
#pragma once

#include <string>

namespace pinload::cli {

inline std::string printable(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  static constexpr char kHex[] = "0123456789abcdef";
  auto escape = [&](unsigned char c) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
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
    for (std::size_t k = 1; valid && k < len; ++k) valid = (static_cast<unsigned char>(text[i + k]) >> 6) == 2;
    if (valid && len == 2) {
      // Overlong forms and C1 controls (U+0080..U+009F: 0xC2 0x80..0x9F).
      const auto c1 = static_cast<unsigned char>(text[i + 1]);
      valid = c >= 0xC2 && !(c == 0xC2 && c1 < 0xA0);
    }
    if (!valid) {
      escape(c);
      ++i;
      continue;
    }
    out.append(text, i, len);
    i += len;
  }
  return out;
}

}  // namespace pinload::cli
