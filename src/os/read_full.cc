#include "os/read_full.h"

#include <algorithm>
#include <cerrno>

namespace pinload {

ReadResult read_full(Env* env, int fd, void* buffer, std::uint64_t need, std::uint64_t offset, std::uint64_t ask,
                     std::uint64_t alignment) {
  auto* out = static_cast<std::byte*>(buffer);
  ask = std::max(ask, need);
  ReadResult r;
  while (r.bytes < need) {
    const std::int64_t n = env->pread(fd, out + r.bytes, static_cast<std::size_t>(ask - r.bytes), offset + r.bytes);
    if (n == -EINTR || n == -EAGAIN) continue;
    if (n < 0) {
      r.error = static_cast<int>(-n);
      return r;
    }
    if (n == 0) {
      r.ended = true;
      return r;
    }
    r.bytes += static_cast<std::uint64_t>(n);
    if (alignment > 1 && r.bytes < need && (offset + r.bytes) % alignment != 0) return r;
  }
  return r;
}

WriteResult write_full(Env* env, int fd, const void* buffer, std::uint64_t bytes, std::uint64_t offset) {
  const auto* in = static_cast<const std::byte*>(buffer);
  WriteResult r;
  while (r.bytes < bytes) {
    const std::int64_t n = env->pwrite(fd, in + r.bytes, static_cast<std::size_t>(bytes - r.bytes), offset + r.bytes);
    if (n == -EINTR || n == -EAGAIN) continue;
    if (n <= 0) {
      r.error = n < 0 ? static_cast<int>(-n) : EIO;
      return r;
    }
    r.bytes += static_cast<std::uint64_t>(n);
  }
  return r;
}

}  // namespace pinload
