// pinload/memory_limit.h: how much host memory this process can still take.
//
// Note [Memory limits]
// A load that takes more memory than its cgroup allows is not refused by the
// kernel: the process is OOM-killed, with no error, part way through. So
// every load checks, before it reserves anything, that the host memory it
// will take fits what is left: its files' blocks, and beside them a host
// conversion's output and ring, a streaming device load's pinned staging, and
// the stand-in device's buffers (host memory too, which its allocator checks
// again); otherwise it fails with OutOfMemoryError naming the file, the bytes
// needed and the limit. What is left is the least of
//   - /proc/meminfo MemAvailable;
//   - for the process's memory cgroup and each of its ancestors: the limit
//     (cgroup v2 memory.max, v1 memory.limit_in_bytes) less what the cgroup
//     uses (memory.current, memory.usage_in_bytes) other than page cache
//     (memory.stat "file", v1 "total_cache"), which the kernel reclaims
//     before it kills.
// The estimate is a snapshot; other processes may take memory meanwhile.
// The pool's own budget (PoolOptions::capacity_bytes, --pool-bytes in the
// CLI, pool_bytes= in Python) is a separate, exact cap.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "pinload/env.h"

namespace pinload {

struct HostMemoryLimit {
  std::uint64_t available_bytes = 0;  // what the process can still take
  std::string source;                 // what set it: "MemAvailable", "cgroup v1 ... limit 1610612736 ...", ...
};

// The tightest limit above, read through `env` from `root` + "/proc/..." and
// `root` + "/sys/fs/cgroup/..." (root "" is the real system; tests pass a fake
// tree). nullopt where nothing can be read. Never throws.
std::optional<HostMemoryLimit> read_host_memory_limit(Env* env, const std::string& root = "");

}  // namespace pinload
