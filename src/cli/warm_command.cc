// pinload warm: replays a template (or whole files) into the page cache,
// optionally following a consumer with a budget (trace/warmer.h).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/size_arg.h"
#include "cli/trace_commands.h"
#include "pinload/env.h"
#include "pinload/io_template.h"
#include "trace/trace_recorder.h"
#include "trace/warmer.h"

namespace pinload::cli {

namespace {

constexpr const char* kWarmUsage =
    "usage: pinload warm (--template T | PATH...) [--budget BYTES] [--follow PID | --cgroup DIR] [--threads N]\n"
    "PATH: a file or a folder (its regular files, recursively), warmed whole in the order given.\n";

std::atomic<bool> g_stop{false};
void on_sigterm(int) { g_stop.store(true); }

bool identity_of(const std::string& path, TemplateFile* out) {
  Env* env = default_env();
  const int fd = env->open_read(path, 0);
  if (fd < 0) return false;
  FileStat st;
  const int rc = env->stat(fd, &st);
  env->close(fd);
  if (rc < 0) return false;
  *out = TemplateFile{path, "", st.size, st.mtime_ns, st.inode, st.device};
  return true;
}

}  // namespace

int run_warm_command(int argc, char** argv) {
  std::string template_file;
  std::vector<std::string> paths;
  trace::WarmOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--template" && has_value) {
      template_file = argv[++i];
    } else if ((a == "--budget" || a == "--threads" || a == "--follow") && has_value) {
      const auto n = parse_size_arg(argv[++i]);
      if (!n || (a != "--budget" && *n == 0)) {
        std::fprintf(stderr, "pinload warm: error: %s takes a number\n%s", a.c_str(), kWarmUsage);
        return 2;
      }
      if (a == "--budget") options.budget = *n;
      else if (a == "--threads") options.threads = static_cast<unsigned>(std::min<std::uint64_t>(*n, 256));
      else options.follow_pid = static_cast<pid_t>(*n);
    } else if (a == "--cgroup" && has_value) {
      options.follow_cgroup = argv[++i];
    } else if (!a.empty() && a[0] != '-') {
      paths.push_back(a);
    } else {
      std::fprintf(stderr, "pinload warm: error: unexpected '%s'\n%s", a.c_str(), kWarmUsage);
      return 2;
    }
  }
  if (template_file.empty() == paths.empty()) {
    std::fprintf(stderr, "pinload warm: error: give either --template or PATHs\n%s", kWarmUsage);
    return 2;
  }
  if (options.budget > 0 && options.follow_pid == 0 && options.follow_cgroup.empty()) {
    std::fprintf(stderr, "pinload warm: error: --budget needs a consumer to follow (--follow or --cgroup)\n");
    return 2;
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
      for (const std::string& f : found) {
        TemplateFile tf;
        if (identity_of(f, &tf)) files.push_back(tf);
        else std::fprintf(stderr, "pinload warm: cannot open %s; skipped\n", f.c_str());
      }
    }
    plan = trace::plan_whole_files(files);
    source = "plain paths";
  }
  const trace::WarmReport r = trace::warm(plan, options);
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
  // This process's own I/O counters (/proc/self/io), so a caller can check
  // that a replay read each byte once.
  std::ifstream io("/proc/self/io");
  std::string key;
  std::uint64_t value = 0;
  while (io >> key >> value) {
    if (key == "rchar:" || key == "read_bytes:") out["proc_io"][key.substr(0, key.size() - 1)] = value;
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace pinload::cli
