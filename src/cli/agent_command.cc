// pinload agent: the node agent (trace/agent.h).
#include <signal.h>

#include <atomic>
#include <memory>

#include "cli/command.h"
#include "pinload/read_options.h"
#include "trace/agent.h"

namespace pinload::cli {

namespace {

std::atomic<bool> g_agent_stop{false};
void on_agent_signal(int) { g_agent_stop.store(true); }

}  // namespace

void add_agent_command(CLI::App& app) {
  auto options = std::make_shared<trace::AgentOptions>();
  CLI::App* command = app.add_subcommand(
      "agent", "Per service: record the first start, replay it later (docs/trace.md)");
  command->add_option("--root", options->roots, "a folder of models to watch (repeatable)")->type_name("DIR")->required();
  command->add_option("--templates", options->templates_dir, "where templates are kept (outside the roots)")
      ->type_name("DIR")
      ->required();
  command->add_option("--idle-ms", options->idle_ms, "a recording ends after this long without reads")
      ->transform(integer_range(1, 3600000))
      ->type_name("MS 1..3600000")
      ->capture_default_str();
  command->add_option("--threads", options->warm_threads, "concurrent reads of a replay")
      ->transform(integer_range(1, kMaxThreads))  // as load --threads
      ->type_name("1..1024")
      ->capture_default_str();
  command->callback([options] {
    struct sigaction sa {};
    sa.sa_handler = on_agent_signal;
    ::sigaction(SIGTERM, &sa, nullptr);
    ::sigaction(SIGINT, &sa, nullptr);
    options->stop = &g_agent_stop;
    const int status = trace::run_agent(*options);
    if (status != 0) throw CLI::RuntimeError(status);
  });
}

}  // namespace pinload::cli
