// pinload store serve|status|warm|evict: the node store (Note [The node
// store] in pinload/store.h, docs/store.md).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/dtype_arg.h"
#include "pinload/error.h"
#include "pinload/io_template.h"
#include "pinload/memory_limit.h"
#include "pinload/store.h"

namespace pinload::cli {
namespace {

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

// --socket's default: PINLOAD_STORE where it names a socket, else the default one.
std::string socket_default() {
  const StoreOptions from_env = StoreOptions::from_environment({});
  return from_env.active() ? from_env.socket : default_store_socket();
}

void add_socket_option(CLI::App& command, std::string* socket) {
  *socket = socket_default();
  command.add_option("--socket", *socket, "the store's Unix socket (PINLOAD_STORE, else the default)")
      ->type_name("PATH")
      ->capture_default_str();
}

struct ServeArgs {
  StoreServerOptions options;
  std::string budget_text;
  std::string mode = "0660";
  std::string ready_file;
};

void write_ready_file(void* context) {
  const std::string& path = *static_cast<const std::string*>(context);
  if (path.empty()) return;
  std::ofstream(path) << ::getpid() << "\n";
}

void run_serve(ServeArgs& args) {
  std::size_t used = 0;
  unsigned long mode = 0;
  try {
    mode = std::stoul(args.mode, &used, 8);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != args.mode.size() || mode > 0777) throw UsageError("--socket-mode takes an octal mode such as 0660");
  args.options.socket_mode = static_cast<unsigned>(mode);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  args.options.stop = &g_stop;
  args.options.on_ready = write_ready_file;
  args.options.on_ready_context = &args.ready_file;
  std::fprintf(stderr, "pinload store: serving on %s\n", args.options.socket.c_str());
  serve_store(args.options);
  if (!args.ready_file.empty()) ::unlink(args.ready_file.c_str());
}

void print_status(const StoreStatus& s, bool as_json) {
  if (as_json) {
    nlohmann::json entries = nlohmann::json::array();
    for (const auto& e : s.entries) {
      entries.push_back(
          {{"path", e.path}, {"dtype", e.dtype}, {"bytes", e.bytes}, {"holders", e.holders}, {"hits", e.hits}});
    }
    const nlohmann::json j = {{"budget_bytes", s.budget_bytes}, {"bytes", s.bytes},
                              {"huge_page_bytes", s.huge_page_bytes}, {"hits", s.hits},
                              {"misses", s.misses}, {"reads", s.reads},
                              {"bytes_read", s.bytes_read}, {"evictions", s.evictions},
                              {"clients", s.clients}, {"refused", s.refused}, {"busy", s.busy},
                              {"errors", s.errors}, {"numa_node", s.numa_node},
                              {"shmem_huge_pages", s.shmem_huge_pages},
                              {"entries", entries}};
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  // In GB, as `load` prints sizes (--json has the exact bytes).
  std::printf("%.3f GB of %.3f GB budget (%.3f GB in huge pages; shmem_enabled %s), %zu entries\n", s.bytes / 1e9,
              s.budget_bytes / 1e9, s.huge_page_bytes / 1e9, s.shmem_huge_pages.c_str(), s.entries.size());
  std::printf("hits %llu, misses %llu, files read %llu (%.3f GB), evictions %llu\n",
              static_cast<unsigned long long>(s.hits), static_cast<unsigned long long>(s.misses),
              static_cast<unsigned long long>(s.reads), s.bytes_read / 1e9, static_cast<unsigned long long>(s.evictions));
  std::printf("clients %llu, refused %llu, busy %llu, failed requests %llu\n", static_cast<unsigned long long>(s.clients),
              static_cast<unsigned long long>(s.refused), static_cast<unsigned long long>(s.busy),
              static_cast<unsigned long long>(s.errors));
  for (const auto& e : s.entries) {
    std::printf("%9.3f GB  %3llu held  %5llu hits  %s%s\n", e.bytes / 1e9,
                static_cast<unsigned long long>(e.holders), static_cast<unsigned long long>(e.hits),
                printable(e.path).c_str(), e.dtype.empty() ? "" : (" (as " + printable(e.dtype) + ")").c_str());
  }
}

}  // namespace

void add_store_command(CLI::App& app) {
  CLI::App* store = app.add_subcommand("store", "the node store: one shared copy of each model (docs/store.md)");
  store->require_subcommand(1);

  auto serve = std::make_shared<ServeArgs>();
  CLI::App* s = store->add_subcommand("serve", "run the store's daemon until SIGTERM or SIGINT");
  add_socket_option(*s, &serve->options.socket);
  s->add_option("--budget", serve->options.budget_bytes,
                "bytes the entries may take (default: half the memory left at start)")
      ->transform(size_range(4096, std::uint64_t{1} << 50))
      ->type_name("SIZE");
  s->add_option("--numa-node", serve->options.numa_node, "put entries' memory on this node")
      ->transform(integer_range(0, 4095))
      ->type_name("0..4095");
  s->add_option("--threads", serve->options.threads, "reader threads per file read")
      ->transform(integer_range(1, kMaxThreads))
      ->type_name("1..1024")
      ->capture_default_str();
  s->add_option("--socket-mode", serve->mode, "the socket's permissions (octal)")->type_name("MODE")->capture_default_str();
  s->add_option("--allow-uid", serve->options.allowed_uids,
                "also serve this uid (besides the daemon's own and root); repeatable")
      ->type_name("UID");
  s->add_flag("--allow-any-uid", serve->options.allow_any_uid, "serve every peer the socket's permissions let in");
  s->add_option("--remote-allow", serve->options.remote_allow,
                "fetch objects under this URL prefix for every client; repeatable")
      ->type_name("PREFIX");
  s->add_option("--max-connections", serve->options.max_connections, "connections served at once")
      ->transform(integer_range(1, 1 << 20))
      ->type_name("1..1048576")
      ->capture_default_str();
  s->add_option("--max-connections-per-uid", serve->options.max_connections_per_uid,
                "connections of one uid served at once")
      ->transform(integer_range(1, 1 << 20))
      ->type_name("1..1048576")
      ->capture_default_str();
  s->add_option("--ready-file", serve->ready_file, "write the daemon's pid here once it listens")->type_name("PATH");
  s->callback([serve] { run_serve(*serve); });

  struct StatusArgs {
    std::string socket;
    bool json = false;
  };
  auto status = std::make_shared<StatusArgs>();
  CLI::App* st = store->add_subcommand("status", "entries, bytes, hits and misses, clients");
  add_socket_option(*st, &status->socket);
  st->add_flag("--json", status->json, "print the status as JSON");
  st->callback([status] { print_status(store_status(status->socket), status->json); });

  struct WarmArgs {
    std::string socket;
    std::string template_file;
    std::vector<std::string> paths;
    std::string dtype;
    DTypeOptions conversion;
  };
  auto warm = std::make_shared<WarmArgs>();
  CLI::App* w = store->add_subcommand("warm", "read files into the store ahead of their loads");
  add_socket_option(*w, &warm->socket);
  w->add_option("--template", warm->template_file, "the files an I/O template names (pinload trace)")
      ->type_name("TEMPLATE");
  w->add_option("--dtype", warm->dtype, "the entries a load with this --dtype maps (converted in the store)")
      ->check(dtype_validator())
      ->type_name("bf16|fp16|fp32");
  w->add_option("--keep", warm->conversion.keep, "a tensor pattern --dtype leaves as stored (as load --keep)")
      ->type_name("PATTERN")
      ->take_all()
      ->expected(1)
      ->allow_extra_args(false);  // the PATHs after it are not patterns
  w->add_option("PATH", warm->paths, "checkpoints: files, indexes, folders")->type_name("");
  w->callback([warm] {
    if (!warm->dtype.empty()) warm->conversion.to = parse_conversion_dtype(warm->dtype);  // checked by CLI11
    if (!warm->conversion.keep.empty() && !warm->conversion.to) throw UsageError("--keep needs --dtype");
    std::vector<std::string> paths = warm->paths;
    if (!warm->template_file.empty()) {
      const std::optional<IoTemplate> t = load_template(warm->template_file);
      if (!t) throw InvalidFileError("no valid template (missing, corrupt or stale)", ErrorContext{warm->template_file});
      for (const TemplateFile& f : t->files) paths.push_back(f.path);
    }
    if (paths.empty()) throw UsageError("give PATHs or --template");
    const std::uint64_t bytes = store_warm(warm->socket, paths, nullptr, warm->conversion);
    std::fprintf(stderr, "pinload store: %.3f GB of %zu path(s) in the store\n", bytes / 1e9, paths.size());
  });

  struct EvictArgs {
    std::string socket;
    std::vector<std::string> paths;
  };
  auto evict = std::make_shared<EvictArgs>();
  CLI::App* e = store->add_subcommand("evict", "drop entries no client holds: those of PATHs, or all");
  add_socket_option(*e, &evict->socket);
  e->add_option("PATH", evict->paths, "checkpoints whose entries to drop")->type_name("");
  e->callback([evict] {
    const std::uint64_t n = store_evict(evict->socket, evict->paths);
    std::fprintf(stderr, "pinload store: %llu entr%s dropped\n", static_cast<unsigned long long>(n), n == 1 ? "y" : "ies");
  });
}

}  // namespace pinload::cli
