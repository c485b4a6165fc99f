// Internal: which SIMD target the host conversions (dtype_convert.cc) run
// on, and the PINLOAD_SIMD override (Note [SIMD targets] in
// dtype_convert_simd.cc).
//
// Thread safety: target(), runnable_targets() from any thread; set_target()
// only while no conversion runs (tests, start-up).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace pinload::simd {

// The target conversions run on now: "scalar", "ssse3", "sse4", "avx2",
// "avx512", "avx512vbmi", "neon", "sve", "sve2", "sve256", "sve2_128".
// The first call applies PINLOAD_SIMD; a name this build or this CPU cannot
// run throws InvalidArgumentError listing the runnable ones.
std::string target();

// The targets this build has and this CPU runs, best first; "scalar" (the
// plain loops) is always last.
std::vector<std::string> runnable_targets();

// Forces `name` (one of runnable_targets()), or the best with "" or "best".
// Throws InvalidArgumentError for any other name.
void set_target(std::string_view name);

}  // namespace pinload::simd
