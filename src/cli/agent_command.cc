// pinload agent: the node agent (trace/agent.h).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>

#include "cli/size_arg.h"
#include "cli/trace_commands.h"
#include "trace/agent.h"

namespace pinload::cli {

namespace {

constexpr const char* kAgentUsage = "usage: pinload agent --root DIR... --templates DIR [--idle-ms N] [--threads N]\n";

std::atomic<bool> g_agent_stop{false};
void on_agent_signal(int) { g_agent_stop.store(true); }

}  // namespace

int run_agent_command(int argc, char** argv) {
  trace::AgentOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "pinload agent: error: unexpected '%s'\n%s", a.c_str(), kAgentUsage);
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--root") {
      options.roots.push_back(v);
    } else if (a == "--templates") {
      options.templates_dir = v;
    } else if (a == "--idle-ms" || a == "--threads") {
      const auto n = parse_size_arg(v);
      if (!n || *n == 0 || *n > 3600000) {
        std::fprintf(stderr, "pinload agent: error: %s takes a positive number\n", a.c_str());
        return 2;
      }
      if (a == "--idle-ms") options.idle_ms = static_cast<int>(*n);
      else options.warm_threads = static_cast<unsigned>(std::min<std::uint64_t>(*n, 256));
    } else {
      std::fprintf(stderr, "pinload agent: error: unexpected '%s'\n%s", a.c_str(), kAgentUsage);
      return 2;
    }
  }
  if (options.roots.empty() || options.templates_dir.empty()) {
    std::fprintf(stderr, "pinload agent: error: --root and --templates are required\n%s", kAgentUsage);
    return 2;
  }
  struct sigaction sa {};
  sa.sa_handler = on_agent_signal;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  options.stop = &g_agent_stop;
  return trace::run_agent(options);
}

}  // namespace pinload::cli
