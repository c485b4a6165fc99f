// Internal: element conversions on the host, vectorised loops over
// dtype_bits.h (Note [Rounding as torch]).
//
// Thread safety: pure functions; call from any thread.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pinload/dtype.h"

namespace pinload {

// Converts c.elements elements from `src` (c.from) to `dst` (c.to) as
// ElementConversion (dtype.h) says; c.row_scales, if set, is host memory.
// The ranges must not overlap. Unaligned pointers are fine. Throws
// InvalidFileError for a pair is_convertible refuses.
void convert_elements(const ElementConversion& c, const void* src, void* dst);

// Quantises `elements` values of `from` (BF16, F16 or F32) to `to`
// (F8_E4M3 or F8_E5M2): q = fp8(clamp(float(x) / scale, ±max)), where max
// is 448 or 57344 (Note [FP8 clamp] in convert.h) and `scale` is
// row_scales[(first + i) / row_elements] when row_scales is set, else
// `scale`. Throws InvalidFileError for other dtypes.
void quantize_elements(DType from, DType to, const void* src, std::uint8_t* dst, std::uint64_t elements, float scale,
                       const float* row_scales = nullptr, std::uint64_t row_elements = 0, std::uint64_t first = 0);

// max(|float(x)|) over `elements` values of `from` (BF16, F16, F32); NaNs
// are ignored; 0 for none.
float abs_max(DType from, const void* src, std::uint64_t elements);

// The largest finite value of an fp8 type: 448 (F8_E4M3), 57344 (F8_E5M2).
float fp8_max(DType fp8);

}  // namespace pinload
