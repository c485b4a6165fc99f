#include "format/dtype_convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>

#include "base/streaming_copy.h"
#include "format/dtype_bits.h"
#include "format/dtype_convert_simd.h"
#include "pinload/error.h"

namespace pinload {
namespace {

// Element access through memcpy: any alignment, and the compiler vectorises it.
template <class T>
T load_raw(const std::uint8_t* p, std::uint64_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}
template <class T>
void store_raw(std::uint8_t* p, std::uint64_t i, T v) {
  std::memcpy(p + i * sizeof(T), &v, sizeof(T));
}

// Formats by tag: widen to float, narrow from float.
struct E4M3 { static float get(const std::uint8_t* p, std::uint64_t i) { return bits::e4m3_to_f32(p[i]); } };
struct E5M2 { static float get(const std::uint8_t* p, std::uint64_t i) { return bits::e5m2_to_f32(p[i]); } };
struct BF16 {
  static float get(const std::uint8_t* p, std::uint64_t i) { return bits::bf16_to_f32(load_raw<std::uint16_t>(p, i)); }
  static void put(std::uint8_t* p, std::uint64_t i, float f) { store_raw<std::uint16_t>(p, i, bits::f32_to_bf16(f)); }
};
struct F16 {
  static float get(const std::uint8_t* p, std::uint64_t i) { return bits::f16_to_f32(load_raw<std::uint16_t>(p, i)); }
  static void put(std::uint8_t* p, std::uint64_t i, float f) { store_raw<std::uint16_t>(p, i, bits::f32_to_f16(f)); }
};
struct F32 {
  static float get(const std::uint8_t* p, std::uint64_t i) { return load_raw<float>(p, i); }
  static void put(std::uint8_t* p, std::uint64_t i, float f) { store_raw<float>(p, i, f); }
};

// Note [Streaming stores]
// A conversion's output is written once and not read again soon (it is a
// loaded tensor: hundreds of MiB, far beyond the caches). Plain stores first
// read every output line for ownership, so a fp8 -> bf16 conversion moved
// in + 2 x out bytes through memory, more than memcpy (which streams large
// copies past the cache). Runs of at least kStreamOutBytes of output are
// therefore written with non-temporal stores: the SIMD kernels stream their
// vectors (hwy::Stream: movnt on x86, stnt1 on SVE) from the first
// vector-aligned output on, and the plain loops write tiles of
// kTileElements into a cache-resident buffer, which goes out with
// streaming_copy. The values are those of the same loops (bit for bit); an
// sfence at the end of convert_elements orders the stores before whatever
// the caller does next (handing the memory to another thread). Short runs
// keep plain stores: their output may well be read from the cache.
constexpr std::uint64_t kStreamOutBytes = 256u << 10;
constexpr std::uint64_t kTileElements = 4096;  // 16 KiB of fp32 output at most

// Runs `convert(src_element, count, out)` over n elements in tiles written
// to a cache-resident buffer, each then streamed to dst (Note [Streaming
// stores]).
template <unsigned kIn, unsigned kOut, class Convert>
void tiled(const std::uint8_t* src, std::uint8_t* dst, std::uint64_t n, Convert convert) {
  alignas(64) std::uint8_t tile[kTileElements * kOut];
  for (std::uint64_t i = 0; i < n; i += kTileElements) {
    const std::uint64_t m = std::min(kTileElements, n - i);
    convert(src + i * kIn, m, tile);
    detail::streaming_copy(dst + i * kOut, tile, m * kOut);
  }
}

// The plain loops: the "scalar" SIMD target (Note [SIMD targets] in
// dtype_convert_simd.cc), and any run the kernels leave to them.
// FP8 sources: 256 encodings, so each call first converts every encoding
// once (with the scalar forms, so rounding is theirs) into a table of output
// elements, then the loop is one table load per element.
template <class Element>
void lookup_loop(const Element* table, const std::uint8_t* src, std::uint8_t* dst, std::uint64_t n) {
  constexpr std::size_t kOut = sizeof(Element);
  std::uint64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const Element v[4] = {table[src[i]], table[src[i + 1]], table[src[i + 2]], table[src[i + 3]]};
    std::memcpy(dst + i * kOut, v, sizeof v);
  }
  for (; i < n; ++i) std::memcpy(dst + i * kOut, &table[src[i]], kOut);
}

template <class In, class Out>
void convert_run(const std::uint8_t* src, std::uint8_t* dst, std::uint64_t n, float scale, bool stream) {
  constexpr std::size_t kOut = std::is_same_v<Out, F32> ? 4 : 2;
  using Element = std::conditional_t<kOut == 4, std::uint32_t, std::uint16_t>;
  if (n < 1024) {  // a short run: the table would cost more than it saves
    for (std::uint64_t i = 0; i < n; ++i) Out::put(dst, i, In::get(src, i) * scale);
    return;
  }
  Element table[256];
  for (unsigned code = 0; code < 256; ++code) {
    const std::uint8_t b = static_cast<std::uint8_t>(code);
    Out::put(reinterpret_cast<std::uint8_t*>(table), code, In::get(&b, 0) * scale);
  }
  if (stream) {
    tiled<1, kOut>(src, dst, n, [&](const std::uint8_t* s, std::uint64_t m, std::uint8_t* t) {
      lookup_loop(table, s, t, m);
    });
  } else {
    lookup_loop(table, src, dst, n);
  }
}

// Widening and narrowing among bf16/fp16/fp32 take no scale: x * 1 would be
// exact, but the loop is simpler without it.
template <class In, class Out>
void cast_loop(const std::uint8_t* src, std::uint8_t* dst, std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; ++i) Out::put(dst, i, In::get(src, i));
}

template <class In, class Out>
void cast_run(const std::uint8_t* src, std::uint8_t* dst, std::uint64_t n, float, bool stream) {
  constexpr unsigned kIn = std::is_same_v<In, F32> ? 4 : 2;
  constexpr unsigned kOut = std::is_same_v<Out, F32> ? 4 : 2;
  if (stream) {
    tiled<kIn, kOut>(src, dst, n, [](const std::uint8_t* s, std::uint64_t m, std::uint8_t* t) {
      cast_loop<In, Out>(s, t, m);
    });
  } else {
    cast_loop<In, Out>(src, dst, n);
  }
}

using Run = void (*)(const std::uint8_t*, std::uint8_t*, std::uint64_t, float, bool);

template <class Out>
Run run_for(DType from) {
  switch (from) {
    case DType::kF8_E4M3: return convert_run<E4M3, Out>;
    case DType::kF8_E5M2: return convert_run<E5M2, Out>;
    case DType::kBF16: return cast_run<BF16, Out>;
    case DType::kF16: return cast_run<F16, Out>;
    case DType::kF32: return cast_run<F32, Out>;
    default: return nullptr;
  }
}

Run run_for(DType from, DType to) {
  switch (to) {
    case DType::kBF16: return run_for<BF16>(from);
    case DType::kF16: return run_for<F16>(from);
    case DType::kF32: return run_for<F32>(from);
    default: return nullptr;
  }
}

unsigned element_bytes(DType d) { return dtype_bits(d) / 8; }

[[noreturn]] void throw_unsupported(const char* what, DType from, DType to) {
  throw InvalidFileError(std::string(what) + " from " + std::string(dtype_name(from)) + " to " +
                         std::string(dtype_name(to)) + " is not supported");
}

template <class In, class Q>
void quantize_run(const std::uint8_t* src, std::uint8_t* dst, std::uint64_t n, float scale, float max, Q q) {
  for (std::uint64_t i = 0; i < n; ++i) {
    float v = In::get(src, i) / scale;
    // Clamp keeping NaN (std::fmin/fmax would drop it), as torch's clamp.
    v = v > max ? max : (v < -max ? -max : v);
    dst[i] = q(v);
  }
}

template <class In>
float abs_max_run(const std::uint8_t* src, std::uint64_t n) {
  float m = 0.0f;
  for (std::uint64_t i = 0; i < n; ++i) {
    const float v = std::fabs(In::get(src, i));
    m = v > m ? v : m;  // false for NaN: ignored
  }
  return m;
}

}  // namespace

bool is_float_dtype(DType d) noexcept {
  return d == DType::kF8_E4M3 || d == DType::kF8_E5M2 || d == DType::kBF16 || d == DType::kF16 || d == DType::kF32;
}

bool is_convertible(DType from, DType to) noexcept { return run_for(from, to) != nullptr; }

float fp8_max(DType fp8) { return fp8 == DType::kF8_E5M2 ? 57344.0f : 448.0f; }

void convert_elements(const ElementConversion& c, const void* src_v, void* dst_v) {
  const Run plain = run_for(c.from, c.to);
  if (plain == nullptr) throw_unsupported("conversion", c.from, c.to);
  const auto* src = static_cast<const std::uint8_t*>(src_v);
  auto* dst = static_cast<std::uint8_t*>(dst_v);
  const unsigned in = element_bytes(c.from), out = element_bytes(c.to);
  const bool stream = c.elements >= kStreamOutBytes / out;  // Note [Streaming stores]
  auto run = [&](const std::uint8_t* s, std::uint8_t* d, std::uint64_t n, float scale, bool streamed) {
    if (!simd::convert_run(simd::Run{c.from, c.to, s, d, n, scale, streamed})) plain(s, d, n, scale, streamed);
  };
  if (c.row_scales == nullptr || c.row_elements == 0) {
    run(src, dst, c.elements, c.scale, stream);
  } else {
    // Per row: one run per (part of a) row, each with its row's scale.
    std::uint64_t done = 0;
    while (done < c.elements) {
      const std::uint64_t index = c.first + done;
      const std::uint64_t row = index / c.row_elements;
      const std::uint64_t n = std::min(c.elements - done, (row + 1) * c.row_elements - index);
      run(src + done * in, dst + done * out, n, c.row_scales[row], stream);
      done += n;
    }
  }
  if (stream) detail::streaming_fence();
}

void quantize_elements(DType from, DType to, const void* src_v, std::uint8_t* dst, std::uint64_t elements,
                       float scale, const float* row_scales, std::uint64_t row_elements, std::uint64_t first) {
  if (to != DType::kF8_E4M3 && to != DType::kF8_E5M2) throw_unsupported("quantisation", from, to);
  const auto* src = static_cast<const std::uint8_t*>(src_v);
  const float max = fp8_max(to);
  auto one = [&](const std::uint8_t* s, std::uint8_t* d, std::uint64_t n, float sc) {
    auto q4 = [](float v) { return bits::f32_to_e4m3(v); };
    auto q5 = [](float v) { return bits::f32_to_e5m2(v); };
    const bool e4 = to == DType::kF8_E4M3;
    switch (from) {
      case DType::kBF16: e4 ? quantize_run<BF16>(s, d, n, sc, max, q4) : quantize_run<BF16>(s, d, n, sc, max, q5); break;
      case DType::kF16: e4 ? quantize_run<F16>(s, d, n, sc, max, q4) : quantize_run<F16>(s, d, n, sc, max, q5); break;
      case DType::kF32: e4 ? quantize_run<F32>(s, d, n, sc, max, q4) : quantize_run<F32>(s, d, n, sc, max, q5); break;
      default: throw_unsupported("quantisation", from, to);
    }
  };
  if (row_scales == nullptr || row_elements == 0) {
    one(src, dst, elements, scale);
    return;
  }
  const unsigned in = element_bytes(from);
  std::uint64_t done = 0;
  while (done < elements) {
    const std::uint64_t index = first + done;
    const std::uint64_t row = index / row_elements;
    const std::uint64_t n = std::min(elements - done, (row + 1) * row_elements - index);
    one(src + done * in, dst + done, n, row_scales[row]);
    done += n;
  }
}

float abs_max(DType from, const void* src_v, std::uint64_t elements) {
  const auto* src = static_cast<const std::uint8_t*>(src_v);
  switch (from) {
    case DType::kBF16: return abs_max_run<BF16>(src, elements);
    case DType::kF16: return abs_max_run<F16>(src, elements);
    case DType::kF32: return abs_max_run<F32>(src, elements);
    default: throw InvalidFileError("abs_max of " + std::string(dtype_name(from)) + " is not supported");
  }
}

}  // namespace pinload
