// The host conversions' vectorised kernels, one copy per SIMD target
// (Google Highway), and the choice among them.
//
// Note [SIMD targets]
// This file is compiled once per target Highway knows for the architecture
// (foreach_target.h): SSSE3, SSE4, AVX2, AVX-512 (Skylake) and AVX-512 with
// VBMI and the other Ice Lake extensions (Highway's AVX3_DL) on x86-64; NEON
// and SVE (SVE2, 256-bit SVE) on aarch64. At run time HWY_DYNAMIC_DISPATCH
// calls the best copy the CPU runs. PINLOAD_SIMD (read at the first
// conversion) or simd::set_target() (tests, fp8-bench) forces one instead:
// a Highway target through hwy::SetSupportedTargetsForTest, or "scalar",
// the plain loops of dtype_convert.cc, which also serve Highway's own
// scalar target. Every kernel reproduces the scalar forms of dtype_bits.h
// bit for bit, NaN payloads included: the same IEEE operations on each lane
// (float multiply and add, in round-to-nearest, never contracted into an
// FMA: -ffp-contract=off), and integer steps. dtype_convert_test forces
// each runnable target in turn against those forms.
//
// Note [FP8 by exponent table]
// An FP8 code c = sign | e | m converts with a scale s to out(c) =
// to16(fp8(c) * s). For a normal code, fp8(c) * s = ((1 + m / 2^M) * s) *
// 2^(e - 1) * 2^(1 - bias): the product for e = 1 scaled by a power of two,
// exact while it stays a normal float, and rounding to bf16 or fp16 commutes
// with that scaling while the result stays normal and finite there. So
// out(c) = normal[m] + (e << mantissa bits of the output), with
// normal[m] = out(e = 1, m) - (1 << mantissa bits), sign by XOR, and
// tables of 8 for e = 0 (subnormal) and the top exponent (e5m2's Inf and
// NaN; e4m3fn's NaN): three byte shuffles (pshufb, tbl) per vector of
// 16-bit lanes, where a 256-entry lookup needs a gather or AVX-512 VBMI.
// Whether that holds depends on the scale (fp16 outputs of small scales
// are fp16 subnormals), so fp8_table() builds every code's output with the
// scalar forms and takes the exponent form only where it reproduces all 256;
// otherwise the arithmetic kernel (decode to float, multiply, round) runs,
// exact for any scale. AVX-512 VBMI looks the 256 outputs up directly
// (vpermt2b), as before.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL  // AVX-512 VBMI (Ice Lake, Zen 4) as a target of its own
#endif
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "format/dtype_convert_simd.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cstdint>
#include <cstring>

#include "format/dtype_bits.h"
#include "format/dtype_convert_simd.h"

HWY_BEFORE_NAMESPACE();
namespace pinload::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128
// Highway's scalar target: the plain loops of dtype_convert.cc instead.
bool ConvertRun(const Run*) { return false; }
#else

enum Fmt { kE4M3, kE5M2, kBF16, kF16, kF32 };

// One element the scalar way: the unaligned head and the tail of a run.
HWY_INLINE float get(Fmt f, const std::uint8_t* p, std::uint64_t i) {
  std::uint16_t h;
  float x;
  switch (f) {
    case kE4M3: return bits::e4m3_to_f32(p[i]);
    case kE5M2: return bits::e5m2_to_f32(p[i]);
    case kBF16: std::memcpy(&h, p + 2 * i, 2); return bits::bf16_to_f32(h);
    case kF16: std::memcpy(&h, p + 2 * i, 2); return bits::f16_to_f32(h);
    case kF32: break;
  }
  std::memcpy(&x, p + 4 * i, 4);
  return x;
}
HWY_INLINE void put(Fmt f, std::uint8_t* p, std::uint64_t i, float x) {
  std::uint16_t h;
  switch (f) {
    case kBF16: h = bits::f32_to_bf16(x); std::memcpy(p + 2 * i, &h, 2); return;
    case kF16: h = bits::f32_to_f16(x); std::memcpy(p + 2 * i, &h, 2); return;
    default: std::memcpy(p + 4 * i, &x, 4); return;
  }
}
template <Fmt kIn, Fmt kOut>
HWY_INLINE void one(const Run& r, std::uint64_t i) {
  float x = get(kIn, r.src, i);
  if constexpr (kIn == kE4M3 || kIn == kE5M2) x *= r.scale;
  put(kOut, r.dst, i, x);
}

// Runs `body(i)` (the outputs of elements i .. i + Lanes(d) - 1) over the
// run, and `scalar(i)` over the tail and, when streaming, over the head up
// to the first vector-aligned output (Stream needs it).
template <class D, class Body, class Scalar>
HWY_INLINE void drive(const Run& r, D d, Body body, Scalar scalar) {
  using T = hn::TFromD<D>;
  T* const out = reinterpret_cast<T*>(r.dst);
  const std::uint64_t lanes = hn::Lanes(d);
  std::uint64_t i = 0;
  if (r.stream) {
    const std::uint64_t align = lanes * sizeof(T);
    const std::uint64_t head = ((align - reinterpret_cast<std::uintptr_t>(r.dst) % align) % align) / sizeof(T);
    for (; i < head && i < r.n; ++i) scalar(i);
    for (; i + lanes <= r.n; i += lanes) hn::Stream(body(i), d, out + i);
  } else {
    for (; i + lanes <= r.n; i += lanes) hn::StoreU(body(i), d, out + i);
  }
  for (; i < r.n; ++i) scalar(i);
}

// ---- to and from float32 bits, lane by lane as dtype_bits.h ----
template <class DU, class V = hn::Vec<DU>>
HWY_INLINE V decode_e4m3(DU du, V c) {
  const hn::RebindToSigned<DU> di;
  const hn::RebindToFloat<DU> df;
  const V em = hn::And(c, hn::Set(du, 0x7Fu));
  const V normal = hn::Add(hn::ShiftLeft<20>(em), hn::Set(du, (127u - 7u) << 23));
  const V sub = hn::BitCast(du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, em)), hn::Set(df, 0x1.0p-9f)));
  V mag = hn::IfThenElse(hn::RebindMask(du, hn::Lt(hn::BitCast(di, em), hn::Set(di, 8))), sub, normal);
  mag = hn::IfThenElse(hn::Eq(em, hn::Set(du, 0x7Fu)), hn::Set(du, 0x7FC00000u), mag);
  return hn::Or(mag, hn::ShiftLeft<24>(hn::And(c, hn::Set(du, 0x80u))));
}

// w: an fp16 in the top 16 bits (bits::f16_to_f32).
template <class DU, class V = hn::Vec<DU>>
HWY_INLINE V decode_f16(DU du, V w) {
  const hn::RebindToFloat<DU> df;
  const V sign = hn::And(w, hn::Set(du, 0x80000000u));
  const V two_w = hn::Add(w, w);
  const auto normalized =
      hn::Mul(hn::BitCast(df, hn::Add(hn::ShiftRight<4>(two_w), hn::Set(du, 0xE0u << 23))), hn::Set(df, 0x1.0p-112f));
  const auto denormalized =
      hn::Sub(hn::BitCast(df, hn::Or(hn::ShiftRight<17>(two_w), hn::Set(du, 126u << 23))), hn::Set(df, 0.5f));
  const auto is_denormal = hn::Eq(hn::ShiftRight<27>(two_w), hn::Zero(du));  // two_w < 2^27
  return hn::Or(sign, hn::IfThenElse(is_denormal, hn::BitCast(du, denormalized), hn::BitCast(du, normalized)));
}

// Float32 bits to bf16 (bits::f32_to_bf16), in the low half of each lane.
template <class DU, class V = hn::Vec<DU>>
HWY_INLINE V encode_bf16(DU du, V u) {
  const hn::RebindToSigned<DU> di;
  const V rounded =
      hn::ShiftRight<16>(hn::Add(hn::Add(u, hn::Set(du, 0x7FFFu)), hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u))));
  const auto nan = hn::RebindMask(du, hn::Gt(hn::BitCast(di, hn::And(u, hn::Set(du, 0x7FFFFFFFu))),
                                             hn::Set(di, 0x7F800000)));
  return hn::IfThenElse(nan, hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40u)), rounded);
}

// Float32 bits to fp16 (bits::f32_to_f16), in the low half of each lane.
template <class DU, class V = hn::Vec<DU>>
HWY_INLINE V encode_f16(DU du, V w) {
  const hn::RebindToSigned<DU> di;
  const hn::RebindToFloat<DU> df;
  const V abs_w = hn::And(w, hn::Set(du, 0x7FFFFFFFu));
  auto base = hn::Mul(hn::Mul(hn::BitCast(df, abs_w), hn::Set(df, 0x1.0p+112f)), hn::Set(df, 0x1.0p-110f));
  const V shl1_w = hn::Add(w, w);
  const V sign = hn::And(w, hn::Set(du, 0x80000000u));
  const V bias = hn::Max(hn::And(shl1_w, hn::Set(du, 0xFF000000u)), hn::Set(du, 0x71000000u));
  base = hn::Add(hn::BitCast(df, hn::Add(hn::ShiftRight<1>(bias), hn::Set(du, 0x07800000u))), base);
  const V b = hn::BitCast(du, base);
  const V nonsign = hn::Add(hn::And(hn::ShiftRight<13>(b), hn::Set(du, 0x7C00u)), hn::And(b, hn::Set(du, 0x0FFFu)));
  // shl1_w > 0xFF000000 (scalar) is |w| > Inf: NaN.
  const auto nan = hn::RebindMask(du, hn::Gt(hn::BitCast(di, abs_w), hn::Set(di, 0x7F800000)));
  return hn::Or(hn::ShiftRight<16>(sign), hn::IfThenElse(nan, hn::Set(du, 0x7E00u), nonsign));
}

// Every pair in 32-bit lanes: decode to float32 bits, scale FP8, encode.
template <Fmt kIn, Fmt kOut>
void arithmetic(const Run& r) {
  const hn::ScalableTag<std::uint32_t> du;
  const hn::RebindToFloat<decltype(du)> df;
  const hn::RebindToSigned<decltype(du)> di;
  const hn::Rebind<std::uint8_t, decltype(du)> d8;
  const hn::Rebind<std::uint16_t, decltype(du)> d16;
  const auto scale = hn::Set(df, r.scale);
  auto value = [&](std::uint64_t i) {
    if constexpr (kIn == kE4M3 || kIn == kE5M2) {
      const auto c = hn::PromoteTo(du, hn::LoadU(d8, r.src + i));
      const auto x = kIn == kE4M3 ? decode_e4m3(du, c) : decode_f16(du, hn::ShiftLeft<24>(c));
      return hn::BitCast(du, hn::Mul(hn::BitCast(df, x), scale));
    } else if constexpr (kIn == kBF16 || kIn == kF16) {
      const auto h = hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, reinterpret_cast<const std::uint16_t*>(r.src) + i)));
      return kIn == kBF16 ? h : decode_f16(du, h);
    } else {
      return hn::LoadU(du, reinterpret_cast<const std::uint32_t*>(r.src) + i);
    }
  };
  auto scalar = [&](std::uint64_t i) { one<kIn, kOut>(r, i); };
  if constexpr (kOut == kF32) {
    drive(r, du, value, scalar);
  } else {
    // Two vectors of 32-bit lanes make one of 16-bit outputs: whole
    // vectors only (Highway 1.0's Stream of a half vector writes a whole one).
    const hn::Repartition<std::uint16_t, decltype(du)> d16_full;
    const std::uint64_t lanes = hn::Lanes(du);
    auto half = [&](std::uint64_t i) {
      const auto v = value(i);
      return hn::DemoteTo(d16, hn::BitCast(di, kOut == kBF16 ? encode_bf16(du, v) : encode_f16(du, v)));
    };
    drive(r, d16_full, [&](std::uint64_t i) { return hn::Combine(d16_full, half(i + lanes), half(i)); }, scalar);
  }
}

// FP8 to bf16 or fp16 by exponent table (Note [FP8 by exponent table]).
template <Fmt kIn, Fmt kOut>
void by_exponent(const Run& r, const Fp8Table& t) {
  const hn::ScalableTag<std::uint16_t> d16;
  const hn::Repartition<std::uint8_t, decltype(d16)> d8;
  const hn::Rebind<std::uint8_t, decltype(d16)> d8h;
  constexpr unsigned kMant = kIn == kE4M3 ? 3 : 2;
  constexpr unsigned kOutMant = kOut == kBF16 ? 7 : 10;
  constexpr std::uint16_t kExpMask = kIn == kE4M3 ? 0x78 : 0x7C;
  const auto normal = hn::LoadDup128(d8, reinterpret_cast<const std::uint8_t*>(t.normal));
  const auto subnormal = hn::LoadDup128(d8, reinterpret_cast<const std::uint8_t*>(t.subnormal));
  const auto special = hn::LoadDup128(d8, reinterpret_cast<const std::uint8_t*>(t.special));
  auto body = [&](std::uint64_t i) {
    const auto c = hn::PromoteTo(d16, hn::LoadU(d8h, r.src + i));
    const auto ebits = hn::And(c, hn::Set(d16, kExpMask));
    // Byte indices of entry m in a table of 16-bit entries: 2m, 2m + 1.
    const auto m = hn::And(c, hn::Set(d16, (1u << kMant) - 1));
    const auto index = hn::BitCast(d8, hn::Add(hn::Mul(m, hn::Set(d16, 0x0202)), hn::Set(d16, 0x0100)));
    auto out = hn::IfThenElse(hn::Eq(ebits, hn::Zero(d16)), hn::BitCast(d16, hn::TableLookupBytes(subnormal, index)),
                              hn::BitCast(d16, hn::TableLookupBytes(normal, index)));
    out = hn::Add(out, hn::ShiftLeft<kOutMant - kMant>(ebits));
    if constexpr (kIn == kE4M3) {
      out = hn::IfThenElse(hn::Eq(hn::And(c, hn::Set(d16, 0x7F)), hn::Set(d16, 0x7F)), hn::Set(d16, t.special[0]), out);
    } else {
      out = hn::IfThenElse(hn::Eq(ebits, hn::Set(d16, kExpMask)), hn::BitCast(d16, hn::TableLookupBytes(special, index)),
                           out);
    }
    return hn::Xor(out, hn::ShiftLeft<8>(hn::And(c, hn::Set(d16, 0x80))));
  };
  drive(r, d16, body, [&](std::uint64_t i) { std::memcpy(r.dst + 2 * i, &t.values[r.src[i]], 2); });
}

#if HWY_TARGET == HWY_AVX3_DL
// 64 codes to 64 16-bit outputs per step with AVX-512 VBMI byte permutes:
// the table's low and high bytes are each two 128-entry halves
// (permutex2var picks by the low 7 bits, the sign bit picks the half).
// kStream: dst + 2 * i is 64-byte aligned, and the stores are non-temporal.
template <bool kStream>
std::uint64_t lookup16_vbmi(const std::uint16_t* table, const std::uint8_t* src, std::uint8_t* dst, std::uint64_t n) {
  alignas(64) std::uint8_t lo[256], hi[256];
  for (int i = 0; i < 256; ++i) {
    lo[i] = static_cast<std::uint8_t>(table[i] & 0xFF);
    hi[i] = static_cast<std::uint8_t>(table[i] >> 8);
  }
  const __m512i lo0 = _mm512_load_si512(lo), lo1 = _mm512_load_si512(lo + 64);
  const __m512i lo2 = _mm512_load_si512(lo + 128), lo3 = _mm512_load_si512(lo + 192);
  const __m512i hi0 = _mm512_load_si512(hi), hi1 = _mm512_load_si512(hi + 64);
  const __m512i hi2 = _mm512_load_si512(hi + 128), hi3 = _mm512_load_si512(hi + 192);
  std::uint64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i idx = _mm512_loadu_si512(src + i);
    const __mmask64 upper = _mm512_movepi8_mask(idx);
    const __m512i l = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(lo0, idx, lo1),
                                             _mm512_permutex2var_epi8(lo2, idx, lo3));
    const __m512i h = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(hi0, idx, hi1),
                                             _mm512_permutex2var_epi8(hi2, idx, hi3));
    // Interleave low and high bytes within 128-bit lanes, then put the
    // lanes back in element order.
    const __m512i a = _mm512_unpacklo_epi8(l, h);  // lanes: e0-7, e16-23, e32-39, e48-55
    const __m512i b = _mm512_unpackhi_epi8(l, h);  // lanes: e8-15, e24-31, e40-47, e56-63
    const __m512i first = _mm512_permutex2var_epi64(a, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), b);
    const __m512i second = _mm512_permutex2var_epi64(a, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), b);
    if constexpr (kStream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i * 2), first);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i * 2 + 64), second);
    } else {
      _mm512_storeu_si512(dst + i * 2, first);
      _mm512_storeu_si512(dst + i * 2 + 64, second);
    }
  }
  return i;
}

void fp8_vbmi(const Run& r, const Fp8Table& t) {
  auto scalar = [&](std::uint64_t from, std::uint64_t to) {
    for (std::uint64_t i = from; i < to; ++i) std::memcpy(r.dst + 2 * i, &t.values[r.src[i]], 2);
  };
  std::uint64_t i = 0;
  if (r.stream) {
    const std::uint64_t head = std::min<std::uint64_t>(r.n, ((64 - (reinterpret_cast<std::uintptr_t>(r.dst) & 63)) & 63) / 2);
    scalar(0, head);
    i = head + lookup16_vbmi<true>(t.values, r.src + head, r.dst + head * 2, r.n - head);
  } else {
    i = lookup16_vbmi<false>(t.values, r.src, r.dst, r.n);
  }
  scalar(i, r.n);
}
#endif

template <Fmt kIn, Fmt kOut>
void fp8_to_16(const Run& r) {
  // Below this the table costs more than it saves (unless the thread's
  // last table is the one: per-row scales of one tensor are each a table).
  if (r.n < 512) return arithmetic<kIn, kOut>(r);
  const Fp8Table& t = fp8_table(r.from, r.to, r.scale);
#if HWY_TARGET == HWY_AVX3_DL
  return fp8_vbmi(r, t);
#else
  if (t.by_exponent) return by_exponent<kIn, kOut>(r, t);
  return arithmetic<kIn, kOut>(r);
#endif
}

template <Fmt kIn>
bool from(const Run& r) {
  switch (r.to) {
    case DType::kBF16:
      if constexpr (kIn == kE4M3 || kIn == kE5M2) return fp8_to_16<kIn, kBF16>(r), true;
      return arithmetic<kIn, kBF16>(r), true;
    case DType::kF16:
      if constexpr (kIn == kE4M3 || kIn == kE5M2) return fp8_to_16<kIn, kF16>(r), true;
      return arithmetic<kIn, kF16>(r), true;
    case DType::kF32: return arithmetic<kIn, kF32>(r), true;
    default: return false;
  }
}

bool ConvertRun(const Run* run) {
  const Run& r = *run;
  // Elements at addresses that are not multiples of their size (only in
  // tests) go to the plain loops, which take any address.
  const unsigned in = r.from == DType::kF32 ? 4 : (r.from == DType::kBF16 || r.from == DType::kF16 ? 2 : 1);
  const unsigned out = r.to == DType::kF32 ? 4 : 2;
  if (reinterpret_cast<std::uintptr_t>(r.src) % in != 0 || reinterpret_cast<std::uintptr_t>(r.dst) % out != 0) {
    return false;
  }
  switch (r.from) {
    case DType::kF8_E4M3: return from<kE4M3>(r);
    case DType::kF8_E5M2: return from<kE5M2>(r);
    case DType::kBF16: return from<kBF16>(r);
    case DType::kF16: return from<kF16>(r);
    case DType::kF32: return from<kF32>(r);
    default: return false;
  }
}
#endif  // HWY_TARGET != HWY_SCALAR

}  // namespace HWY_NAMESPACE
}  // namespace pinload::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "format/simd.h"
#include "pinload/error.h"

namespace pinload::simd {

HWY_EXPORT(ConvertRun);

namespace {

struct NamedTarget {
  const char* name;
  std::int64_t bit;
};
// Best first (Highway's lower bits are better targets).
constexpr NamedTarget kTargets[] = {
#if HWY_ARCH_X86
    {"avx512vbmi", HWY_AVX3_DL}, {"avx512", HWY_AVX3}, {"avx2", HWY_AVX2}, {"sse4", HWY_SSE4}, {"ssse3", HWY_SSSE3},
#elif HWY_ARCH_ARM_A64
    {"sve2_128", HWY_SVE2_128}, {"sve256", HWY_SVE_256}, {"sve2", HWY_SVE2}, {"sve", HWY_SVE}, {"neon", HWY_NEON},
#endif
    {"scalar", 0},
};

std::mutex g_mutex;
std::atomic<bool> g_applied{false};  // PINLOAD_SIMD read, or set_target called
std::atomic<bool> g_plain{false};    // "scalar": the plain loops

// What this CPU runs of what this file was compiled for, before any
// override (SupportedTargets returns the forced one after it).
std::int64_t runnable_mask() {
  static const std::int64_t mask = [] {
    hwy::SetSupportedTargetsForTest(0);
    return hwy::SupportedTargets() & HWY_TARGETS;
  }();
  return mask;
}

void apply(std::string_view name) {
  const std::int64_t runnable = runnable_mask();
  if (name.empty() || name == "best") {
    hwy::SetSupportedTargetsForTest(0);
    g_plain = false;
  } else {
    const NamedTarget* found = nullptr;
    for (const NamedTarget& t : kTargets) {
      if (name == t.name && (t.bit == 0 || (runnable & t.bit) != 0)) found = &t;
    }
    if (found == nullptr) {
      std::string list;
      for (const std::string& t : runnable_targets()) list += (list.empty() ? "" : ", ") + t;
      throw InvalidArgumentError("SIMD target '" + std::string(name) + "' (PINLOAD_SIMD) is not one this build runs on this CPU: " +
                                 list);
    }
    g_plain = found->bit == 0;
    if (found->bit != 0) hwy::SetSupportedTargetsForTest(found->bit);
  }
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

void ensure_applied() {
  if (g_applied.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_applied.load(std::memory_order_relaxed)) return;
  const char* env = std::getenv("PINLOAD_SIMD");
  apply(env != nullptr ? env : "");
  g_applied.store(true, std::memory_order_release);
}

}  // namespace

std::vector<std::string> runnable_targets() {
  std::vector<std::string> out;
  for (const NamedTarget& t : kTargets) {
    if (t.bit == 0 || (runnable_mask() & t.bit) != 0) out.emplace_back(t.name);
  }
  return out;
}

std::string target() {
  ensure_applied();
  if (g_plain) return "scalar";
  const std::int64_t chosen = hwy::SupportedTargets() & HWY_TARGETS;
  const std::int64_t best = chosen & -chosen;
  for (const NamedTarget& t : kTargets) {
    if (t.bit == best) return t.name;
  }
  return "scalar";  // Highway's scalar target: the plain loops
}

void set_target(std::string_view name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  apply(name);
  g_applied.store(true, std::memory_order_release);
}

bool convert_run(const Run& run) {
  ensure_applied();
  if (g_plain.load(std::memory_order_relaxed)) return false;
  return HWY_DYNAMIC_DISPATCH(ConvertRun)(&run);
}

const Fp8Table& fp8_table(DType from, DType to, float scale) {
  thread_local Fp8Table t;
  const std::uint32_t scale_bits = bits::f32_bits(scale);
  if (t.from == from && t.to == to && t.scale_bits == scale_bits) return t;
  const bool e4 = from == DType::kF8_E4M3;
  for (unsigned code = 0; code < 256; ++code) {
    const std::uint8_t b = static_cast<std::uint8_t>(code);
    const float x = (e4 ? bits::e4m3_to_f32(b) : bits::e5m2_to_f32(b)) * scale;
    t.values[code] = to == DType::kBF16 ? bits::f32_to_bf16(x) : bits::f32_to_f16(x);
  }
  // Note [FP8 by exponent table]: the tables, then every code checked.
  const unsigned mant = e4 ? 3 : 2, out_mant = to == DType::kBF16 ? 7 : 10;
  const unsigned exp_mask = e4 ? 0x78 : 0x7C;
  std::memset(t.normal, 0, sizeof t.normal);
  std::memset(t.subnormal, 0, sizeof t.subnormal);
  std::memset(t.special, 0, sizeof t.special);
  for (unsigned m = 0; m < (1u << mant); ++m) {
    t.normal[m] = static_cast<std::uint16_t>(t.values[(1u << mant) | m] - (1u << out_mant));
    t.subnormal[m] = t.values[m];
    if (!e4) t.special[m] = t.values[exp_mask | m];
  }
  if (e4) t.special[0] = t.values[0x7F];
  t.by_exponent = true;
  for (unsigned c = 0; c < 256 && t.by_exponent; ++c) {
    const unsigned ebits = c & exp_mask, m = c & ((1u << mant) - 1);
    unsigned out = ebits == 0 ? t.subnormal[m] : t.normal[m] + (ebits << (out_mant - mant));
    if (e4 ? (c & 0x7F) == 0x7F : ebits == exp_mask) out = t.special[e4 ? 0 : m];
    out = (out ^ ((c & 0x80) << 8)) & 0xFFFF;
    t.by_exponent = out == t.values[c];
  }
  t.from = from;
  t.to = to;
  t.scale_bits = scale_bits;
  return t;
}

}  // namespace pinload::simd
#endif  // HWY_ONCE
