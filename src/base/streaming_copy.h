// Internal: a copy whose stores bypass the cache (non-temporal), for
// destinations written once and read later or by a DMA engine, so that
// write-allocate reads of them cost no bandwidth. Shared by the mapped copy
// (io/mapped_copy.cc) and the dtype conversions (format/dtype_convert.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define PINLOAD_STREAMING_STORES 1
#endif

namespace pinload::detail {

// Copies `bytes` from `src` to `dst`: whole 16-byte units streamed, the
// unaligned head and the tail with memcpy. The streamed stores are weakly
// ordered: call streaming_fence() before another thread may read `dst`.
inline void streaming_copy(void* dst_, const void* src_, std::size_t bytes) noexcept {
  auto* dst = static_cast<std::uint8_t*>(dst_);
  const auto* src = static_cast<const std::uint8_t*>(src_);
#ifdef PINLOAD_STREAMING_STORES
  std::size_t i = std::min<std::size_t>(bytes, (16 - (reinterpret_cast<std::uintptr_t>(dst) & 15)) & 15);
  std::memcpy(dst, src, i);
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  }
  std::memcpy(dst + i, src + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

inline void streaming_fence() noexcept {
#ifdef PINLOAD_STREAMING_STORES
  _mm_sfence();
#endif
}

}  // namespace pinload::detail
