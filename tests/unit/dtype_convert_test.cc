// The host conversions (convert_elements) on every SIMD target this build
// and CPU run, each forced in turn (Note [SIMD targets] in
// src/format/dtype_convert_simd.cc), bit for bit against the scalar forms
// of dtype_bits.h applied here element by element: every length up to 300
// and long streamed runs, at misaligned source and output addresses, all
// 256 FP8 codes under many scales, all 65536 16-bit patterns, float32 edge
// values and random bits, per-row scales with odd row lengths. Also built
// for aarch64 and run under qemu (scripts/test-aarch64.sh: NEON, SVE).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "format/dtype_bits.h"
#include "format/dtype_convert.h"
#include "format/simd.h"
#include "pinload/error.h"

namespace pinload {
namespace {

constexpr DType kFrom[] = {DType::kF8_E4M3, DType::kF8_E5M2, DType::kBF16, DType::kF16, DType::kF32};
constexpr DType kTo[] = {DType::kBF16, DType::kF16, DType::kF32};

unsigned bytes_of(DType d) { return dtype_bits(d) / 8; }
bool is_fp8(DType d) { return d == DType::kF8_E4M3 || d == DType::kF8_E5M2; }

float get(DType d, const std::uint8_t* p, std::uint64_t i) {
  std::uint16_t h;
  float f;
  switch (d) {
    case DType::kF8_E4M3: return bits::e4m3_to_f32(p[i]);
    case DType::kF8_E5M2: return bits::e5m2_to_f32(p[i]);
    case DType::kBF16: std::memcpy(&h, p + 2 * i, 2); return bits::bf16_to_f32(h);
    case DType::kF16: std::memcpy(&h, p + 2 * i, 2); return bits::f16_to_f32(h);
    default: std::memcpy(&f, p + 4 * i, 4); return f;
  }
}

void put(DType d, std::uint8_t* p, std::uint64_t i, float f) {
  std::uint16_t h;
  switch (d) {
    case DType::kBF16: h = bits::f32_to_bf16(f); std::memcpy(p + 2 * i, &h, 2); return;
    case DType::kF16: h = bits::f32_to_f16(f); std::memcpy(p + 2 * i, &h, 2); return;
    default: std::memcpy(p + 4 * i, &f, 4); return;
  }
}

// What ElementConversion promises, element by element.
std::vector<std::uint8_t> expected(const ElementConversion& c, const std::uint8_t* src) {
  std::vector<std::uint8_t> out(c.elements * bytes_of(c.to));
  for (std::uint64_t i = 0; i < c.elements; ++i) {
    float x = get(c.from, src, i);
    if (is_fp8(c.from)) x *= c.row_scales != nullptr ? c.row_scales[(c.first + i) / c.row_elements] : c.scale;
    put(c.to, out.data(), i, x);
  }
  return out;
}

std::uint64_t next(std::uint64_t& s) {
  s ^= s << 13, s ^= s >> 7, s ^= s << 17;
  return s;
}

// n elements of `d`: every FP8 code and every 16-bit pattern (in a scattered
// order, all of them within each 256 / 65536 elements), float32 edge values
// then random bits of every magnitude.
std::vector<std::uint8_t> source(DType d, std::uint64_t n, std::uint64_t seed) {
  std::vector<std::uint8_t> out(n * bytes_of(d));
  std::uint64_t s = 0x9E3779B97F4A7C15ull ^ seed;
  static const std::uint32_t kEdges[] = {
      0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF,
      0x7FC0FFFF, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x3F808000, 0x3F818000,
      0x3F808001, 0x3F80FFFF, 0x477FE000, 0x477FF000, 0x477FEFFF, 0x33000000, 0x33000001, 0x387FC000, 0x38800000,
      0x387FE000, 0x337FFFFF, 0xB3800000, 0x43E00000, 0x43F00000, 0x47600000, 0x3B000000, 0x3A800000, 0x38000000};
  for (std::uint64_t i = 0; i < n; ++i) {
    switch (d) {
      case DType::kF8_E4M3:
      case DType::kF8_E5M2: out[i] = static_cast<std::uint8_t>((i + seed) * 37); break;
      case DType::kBF16:
      case DType::kF16: {
        const auto h = static_cast<std::uint16_t>((i + seed) * 40503u);
        std::memcpy(&out[2 * i], &h, 2);
        break;
      }
      default: {
        std::uint32_t u;
        const std::uint64_t k = (i + seed) % 1024;
        if (k < std::size(kEdges)) {
          u = kEdges[k];
        } else if (k < 600) {  // random magnitudes: exponents from denormal to huge
          u = static_cast<std::uint32_t>(next(s));
        } else {  // near bf16 and fp16 rounding points, both signs
          u = (static_cast<std::uint32_t>(next(s) % 60 + 100) << 23) | static_cast<std::uint32_t>(next(s) & 0x807FFFFF);
          if (k % 3 == 0) u = (u & ~0xFFFFu) | 0x8000u | (k % 2);
        }
        std::memcpy(&out[4 * i], &u, 4);
        break;
      }
    }
  }
  return out;
}

// Converts and compares, with guard bytes around the output that must stay.
void check(const ElementConversion& c, const std::uint8_t* src, std::size_t dst_offset, const std::string& what) {
  const std::vector<std::uint8_t> want = expected(c, src);
  // At a 64-byte boundary plus the offset, at least 64 guard bytes each side.
  std::vector<std::uint8_t> buffer(want.size() + dst_offset + 192, 0xA5);
  std::uint8_t* dst = reinterpret_cast<std::uint8_t*>(
      (reinterpret_cast<std::uintptr_t>(buffer.data()) + 64 + 63) / 64 * 64 + dst_offset);
  const std::vector<std::uint8_t> before = buffer;
  convert_elements(c, src, dst);
  const std::size_t begin = static_cast<std::size_t>(dst - buffer.data());
  for (std::size_t i = 0; i < buffer.size(); ++i) {
    if (i >= begin && i < begin + want.size()) {
      if (buffer[i] != want[i - begin]) {
        const std::uint64_t e = (i - begin) / bytes_of(c.to);
        // NaN times a NaN scale: which of the two a multiply returns is the
        // compiler's choice of operand order, in the scalar forms as in the
        // kernels (Note [Rounding as torch]: NaN stays NaN).
        if (is_fp8(c.from) && std::isnan(c.scale) && std::isnan(get(c.from, src, e)) &&
            std::isnan(get(c.to, buffer.data() + begin, e))) {
          i = begin + (e + 1) * bytes_of(c.to) - 1;
          continue;
        }
        ADD_FAILURE() << what << ": " << dtype_name(c.from) << " -> " << dtype_name(c.to) << ", " << c.elements
                      << " elements, scale " << c.scale << ", output offset " << dst_offset << ": element " << e
                      << " differs (input byte " << static_cast<unsigned>(src[e * bytes_of(c.from)]) << ")";
        return;
      }
    } else if (buffer[i] != before[i]) {
      ADD_FAILURE() << what << ": " << dtype_name(c.from) << " -> " << dtype_name(c.to) << ", " << c.elements
                    << " elements: wrote outside the output at byte " << static_cast<long>(i - begin);
      return;
    }
  }
}

// Runs `body` once per runnable target, forced, then restores the best.
// PINLOAD_TEST_TARGETS=a,b limits it to those (scripts/test-aarch64.sh: the
// emulated CPUs after the first add one target each).
template <class Body>
void on_every_target(Body body) {
  const std::vector<std::string> targets = simd::runnable_targets();
  ASSERT_FALSE(targets.empty());
  EXPECT_EQ(targets.back(), "scalar");
  const char* only = std::getenv("PINLOAD_TEST_TARGETS");
  for (const std::string& t : targets) {
    if (only != nullptr && ("," + std::string(only) + ",").find("," + t + ",") == std::string::npos) continue;
    simd::set_target(t);
    ASSERT_EQ(simd::target(), t);
    SCOPED_TRACE("target " + t);
    body(t);
  }
  simd::set_target("");
}

TEST(DtypeConvertSimd, EveryLengthAndAlignment) {
  on_every_target([](const std::string& t) {
    for (DType from : kFrom) {
      for (DType to : kTo) {
        for (float scale : is_fp8(from) ? std::vector<float>{1.0f, -3.5f} : std::vector<float>{1.0f}) {
          for (std::size_t src_offset : {std::size_t{0}, std::size_t{bytes_of(from)}, std::size_t{1}}) {
            // Source at a vector-aligned base plus the offset.
            std::vector<std::uint8_t> store(400 * 4 + 128);
            std::uint8_t* src =
                reinterpret_cast<std::uint8_t*>((reinterpret_cast<std::uintptr_t>(store.data()) + 63) / 64 * 64 + src_offset);
            const std::vector<std::uint8_t> values = source(from, 301, src_offset);
            std::memcpy(src, values.data(), values.size());
            for (std::uint64_t n = 0; n <= 300; ++n) {
              // Odd addresses (the plain loops take them) at every 7th length.
              if (src_offset == 1 && n % 7 != 0) continue;
              for (std::size_t dst_offset : {std::size_t{0}, std::size_t{bytes_of(to)}, std::size_t{3} * bytes_of(to),
                                             std::size_t{1}}) {
                if (dst_offset == 1 && n % 7 != 0) continue;
                check(ElementConversion{from, to, n, scale}, src, dst_offset, t);
                if (::testing::Test::HasFailure()) return;
              }
            }
          }
        }
      }
    }
  });
}

TEST(DtypeConvertSimd, LongStreamedRuns) {
  // Past 256 KiB of output (Note [Streaming stores]), with every 16-bit
  // pattern twice over.
  constexpr std::uint64_t kElements = (1u << 17) + 77;
  on_every_target([](const std::string& t) {
    for (DType from : kFrom) {
      const std::vector<std::uint8_t> values = source(from, kElements, 5);
      for (DType to : kTo) {
        for (std::size_t dst_offset : {std::size_t{0}, std::size_t{2} * bytes_of(to), std::size_t{1}}) {
          check(ElementConversion{from, to, kElements, is_fp8(from) ? 0.37f : 1.0f}, values.data(), dst_offset, t);
        }
      }
    }
  });
}

TEST(DtypeConvertSimd, EveryFp8CodeUnderManyScales) {
  // Scales that keep the exponent-table form, and scales that break it
  // (fp16 subnormal or infinite results, zero, Inf, NaN, denormal scales).
  std::vector<float> scales = {1.0f, 1.0f / 448, 1.0f / 57344, 0.0f, -0.0f, 1e-40f, 3e-30f, 1e30f,
                               std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(), 448.0f, 57344.0f, 65504.0f, 1.5e-5f, -2.0f};
  for (int e = -40; e <= 40; e += 3) scales.push_back(std::ldexp(1.0f, e));
  std::uint64_t s = 7;
  for (int i = 0; i < 24; ++i) scales.push_back(std::ldexp(1.0f + static_cast<float>(next(s) % 1000) / 1000.0f, -20 + i));
  on_every_target([&](const std::string& t) {
    for (DType from : {DType::kF8_E4M3, DType::kF8_E5M2}) {
      const std::vector<std::uint8_t> codes = source(from, 256 * 5 + 13, 0);
      for (DType to : kTo) {
        for (float scale : scales) {
          // 300: the arithmetic kernel; 1293: the table (exponent form or VBMI).
          for (std::uint64_t n : {std::uint64_t{300}, std::uint64_t{codes.size()}}) {
            check(ElementConversion{from, to, n, scale}, codes.data(), 0, t);
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  });
}

TEST(DtypeConvertSimd, PerRowScalesWithOddRows) {
  on_every_target([](const std::string& t) {
    for (DType from : {DType::kF8_E4M3, DType::kF8_E5M2}) {
      for (DType to : kTo) {
        for (std::uint64_t row : {1u, 7u, 33u, 301u, 1000u}) {
          for (std::uint64_t first : {0u, 5u, 1003u}) {
            const std::uint64_t n = row * 4 + 3;
            std::vector<float> scales((first + n) / row + 2);
            for (std::size_t i = 0; i < scales.size(); ++i) scales[i] = std::ldexp(0.75f + 0.01f * static_cast<float>(i), static_cast<int>(i % 23) - 11);
            const std::vector<std::uint8_t> values = source(from, n, first);
            ElementConversion c{from, to, n, 1.0f};
            c.row_scales = scales.data();
            c.row_elements = row;
            c.first = first;
            check(c, values.data(), 0, t);
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  });
}

TEST(DtypeConvertSimd, Override) {
  const std::vector<std::string> targets = simd::runnable_targets();
  std::string all;
  for (const std::string& t : targets) all += t + " ";
  std::printf("runnable SIMD targets here: %s(best: %s)\n", all.c_str(), simd::target().c_str());
  EXPECT_EQ(targets.front(), simd::target());
  for (const char* bad : {"nonsense", "AVX2", "avx", "neon256"}) {
    try {
      simd::set_target(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("scalar"), std::string::npos) << e.what();
    }
  }
  // A target of the other architecture is never runnable.
#if defined(__x86_64__)
  EXPECT_THROW(simd::set_target("neon"), InvalidArgumentError);
#else
  EXPECT_THROW(simd::set_target("avx2"), InvalidArgumentError);
#endif
  simd::set_target("scalar");
  EXPECT_EQ(simd::target(), "scalar");
  simd::set_target("best");
  EXPECT_EQ(simd::target(), targets.front());
}

}  // namespace
}  // namespace pinload
