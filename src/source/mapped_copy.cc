#include "source/mapped_copy.h"

#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "base/streaming_copy.h"

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

// The destination is a block written once and read later (or by a DMA
// engine): streamed past the cache, then fenced so that the stores are
// published before the chunk is marked done.
void stream_copy(std::byte* dst, const std::byte* src, std::size_t bytes) noexcept {
  detail::streaming_copy(dst, src, bytes);
  detail::streaming_fence();
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
