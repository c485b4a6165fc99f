// libFuzzer target: parse_safetensors over arbitrary bytes.
//
// The parser may reject its input only with pinload::Error. Any other
// exception (a nlohmann::json one, std::bad_alloc, std::length_error, ...) is a
// bug and aborts, as do crashes and sanitizer reports. Accepted headers are
// checked against the invariants the loader relies on. See docs/fuzzing.md.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>

#include "pinload/error.h"
#include "pinload/safetensors.h"

namespace {

[[noreturn]] void fail(const char* what, const char* detail) {
  std::fprintf(stderr, "safetensors_fuzz: %s: %s\n", what, detail);
  std::abort();
}

// What every accepted header must satisfy: tensors tile the data section.
void check_invariants(const pinload::Header& h, std::size_t size) {
  if (h.file_size != size || h.data_offset() > size) fail("invariant", "sizes");
  std::uint64_t covered = 0;
  for (const pinload::TensorInfo& t : h.tensors) {
    if (t.begin != covered || t.end < t.begin) fail("invariant", "tensors do not tile the data");
    if (h.find(t.name) == nullptr) fail("invariant", "find() misses a tensor");
    covered = t.end;
  }
  if (covered != h.data_size()) fail("invariant", "data section not covered");
  if (h.by_name.size() != h.tensors.size()) fail("invariant", "by_name size");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    const pinload::Header header = pinload::parse_safetensors(bytes, "fuzz.safetensors");
    check_invariants(header, size);
  } catch (const pinload::Error& e) {
    if (e.context().file != "fuzz.safetensors") fail("error without the file", e.what());
  } catch (const std::exception& e) {
    fail("non-pinload exception", e.what());
  } catch (...) {
    fail("non-pinload exception", "(not a std::exception)");
  }
  return 0;
}
