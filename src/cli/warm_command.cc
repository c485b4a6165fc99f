// pinload warm: replays a template (or whole files) into the page cache,
// optionally following a consumer with a budget (trace/warmer.h).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/size_arg.h"
#include "cli/command.h"
#include "pinload/env.h"
#include "pinload/error.h"
#include "pinload/io_template.h"
#include "pinload/read_options.h"
#include "pinload/remote.h"
#include "trace/trace_recorder.h"
#include "trace/warmer.h"

namespace pinload::cli {

namespace {

struct WarmArgs {
  std::string template_file;
  std::vector<std::string> paths;
  trace::WarmOptions options;
};

std::atomic<bool> g_stop{false};
void on_sigterm(int) { g_stop.store(true); }

// A path that cannot be warmed is an error, not a skip: the caller asked for
// its bytes to be resident, and exit 0 would say they are.
TemplateFile identity_of(const std::string& path) {
  if (is_remote_path(path)) {
    throw InvalidArgumentError(
        "a remote object has no page cache to warm; load it once with PINLOAD_CACHE_DIR set (docs/remote.md) and "
        "warm the local copy",
        ErrorContext{path});
  }
  Env* env = default_env();
  const int fd = env->open_read(path, 0);
  if (fd < 0) throw_os_error("cannot open", -fd, ErrorContext{path});
  FileStat st;
  const int rc = env->stat(fd, &st);
  env->close(fd);
  if (rc < 0) throw_os_error("cannot stat", -rc, ErrorContext{path});
  return TemplateFile{path, "", st.size, st.mtime_ns, st.inode, st.device};
}

struct ProcIo {
  std::uint64_t rchar = 0;       // bytes asked of read calls
  std::uint64_t read_bytes = 0;  // bytes that came from storage
};

ProcIo read_proc_io() {
  ProcIo io;
  std::ifstream in("/proc/self/io");
  std::string key;
  std::uint64_t value = 0;
  while (in >> key >> value) {
    if (key == "rchar:") io.rchar = value;
    if (key == "read_bytes:") io.read_bytes = value;
  }
  return io;
}

int run_warm(WarmArgs& args) {
  const std::string& template_file = args.template_file;
  const std::vector<std::string>& paths = args.paths;
  trace::WarmOptions& options = args.options;
  if (template_file.empty() == paths.empty()) throw UsageError("give either --template or PATHs");
  if (options.budget > 0 && options.follow_pid == 0 && options.follow_cgroup.empty()) {
    throw UsageError("--budget needs a consumer to follow (--follow or --cgroup)");
  }
  struct sigaction sa {};
  sa.sa_handler = on_sigterm;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  options.stop = &g_stop;

  trace::WarmPlan plan;
  std::string source;
  if (!template_file.empty()) {
    // load_template checks every file's identity: a stale template is not replayed.
    const std::optional<IoTemplate> t = load_template(template_file);
    if (!t) {
      std::fprintf(stderr, "pinload warm: %s: no valid template (missing, corrupt or stale: a file changed); nothing replayed\n",
                   template_file.c_str());
      return 3;
    }
    plan = trace::plan_from_template(*t);
    source = t->find(trace::kPageCacheDestination) ? "traced template" : "pinload-recorded template";
  } else {
    std::vector<TemplateFile> files;
    for (const std::string& p : paths) {
      std::error_code ec;
      std::vector<std::string> found;
      if (std::filesystem::is_directory(p, ec)) {
        for (const auto& e : std::filesystem::recursive_directory_iterator(p, ec)) {
          if (e.is_regular_file(ec) && !e.is_symlink(ec)) found.push_back(e.path().string());
        }
        std::sort(found.begin(), found.end());
      } else {
        found.push_back(p);
      }
      for (const std::string& f : found) files.push_back(identity_of(f));
    }
    plan = trace::plan_whole_files(files);
    source = "plain paths";
  }
  // The replay's own I/O: /proc/self/io around it, so what the command read
  // to start (its libraries, the template) is not counted.
  const ProcIo before = read_proc_io();
  const trace::WarmReport r = trace::warm(plan, options);
  const ProcIo after = read_proc_io();
  std::fprintf(stderr, "pinload warm: %s, %s: warmed %.1f MB of %.1f MB in %.2f s%s%s\n", source.c_str(), r.mode.c_str(),
               static_cast<double>(r.warmed) / 1e6, static_cast<double>(r.planned) / 1e6, r.seconds,
               r.interrupted.empty() ? "" : "; stopped: ", r.interrupted.c_str());
  nlohmann::ordered_json out;
  out["source"] = source;
  out["mode"] = r.mode;
  out["planned_bytes"] = r.planned;
  out["warmed_bytes"] = r.warmed;
  out["skipped_bytes"] = r.skipped;
  out["dropped_bytes"] = r.dropped;
  out["consumer_events"] = r.consumer_events;
  out["seconds"] = r.seconds;
  out["interrupted"] = r.interrupted;
  out["proc_io"]["rchar"] = after.rchar - before.rchar;
  out["proc_io"]["read_bytes"] = after.read_bytes - before.read_bytes;
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace

void add_warm_command(CLI::App& app) {
  auto args = std::make_shared<WarmArgs>();
  CLI::App* command = app.add_subcommand(
      "warm", "Replay a template or files into the page cache (docs/trace.md)");
  command->add_option("--template", args->template_file, "a template from pinload trace, pinload agent or pinload's loads")
      ->type_name("TEMPLATE");
  command->add_option("--budget", args->options.budget, "bytes warmed ahead of the consumer (needs --follow or --cgroup)")
      ->transform(size_range(1, 1ull << 50))
      ->type_name("SIZE");
  auto* follow = command->add_option("--follow", args->options.follow_pid, "the consumer: this process and its children")
                     ->transform(integer_range(1, 1 << 30))
                     ->type_name("PID");
  command->add_option("--cgroup", args->options.follow_cgroup, "the consumer: the processes of this cgroup folder")
      ->type_name("DIR")
      ->excludes(follow);
  command->add_option("--threads", args->options.threads, "concurrent reads")
      ->transform(integer_range(1, kMaxThreads))  // as load --threads
      ->type_name("1..1024")
      ->capture_default_str();
  command->add_option("PATH", args->paths, "local files or folders (recursively), warmed whole in order")->type_name("");
  command->callback([args] {
    const int status = run_warm(*args);
    if (status != 0) throw CLI::RuntimeError(status);
  });
}

}  // namespace pinload::cli
