// pinload trace: runs an unmodified command and records the reads it and its
// children make of files under the roots, as a template (trace/trace_recorder.h).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/trace_commands.h"
#include "pinload/env.h"
#include "pinload/error.h"
#include "pinload/io_template.h"
#include "trace/pre_content.h"
#include "trace/trace_recorder.h"

namespace pinload::cli {

namespace {

constexpr const char* kTraceUsage = "usage: pinload trace --template OUT [--root DIR]... -- CMD ARGS...\n";

pid_t g_child = 0;
void forward_signal(int sig) {
  if (g_child > 0) ::kill(g_child, sig);
}

int exit_status_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int run_trace_command(int argc, char** argv) {
  std::string out;
  std::vector<std::string> roots;
  std::vector<char*> command;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--template" || a == "--root") && i + 1 < argc) {
      (a == "--template" ? out : roots.emplace_back()) = argv[++i];
    } else if (a == "--") {
      for (++i; i < argc; ++i) command.push_back(argv[i]);
    } else {
      std::fprintf(stderr, "pinload trace: error: unexpected '%s'\n%s", a.c_str(), kTraceUsage);
      return 2;
    }
  }
  if (out.empty() || command.empty()) {
    std::fprintf(stderr, "pinload trace: error: %s\n%s", out.empty() ? "--template is required" : "no command", kTraceUsage);
    return 2;
  }
  if (roots.empty()) roots.push_back(".");
  for (std::string& r : roots) r = trace::canonical_root(r);
  command.push_back(nullptr);

  // Never fail the command because of the tracer: without events it runs untraced.
  std::string why;
  std::unique_ptr<trace::PreContentListener> listener = trace::PreContentListener::open(&why);
  std::vector<std::string> marked;
  for (const std::string& r : roots) {
    if (!listener) break;
    const int rc = listener->mark_tree(r, &marked);
    if (rc < 0) {
      why = "cannot mark " + r + ": " + std::strerror(-rc) +
            (rc == -EOPNOTSUPP ? " (the filesystem lacks pre-content events)" : rc == -EINVAL ? " (the kernel lacks pre-content events, Linux >= 6.14)" : "");
      listener.reset();
    }
  }
  if (!listener) std::fprintf(stderr, "pinload trace: not tracing: %s; running the command untraced\n", why.c_str());

  const pid_t child = ::fork();
  if (child < 0) {
    std::fprintf(stderr, "pinload trace: error: fork: %s\n", std::strerror(errno));
    return 1;
  }
  if (child == 0) {
    listener.reset();  // the child must not hold the group (its exec would keep it open otherwise; CLOEXEC too)
    ::execvp(command[0], command.data());
    std::fprintf(stderr, "pinload trace: cannot run %s: %s\n", command[0], std::strerror(errno));
    ::_exit(127);
  }
  g_child = child;
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  trace::TraceRecorder recorder;
  Env* env = default_env();
  auto on_read = [&](const trace::ReadEvent& e) {
    if (!trace::is_descendant(e.pid, child)) return;
    const std::string path = trace::path_of_fd(e.fd);
    bool inside = false;
    for (const std::string& r : roots) inside = inside || trace::path_is_under(path, r);
    if (!inside) return;  // reached through a hard link or bind mount from outside: not ours
    FileStat st;
    if (env->stat(e.fd, &st) < 0) return;
    recorder.add(TemplateFile{path, "", st.size, st.mtime_ns, st.inode, st.device}, e.offset, e.length, e.pid, e.mapped);
  };
  int status = 0;
  for (;;) {
    if (listener) {
      const int rc = listener->poll(100, on_read);
      if (rc < 0 && rc != -EINTR) {
        std::fprintf(stderr, "pinload trace: stopped tracing: %s\n", std::strerror(-rc));
        listener.reset();
      }
    }
    const pid_t done = ::waitpid(child, &status, listener ? WNOHANG : 0);
    if (done == child) break;
    if (done < 0 && errno != EINTR) break;
  }
  const bool traced = listener != nullptr;
  if (listener) {
    while (listener->poll(0, on_read) > 0) {
    }
  }
  if (traced) {
    // Closed before writing: a write is a pre-content event too, and one
    // into a marked folder would wait on this very thread.
    listener.reset();
    try {
      save_template(recorder.result(), out);
      std::fprintf(stderr, "pinload trace: %s: %zu file(s), %zu range(s), %llu bytes read from %llu event(s) of %zu reader(s)\n",
                   out.c_str(), recorder.result().files.size(), recorder.result().destinations.front().reads.size(),
                   static_cast<unsigned long long>(recorder.bytes()), static_cast<unsigned long long>(recorder.events()),
                   recorder.readers());
    } catch (const Error& e) {
      std::fprintf(stderr, "pinload trace: error: %s\n", e.what());
    }
  }
  return exit_status_of(status);
}

}  // namespace pinload::cli
