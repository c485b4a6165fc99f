// libFuzzer target: parse_template over arbitrary bytes.
//
// parse_template never throws: it accepts or says why not. Any exception, a
// crash or a sanitizer report is a bug, and so is an accepted template that
// breaks what load_template's callers rely on: every read names a file, starts
// inside it and ends at most kTemplateMaxAlign past its end, and the template
// serializes back to exactly the input bytes. See docs/fuzzing.md.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <span>
#include <vector>

#include "pinload/io_template.h"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "template_fuzz: %s\n", what);
  std::abort();
}

// Checks one input; returns nothing.
void check(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> bytes(data, size);
  try {
    const std::optional<pinload::IoTemplate> t = pinload::parse_template(bytes);
    if (!t) return;
    for (const pinload::TemplateReads& d : t->destinations) {
      for (const pinload::TemplateRead& r : d.reads) {
        if (r.file >= t->files.size()) fail("a read of a file that is not there");
        const std::uint64_t file_size = t->files[r.file].size;
        if (file_size > pinload::kTemplateMaxFileSize) fail("a file too large to reason about");
        if (r.offset >= file_size || r.length == 0 || r.offset + r.length > file_size + pinload::kTemplateMaxAlign) {
          fail("a read outside its file");
        }
      }
    }
    const std::vector<std::uint8_t> again = pinload::serialize_template(*t);
    if (again.size() != size || !std::equal(again.begin(), again.end(), data)) fail("no exact round trip");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    fail("parse_template threw");
  } catch (...) {
    fail("parse_template threw");
  }
}

}  // namespace

// Each input is parsed as it is, and again with its checksum made right:
// mutations rarely keep the FNV-1a sum, and the parser behind it needs
// exercising too.
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  check(data, size);
  if (size >= 8) {
    std::vector<std::uint8_t> sealed(data, data + size);
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (std::size_t i = 0; i + 8 < size; ++i) {
      h ^= sealed[i];
      h *= 0x100000001b3ull;
    }
    for (int i = 0; i < 8; ++i) sealed[size - 8 + i] = static_cast<std::uint8_t>(h >> (8 * i));
    check(sealed.data(), sealed.size());
  }
  return 0;
}
