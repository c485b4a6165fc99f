// trace/warmer.h: replays a warm plan into the page cache.
//
// Threads only execute the plan (warm_plan.h): each takes the next piece in
// plan order and reads it with one buffered pread into a scratch buffer, on
// a descriptor with POSIX_FADV_RANDOM so the kernel reads exactly the piece
// (no readahead past it): a replay reads each byte once. It stops early on
// *stop (SIGTERM) or sustained memory pressure. With a budget and a consumer
// to follow, it burns after reading (Note [Burn after reading]).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "trace/warm_plan.h"

namespace pinload::trace {

struct WarmOptions {
  unsigned threads = 8;      // concurrent preads: queue depth for the disk, not CPU
  std::uint64_t budget = 0;  // 0: none; else bytes warmed-and-not-dropped at most
  pid_t follow_pid = 0;      // follow this process and its children ...
  std::string follow_cgroup; // ... or the processes of this cgroup folder
  // Memory pressure: pause while the memory cgroup (follow_cgroup, else the
  // warmer's own) is above this fraction of its limit, or the machine's
  // MemAvailable below 1 - it; give up after pressure_give_up_ms of it.
  double pressure_fraction = 0.92;
  int pressure_give_up_ms = 3000;
  const std::atomic<bool>* stop = nullptr;  // set by a signal handler: stop soon
};

struct WarmReport {
  std::string mode;  // "follow (fanotify pre-content events)" or why not
  std::uint64_t planned = 0, warmed = 0, skipped = 0, dropped = 0;
  std::uint64_t consumer_events = 0;
  double seconds = 0;
  std::string interrupted;  // "" or why it stopped early
};

// Warms `plan`. Opens every file first (and checks its identity against the
// plan: a file changed since is skipped with a warning). Never throws for
// I/O trouble: a failed read skips its piece. The consumer is never blocked
// beyond the kernel's delivery of an event (Note [Pre-content events]).
WarmReport warm(const WarmPlan& plan, const WarmOptions& options);

// The memory cgroup folder of process `pid` (0: this one), v2 or v1, or "".
std::string memory_cgroup_of(pid_t pid);
// usage / limit of a memory cgroup folder (v2 memory.current / memory.max,
// v1 memory.usage_in_bytes / memory.limit_in_bytes); false if unlimited or unknown.
bool cgroup_memory(const std::string& folder, std::uint64_t* usage, std::uint64_t* limit);

}  // namespace pinload::trace
