// trace/agent.h: the node agent. It watches every read under its roots; the
// first start of a service (a reader process) is recorded as a template,
// keyed by the files it read (template_path in io_template.h); when a later
// process's first read is the first read of a known template, it replays
// that template at once (warmer.h), unless a file's identity changed, in
// which case the template is deleted and the process recorded afresh.
//
// Every event is allowed before it is looked at (Note [Pre-content events]);
// if the agent dies, the kernel allows what was pending, so a crashed agent
// never blocks or fails a consumer. Files outside the roots are ignored;
// symlinks are never followed out of them (only folders under the roots are
// marked, and each read's real path must lie under a root).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace pinload::trace {

struct AgentOptions {
  std::vector<std::string> roots;
  std::string templates_dir;
  int idle_ms = 5000;         // a recording ends when its process exits or reads nothing for this long
  int rescan_ms = 2000;       // new folders under the roots are marked this often
  unsigned warm_threads = 8;
  const std::atomic<bool>* stop = nullptr;  // SIGTERM: save what is recorded, then return
};

// Runs until *stop. Returns 0, or 1 with the reason on stderr when
// pre-content events are unavailable (the agent has nothing to do then).
int run_agent(const AgentOptions& options);

}  // namespace pinload::trace
