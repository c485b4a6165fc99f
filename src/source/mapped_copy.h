// Internal: copies out of a file mapping without dying of SIGBUS.
//
// A load copies from a mapping of a file in the page cache (Note [Mapped
// reads] in loader.h). If the file is cut short while that happens, touching
// a page past its new end raises SIGBUS, which would kill the process.
// copy_from_mapping catches that SIGBUS on its own thread and reports it; a
// SIGBUS anywhere else goes to the handler installed before pinload's (or the
// default action), as if pinload's were not there.
#pragma once

#include <cstddef>

namespace pinload::detail {

// Copies `bytes` from `src` (inside a file mapping) to `dst` with
// non-temporal stores where the CPU has them. Returns false if a SIGBUS cut
// the copy short; `dst` then holds an unspecified prefix.
bool copy_from_mapping(std::byte* dst, const std::byte* src, std::size_t bytes) noexcept;

}  // namespace pinload::detail
