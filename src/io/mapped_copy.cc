#include "io/mapped_copy.h"

#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <mutex>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define PINLOAD_STREAMING_STORES 1
#endif

namespace pinload::detail {
namespace {

struct sigaction previous_sigbus;

// Set while this thread copies in copy_from_mapping: where a SIGBUS jumps to.
// initial-exec: the handler must not be the first to touch it (a dynamic TLS
// access may allocate, which a signal handler must not).
__attribute__((tls_model("initial-exec"))) thread_local sigjmp_buf* copy_escape = nullptr;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (sigjmp_buf* escape = copy_escape) {
    copy_escape = nullptr;
    siglongjmp(*escape, 1);
  }
  // Not ours: behave as the handler before us.
  if (previous_sigbus.sa_flags & SA_SIGINFO) {
    previous_sigbus.sa_sigaction(sig, info, context);
  } else if (previous_sigbus.sa_handler != SIG_DFL && previous_sigbus.sa_handler != SIG_IGN) {
    previous_sigbus.sa_handler(sig);
  } else {
    // Restore it and raise again: on return the signal gets the default
    // action (a core dump), as without pinload.
    sigaction(SIGBUS, &previous_sigbus, nullptr);
    raise(sig);
  }
}

void install_handler_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &previous_sigbus);
  });
}

// Streams whole 64-byte lines past the cache: the destination is a block
// that is written once and read later (or by a DMA engine), so write-allocate
// reads of it would only cost bandwidth.
void stream_copy(std::byte* dst, const std::byte* src, std::size_t bytes) noexcept {
#ifdef PINLOAD_STREAMING_STORES
  std::size_t i = 0;
  // Align the destination to 16 bytes for _mm_stream_si128.
  const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16;
  if (head >= bytes) {
    std::memcpy(dst, src, bytes);
    return;
  }
  std::memcpy(dst, src, head);
  i = head;
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
  _mm_sfence();  // streaming stores are weakly ordered: publish before the chunk is marked done
  std::memcpy(dst + i, src + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

}  // namespace

bool copy_from_mapping(std::byte* dst, const std::byte* src, std::size_t bytes) noexcept {
  install_handler_once();
  sigjmp_buf escape;
  // Save the signal mask: the jump leaves the handler with SIGBUS blocked.
  if (sigsetjmp(escape, 1) != 0) return false;
  copy_escape = &escape;
  stream_copy(dst, src, bytes);
  copy_escape = nullptr;
  return true;
}

}  // namespace pinload::detail
