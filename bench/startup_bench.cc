// startup-bench: a simulated service start-up, framework initialisation of T
// seconds followed by a load, timed three ways (docs/architecture.md,
// "Templates, prefetch and the memory budget"):
//   sequential   init, then load                         (T + load)
//   prefetch     prefetch(paths), init, load adopting it  (target max(T, load) + eps)
//   template     load_template + prefetch(template), init, load adopting it
// plus the cold load alone (T = 0): plain, through a prefetch of the paths
// (load_prefetched), and through a prefetch of the template. Every run
// starts with the page cache dropped (unless --no-cold; needs root) and a fresh
// pool, as a new process would. Each scenario runs --repeat times, interleaved
// and rotated; best and median are printed.
//
//   startup-bench [--init 1.0] [--busy] [--repeat 3] [--threads 8] [--no-cold]
//                 [--template-dir DIR] PATH...
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "cli/command.h"
#include "pinload/error.h"
#include "pinload/io_template.h"
#include "pinload/loader.h"
#include "pinload/prefetch.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  double init_seconds = 1.0;
  bool busy = false;
  int repeat = 3;
  unsigned threads = pinload::kDefaultThreads;
  bool cold = true;
  std::string template_dir;
  std::vector<std::string> paths;
};

// Parsed by CLI11, as the pinload command (src/cli/command.h); exits with
// CLI11's message and code on a command-line mistake, or after --help.
Args parse(int argc, char** argv) {
  Args a;
  CLI::App app("A simulated start-up (init of T seconds, then a load) with and without prefetch and I/O templates",
               "startup-bench");
  app.option_defaults()->always_capture_default();
  app.add_option("--init", a.init_seconds, "seconds the framework's initialisation takes")->check(CLI::Range(0.0, 3600.0));
  app.add_flag("--busy", a.busy, "the initialisation spins one core (else it sleeps)");
  app.add_option("--repeat", a.repeat, "runs per case")->transform(pinload::cli::integer_range(1, 1000));
  app.add_option("--threads", a.threads, "reader threads")
      ->transform(pinload::cli::integer_range(1, pinload::kMaxThreads));
  bool no_cold = false;
  app.add_flag("--no-cold", no_cold, "keep the page cache (no root needed)");
  app.add_option("--template-dir", a.template_dir, "where I/O templates are recorded and replayed");
  pinload::cli::add_paths(app, &a.paths);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  a.cold = !no_cold;
  return a;
}

void drop_page_cache() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  f << "1\n";
  f.flush();
  if (!f) {
    std::fprintf(stderr, "startup-bench: cannot drop the page cache (root needed); use --no-cold\n");
    std::exit(1);
  }
}

// The framework's initialisation: sleeping (waiting on something else) or
// spinning one core (importing, building modules).
void simulated_init(double seconds, bool busy) {
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  if (!busy) {
    std::this_thread::sleep_until(end);
    return;
  }
  volatile std::uint64_t x = 0;
  while (Clock::now() < end) {
    for (int i = 0; i < 10000; ++i) x = x + static_cast<std::uint64_t>(i);
  }
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

pinload::Loader fresh_loader(const Args& a) {
  pinload::LoadOptions options;
  options.threads = a.threads;
  return pinload::Loader(options, pinload::Pool::create_default());
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const std::string template_file = pinload::template_path(a.paths, a.template_dir);
  try {
    // Record the template of a first start (warm or not, the reads are the same).
    {
      pinload::IoTemplate recorded;
      pinload::LoadRequest request;
      request.record = &recorded;
      const pinload::StateDict sd = fresh_loader(a).load(a.paths, request);
      pinload::save_template(recorded, template_file);
      std::printf("model: %.3f GB in %zu tensors, %zu files; template %s (%zu reads)\n", sd.total_bytes() / 1e9,
                  sd.size(), recorded.files.size(), template_file.c_str(),
                  recorded.find(pinload::kHostDestination)->reads.size());
    }
    std::printf("init T = %.2f s (%s), %s, %d repeats, %u threads\n", a.init_seconds, a.busy ? "busy" : "sleep",
                a.cold ? "page cache dropped before each run" : "warm page cache", a.repeat, a.threads);

    const std::vector<std::string> scenarios = {"load_cold", "load_prefetched", "load_template",
                                                "sequential", "prefetch", "template"};
    std::map<std::string, std::vector<double>> times;
    for (int r = 0; r < a.repeat; ++r) {
      // Rotated each round, so that no scenario always runs first.
      std::vector<std::string> order = scenarios;
      std::rotate(order.begin(), order.begin() + r % order.size(), order.end());
      for (const std::string& name : order) {
        if (a.cold) drop_page_cache();
        const bool init = name == "sequential" || name == "prefetch" || name == "template";
        const bool with_template = name == "load_template" || name == "template";
        const auto t0 = Clock::now();
        pinload::Loader loader = fresh_loader(a);
        pinload::StateDict sd;
        if (name == "load_cold" || name == "sequential") {
          if (init) simulated_init(a.init_seconds, a.busy);
          sd = loader.load(a.paths);
        } else {
          pinload::Prefetch p;
          if (with_template) {
            std::optional<pinload::IoTemplate> t = pinload::load_template(template_file);
            if (!t) throw pinload::IoError("the template was not accepted", pinload::ErrorContext{template_file});
            p = pinload::prefetch(loader, *t);
            if (!init) p.wait();  // the load alone: every read in the template's order
          } else {
            p = pinload::prefetch(loader, a.paths);
            if (!init) p.wait();
          }
          if (init) simulated_init(a.init_seconds, a.busy);
          sd = loader.load(p);
        }
        times[name].push_back(seconds_since(t0));
        if (sd.empty()) throw pinload::InvalidFileError("nothing loaded");
      }
    }
    std::printf("%-14s %9s %9s   %s\n", "scenario", "best_s", "median_s", "runs");
    std::map<std::string, double> best, median;
    for (const std::string& name : scenarios) {
      std::vector<double> v = times[name];
      std::sort(v.begin(), v.end());
      best[name] = v.front();
      median[name] = v[v.size() / 2];
      std::string runs;
      for (double t : times[name]) runs += std::to_string(t).substr(0, 5) + " ";
      std::printf("%-14s %9.3f %9.3f   %s\n", name.c_str(), best[name], median[name], runs.c_str());
    }
    const double T = a.init_seconds;
    for (const char* which : {"best", "median"}) {
      auto& m = std::string(which) == "best" ? best : median;
      const double load = m["load_cold"];
      std::printf("%s: T + load = %.3f s, max(T, load) = %.3f s; sequential %.3f, prefetch %.3f (eps %+.3f), "
                  "template %.3f (eps %+.3f); template vs sequential cold start: %.1f%% less; cold load alone "
                  "with template vs without: %.1f%% less\n",
                  which, T + load, std::max(T, load), m["sequential"], m["prefetch"],
                  m["prefetch"] - std::max(T, load), m["template"], m["template"] - std::max(T, load),
                  100.0 * (1.0 - m["template"] / m["sequential"]), 100.0 * (1.0 - m["load_template"] / load));
    }
  } catch (const pinload::Error& e) {
    std::fprintf(stderr, "startup-bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
