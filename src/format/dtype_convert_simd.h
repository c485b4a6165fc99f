// Internal: the vectorised kernels behind convert_elements (dtype_convert.cc),
// one copy per SIMD target, picked at run time (Note [SIMD targets] in
// dtype_convert_simd.cc).
#pragma once

#include <cstdint>

#include "pinload/dtype.h"

namespace pinload::simd {

// An FP8 source's 256 outputs for one (format, 16-bit output, scale), made
// with the scalar forms (dtype_bits.h), and, where it reproduces all of
// them, their exponent-table form (Note [FP8 by exponent table]).
struct Fp8Table {
  DType from = DType::kU8, to = DType::kU8;
  std::uint32_t scale_bits = 0;
  bool by_exponent = false;  // normal, subnormal, special reproduce values[] for every code
  // By mantissa: e >= 1 (less the e = 1 term), e = 0, the top exponent.
  alignas(16) std::uint16_t normal[8];
  alignas(16) std::uint16_t subnormal[8];
  alignas(16) std::uint16_t special[8];
  alignas(64) std::uint16_t values[256];
};

// The table for (from, to, scale): the calling thread's last one when it
// matches, else built anew. `to` is BF16 or F16.
const Fp8Table& fp8_table(DType from, DType to, float scale);

struct Run {
  DType from, to;
  const std::uint8_t* src;
  std::uint8_t* dst;
  std::uint64_t n;
  float scale;  // FP8 sources only
  bool stream;  // non-temporal stores (Note [Streaming stores] in dtype_convert.cc)
};

// Converts a run on the current target; false where that is "scalar" (the
// caller's plain loops). Every element is what the scalar forms give, bit
// for bit.
bool convert_run(const Run& run);

}  // namespace pinload::simd
