// pinload trace: runs an unmodified command and records the reads it and its
// children make of files under the roots, as a template (trace/trace_recorder.h).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "pinload/env.h"
#include "pinload/error.h"
#include "pinload/io_template.h"
#include "trace/pre_content.h"
#include "trace/trace_recorder.h"

namespace pinload::cli {

namespace {

struct TraceArgs {
  std::string out;
  std::vector<std::string> roots;
  std::vector<std::string> command;
};

pid_t g_child = 0;
void forward_signal(int sig) {
  if (g_child > 0) ::kill(g_child, sig);
}

int exit_status_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// The traced command's exit status.
int run_trace(TraceArgs& args) {
  const std::string& out = args.out;
  std::vector<std::string>& roots = args.roots;
  std::vector<char*> command;
  for (std::string& a : args.command) command.push_back(a.data());
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
    recorder.add(TemplateFile{path, "", st.size, st.mtime_ns, st.inode, st.device}, e.offset, e.length,
                 TemplateReader{static_cast<std::uint32_t>(e.pid), e.comm, e.exe}, e.mapped);
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
      const IoTemplate t = recorder.result();
      save_template(t, out);
      std::fprintf(stderr, "pinload trace: %s: %zu file(s), %zu range(s), %llu bytes read from %llu event(s) of %zu reader(s)\n",
                   out.c_str(), t.files.size(), t.destinations.front().reads.size(),
                   static_cast<unsigned long long>(recorder.bytes()), static_cast<unsigned long long>(recorder.events()),
                   t.readers.size());
      // Who read what (pinload inspect OUT prints every range with its reader).
      std::vector<std::uint64_t> bytes_by(t.readers.size(), 0);
      for (const TemplateReads& d : t.destinations) {
        for (const TemplateRead& r : d.reads) bytes_by[r.reader] += r.length;
      }
      for (std::size_t i = 0; i < t.readers.size(); ++i) {
        std::fprintf(stderr, "pinload trace:   reader pid %u %s (%s): %llu bytes\n", t.readers[i].pid,
                     printable(t.readers[i].comm).c_str(), printable(t.readers[i].exe).c_str(),
                     static_cast<unsigned long long>(bytes_by[i]));
      }
    } catch (const Error& e) {
      std::fprintf(stderr, "pinload trace: error: %s\n", e.what());
    }
  }
  return exit_status_of(status);
}

}  // namespace

std::vector<std::string>& command_after_separator() {
  static std::vector<std::string> command;
  return command;
}

void add_trace_command(CLI::App& app) {
  auto args = std::make_shared<TraceArgs>();
  CLI::App* command = app.add_subcommand(
      "trace", "Run a command, record its reads as a template (docs/trace.md)");
  command->add_option("--template", args->out, "the template to write")->type_name("TEMPLATE")->required();
  command->add_option("--root", args->roots, "a folder whose files are traced (repeatable; default: .)")->type_name("DIR");
  // Everything from the first positional on is the command, untouched; main() keeps what follows
  // the first "--" aside (command_after_separator), since CLI11 would parse it as positionals.
  command->prefix_command(true);
  command->footer("Usage: pinload trace --template OUT [--root DIR]... -- CMD ARGS...\n"
                  "Example: pinload trace --template llm.pltemplate --root /models -- python serve.py");
  command->callback([args, command] {
    args->command = command->remaining();
    if (!args->command.empty() && args->command.front() == "--") args->command.erase(args->command.begin());
    // A "--" after the command's first word is the command's own argument.
    const std::vector<std::string>& after = command_after_separator();  // "--" and what follows it
    args->command.insert(args->command.end(), after.begin() + (args->command.empty() && !after.empty() ? 1 : 0),
                         after.end());
    if (args->command.empty()) throw UsageError("no command to trace (after --)");
    const int status = run_trace(*args);
    if (status != 0) throw CLI::RuntimeError(status);
  });
}

}  // namespace pinload::cli
