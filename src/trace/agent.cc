#include "trace/agent.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "base/log.h"
#include "pinload/env.h"
#include "pinload/io_template.h"
#include "trace/pre_content.h"
#include "trace/trace_recorder.h"
#include "trace/warm_plan.h"
#include "trace/warmer.h"

namespace pinload::trace {

namespace {

using Clock = std::chrono::steady_clock;

struct Session {
  TraceRecorder recorder;
  bool recording = false;
  Clock::time_point last_read;
};

std::optional<IoTemplate> parse_file(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_template(bytes);
}

// The template in `dir` whose first read is of `path`, if any.
std::string find_template_starting_with(const std::string& dir, const std::string& path) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() != ".pltemplate") continue;
    const std::optional<IoTemplate> t = parse_file(e.path().string());
    if (!t) continue;
    // files are in the order first read or mapped (trace_recorder.h).
    if (!t->files.empty() && t->files.front().path == path) return e.path().string();
  }
  return "";
}

}  // namespace

int run_agent(const AgentOptions& options) {
  std::string why;
  std::unique_ptr<PreContentListener> listener = PreContentListener::open(&why);
  std::vector<std::string> roots, marked;
  for (const std::string& r : options.roots) roots.push_back(canonical_root(r));
  for (const std::string& r : roots) {
    if (!listener) break;
    if (const int rc = listener->mark_tree(r, &marked); rc < 0) {
      why = "cannot mark " + r + ": " + std::strerror(-rc);
      listener.reset();
    }
  }
  if (!listener) {
    std::fprintf(stderr, "pinload agent: pre-content events unavailable (%s); nothing to do\n", why.c_str());
    return 1;
  }
  std::error_code ec;
  std::filesystem::create_directories(options.templates_dir, ec);
  // The agent's own writes would be events it must answer itself (a write
  // is a pre-content event too): its templates live outside the roots.
  for (const std::string& r : roots) {
    if (path_is_under(canonical_root(options.templates_dir), r)) {
      std::fprintf(stderr, "pinload agent: --templates %s must lie outside the root %s\n", options.templates_dir.c_str(),
                   r.c_str());
      return 2;
    }
  }
  std::fprintf(stderr, "pinload agent: watching %zu folder(s) under %zu root(s); templates in %s\n", marked.size(),
               roots.size(), options.templates_dir.c_str());

  Env* env = default_env();
  std::map<pid_t, Session> sessions;  // every reader seen; recording or done
  std::vector<std::thread> replays;
  std::atomic<bool> replay_stop{false};
  const pid_t self = ::getpid();

  auto finish = [&](pid_t pid, Session& s) {
    s.recording = false;
    if (s.recorder.empty()) return;
    const std::string file = template_path(s.recorder.paths(), options.templates_dir);
    try {
      save_template(s.recorder.result(), file);
      std::fprintf(stderr, "pinload agent: recorded pid %d: %s (%llu bytes)\n", pid, file.c_str(),
                   static_cast<unsigned long long>(s.recorder.bytes()));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pinload agent: cannot save %s: %s\n", file.c_str(), e.what());
    }
  };

  auto on_read = [&](const ReadEvent& e) {
    if (e.pid == self) return;
    const std::string path = path_of_fd(e.fd);
    bool inside = false;
    for (const std::string& r : roots) inside = inside || path_is_under(path, r);
    if (!inside) return;
    FileStat st;
    if (env->stat(e.fd, &st) < 0) return;
    const TemplateFile file{path, "", st.size, st.mtime_ns, st.inode, st.device};
    auto [it, fresh] = sessions.try_emplace(e.pid);
    Session& s = it->second;
    if (fresh) {
      const std::string known = find_template_starting_with(options.templates_dir, path);
      if (!known.empty()) {
        std::optional<IoTemplate> t = load_template(known);  // checks every file's identity
        if (t) {
          std::fprintf(stderr, "pinload agent: pid %d starts %s: replaying it\n", e.pid, known.c_str());
          replays.emplace_back([plan = plan_from_template(*t), threads = options.warm_threads, &replay_stop] {
            WarmOptions w;
            w.threads = threads;
            w.stop = &replay_stop;
            (void)warm(plan, w);
          });
          return;
        }
        std::fprintf(stderr, "pinload agent: %s is stale (a file changed): invalidated, recording pid %d afresh\n",
                     known.c_str(), e.pid);
        std::filesystem::remove(known, ec);
      }
      s.recording = true;
    }
    if (!s.recording) return;
    s.last_read = Clock::now();
    s.recorder.add(file, e.offset, e.length, TemplateReader{static_cast<std::uint32_t>(e.pid), e.comm, e.exe}, e.mapped);
  };

  auto last_scan = Clock::now();
  while (options.stop == nullptr || !options.stop->load()) {
    const int rc = listener->poll(100, on_read);
    if (rc < 0 && rc != -EINTR) {
      std::fprintf(stderr, "pinload agent: fanotify: %s\n", std::strerror(-rc));
      break;
    }
    const auto now = Clock::now();
    for (auto& [pid, s] : sessions) {
      if (!s.recording) continue;
      const bool gone = ::kill(pid, 0) != 0 && errno == ESRCH;
      if (gone || now - s.last_read > std::chrono::milliseconds(options.idle_ms)) finish(pid, s);
    }
    if (now - last_scan > std::chrono::milliseconds(options.rescan_ms)) {
      last_scan = now;
      for (const std::string& r : roots) (void)listener->mark_tree(r, &marked);
    }
  }
  for (auto& [pid, s] : sessions) {
    if (s.recording) finish(pid, s);
  }
  // Close the group before joining: a replay thread's read may wait on an
  // event only this thread would answer; closing allows it.
  listener.reset();
  replay_stop = true;
  for (std::thread& t : replays) t.join();
  return 0;
}

}  // namespace pinload::trace
