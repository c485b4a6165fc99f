#include "trace/warmer.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "base/log.h"
#include "pinload/env.h"
#include "pinload/error.h"
#include "source/sources.h"
#include "trace/pre_content.h"

namespace pinload::trace {

namespace {

using Clock = std::chrono::steady_clock;

bool read_u64_file(const std::string& path, std::uint64_t* out) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text)) return false;
  if (text == "max") return false;
  try {
    *out = std::stoull(text);
  } catch (...) {
    return false;
  }
  return true;
}

std::uint64_t meminfo_kb(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  std::string k;
  std::uint64_t v = 0;
  std::string unit;
  while (in >> k >> v) {
    std::getline(in, unit);
    if (k == key + ":") return v;
  }
  return 0;
}

// Which processes count as the consumer: cached per pid.
class ConsumerFilter {
 public:
  ConsumerFilter(pid_t pid, std::string cgroup) : pid_(pid), cgroup_(std::move(cgroup)) {}
  bool matches(pid_t p) {
    if (p == ::getpid()) return false;
    auto it = known_.find(p);
    if (it != known_.end()) return it->second;
    bool yes = true;
    if (pid_ > 0) yes = is_descendant(p, pid_);
    else if (!cgroup_.empty()) yes = in_cgroup(p);
    known_[p] = yes;
    return yes;
  }
  // Whether the consumer is still there.
  bool alive() const {
    if (pid_ > 0) return ::kill(pid_, 0) == 0 || errno == EPERM;
    if (!cgroup_.empty()) {
      std::ifstream in(cgroup_ + "/cgroup.procs");
      pid_t p;
      while (in >> p) {
        if (p != ::getpid()) return true;
      }
      return false;
    }
    return true;
  }

 private:
  bool in_cgroup(pid_t p) const {
    std::ifstream in(cgroup_ + "/cgroup.procs");
    pid_t q;
    while (in >> q) {
      if (q == p) return true;
    }
    return false;
  }
  pid_t pid_;
  std::string cgroup_;
  std::map<pid_t, bool> known_;
};

}  // namespace

std::string memory_cgroup_of(pid_t pid) {
  std::ifstream in("/proc/" + (pid > 0 ? std::to_string(pid) : std::string("self")) + "/cgroup");
  std::string line, v2;
  while (std::getline(in, line)) {
    // hierarchy-id:controllers:path
    const std::size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    std::stringstream list(controllers);
    std::string c;
    while (std::getline(list, c, ',')) {
      if (c == "memory" && std::filesystem::exists("/sys/fs/cgroup/memory" + path)) return "/sys/fs/cgroup/memory" + path;
    }
    if (line.rfind("0::", 0) == 0) v2 = "/sys/fs/cgroup" + path;
  }
  if (!v2.empty() && std::filesystem::exists(v2 + "/memory.max")) return v2;
  return "";
}

bool cgroup_memory(const std::string& folder, std::uint64_t* usage, std::uint64_t* limit) {
  if (folder.empty()) return false;
  if (read_u64_file(folder + "/memory.max", limit)) return read_u64_file(folder + "/memory.current", usage);
  if (read_u64_file(folder + "/memory.limit_in_bytes", limit) && *limit < (1ull << 60)) {
    return read_u64_file(folder + "/memory.usage_in_bytes", usage);
  }
  return false;
}

WarmReport warm(const WarmPlan& plan, const WarmOptions& options) {
  const auto start = Clock::now();
  WarmReport report;
  report.planned = plan.bytes;
  Env* env = default_env();

  // Files first, before any mark of ours: our own reads then never report
  // to our group (Note [Pre-content events]).
  // Each file's bytes through its source (Note [Byte sources]), buffered:
  // warming fills the page cache. Null: not warmed.
  std::vector<std::unique_ptr<detail::LocalFileSource>> sources(plan.files.size());
  std::vector<int> fds(plan.files.size(), -1);  // the sources' descriptors, for fadvise
  std::map<std::pair<std::uint64_t, std::uint64_t>, std::uint32_t> by_identity;  // (device, inode) -> file
  for (std::uint32_t i = 0; i < plan.files.size(); ++i) {
    const TemplateFile& f = plan.files[i];
    std::unique_ptr<detail::LocalFileSource> source;
    try {
      source = detail::open_local_file(env, f.path);
    } catch (const Error& e) {
      log::warn("{}: not warmed: {}", f.path, e.message());
      continue;
    }
    const FileStat& st = source->stat();
    if (st.size != f.size || st.inode != f.inode || st.device != f.device ||
        (f.mtime_ns != 0 && st.mtime_ns != f.mtime_ns)) {
      log::warn("{}: not warmed: the file changed since the template was recorded", f.path);
      continue;
    }
    fds[i] = source->buffered_descriptor();
    env->fadvise(fds[i], 0, 0, POSIX_FADV_RANDOM);  // exactly the piece, no readahead past it
    sources[i] = std::move(source);
    by_identity[{st.device, st.inode}] = i;
  }

  const bool want_follow = options.follow_pid > 0 || !options.follow_cgroup.empty();
  std::unique_ptr<PreContentListener> listener;
  if (want_follow) {
    std::string why;
    listener = PreContentListener::open(&why);
    if (listener) {
      std::set<std::string> dirs;
      for (const TemplateFile& f : plan.files) dirs.insert(std::filesystem::path(f.path).parent_path().string());
      for (const std::string& d : dirs) {
        if (const int rc = listener->mark_directory(d); rc < 0) {
          why = "fanotify_mark(FAN_PRE_ACCESS) on " + d + ": " + std::strerror(-rc);
          listener.reset();
          break;
        }
      }
    }
    report.mode = listener ? "follow: fanotify pre-content events, burn after reading"
                           : "no fanotify (" + why + "): template order, no following";
  } else {
    report.mode = "template order, no consumer to follow";
  }
  std::uint64_t budget = options.budget;
  std::uint64_t blind_limit = ~0ull;  // without following, a budget bounds what we warm at all
  if (budget > 0 && !listener) {
    blind_limit = budget;
    budget = 0;
  }

  std::mutex mu;
  std::condition_variable cv;
  BurnTracker tracker(plan);
  std::size_t next = 0;
  std::uint64_t taken = 0;
  unsigned running = 0;
  bool warming_done = false;
  std::string interrupted;
  const std::string pressure_cgroup = !options.follow_cgroup.empty() ? options.follow_cgroup : memory_cgroup_of(0);
  auto stopping = [&] { return options.stop != nullptr && options.stop->load(std::memory_order_relaxed); };
  auto under_pressure = [&] {
    std::uint64_t usage = 0, limit = 0;
    if (cgroup_memory(pressure_cgroup, &usage, &limit)) {
      if (static_cast<double>(usage) > options.pressure_fraction * static_cast<double>(limit)) return true;
    }
    const std::uint64_t total = meminfo_kb("MemTotal"), avail = meminfo_kb("MemAvailable");
    return total > 0 && static_cast<double>(avail) < (1.0 - options.pressure_fraction) * static_cast<double>(total);
  };

  auto worker = [&] {
    std::vector<char> buffer(kDefaultPieceBytes);
    std::unique_lock<std::mutex> lock(mu);
    Clock::time_point pressure_since{};
    for (;;) {
      if (!interrupted.empty()) break;
      if (stopping()) {
        interrupted = "SIGTERM";
        break;
      }
      while (next < plan.pieces.size() && (tracker.touched(next) || fds[plan.pieces[next].file] < 0)) {
        report.skipped += plan.pieces[next].length;
        ++next;
      }
      if (next >= plan.pieces.size() || taken >= blind_limit) break;
      if (budget > 0 && tracker.resident_bytes() > 0 &&
          tracker.resident_bytes() + plan.pieces[next].length > budget) {
        cv.wait_for(lock, std::chrono::milliseconds(20));
        continue;
      }
      lock.unlock();
      const bool pressure = under_pressure();
      lock.lock();
      if (next >= plan.pieces.size() || tracker.touched(next)) continue;  // moved on meanwhile: choose again
      const WarmPiece& piece = plan.pieces[next];
      if (pressure) {
        if (pressure_since == Clock::time_point{}) pressure_since = Clock::now();
        if (Clock::now() - pressure_since > std::chrono::milliseconds(options.pressure_give_up_ms)) {
          if (interrupted.empty()) interrupted = "memory pressure";
          break;
        }
        cv.wait_for(lock, std::chrono::milliseconds(20));
        continue;
      }
      pressure_since = {};
      const std::size_t i = next++;
      const std::uint64_t length = std::min(piece.length, blind_limit - taken);
      taken += length;
      tracker.on_warmed(i);  // counted now, so other threads see it in the budget
      lock.unlock();
      detail::LocalFileSource& source = *sources[piece.file];
      std::uint64_t done = 0;
      while (done < length && !stopping()) {
        const std::uint64_t n = std::min<std::uint64_t>(buffer.size(), length - done);
        try {
          source.read(piece.offset + done, n, reinterpret_cast<std::byte*>(buffer.data()), n);
        } catch (const Error& e) {
          log::debug("{}: warming stopped: {}", source.path(), e.what());
          break;
        }
        done += n;
      }
      lock.lock();
      report.warmed += done;
    }
    if (--running == 0) warming_done = true;
    cv.notify_all();
  };

  ConsumerFilter consumer(options.follow_pid, options.follow_cgroup);
  std::thread follower;
  std::atomic<bool> follow_done{false};
  if (listener) {
    follower = std::thread([&] {
      auto last_alive_check = Clock::now();
      while (!follow_done.load()) {
        const int rc = listener->poll(50, [&](const ReadEvent& e) {
          if (e.mapped || !consumer.matches(e.pid)) return;
          FileStat st;
          if (env->stat(e.fd, &st) != 0) return;
          auto it = by_identity.find({st.device, st.inode});
          if (it == by_identity.end()) return;
          std::vector<std::size_t> drop;
          {
            std::lock_guard<std::mutex> guard(mu);
            ++report.consumer_events;
            drop = tracker.on_consumer_read(it->second, e.offset, e.length);
          }
          for (std::size_t i : drop) {
            const WarmPiece& p = plan.pieces[i];
            env->fadvise(fds[p.file], p.offset, p.length, POSIX_FADV_DONTNEED);
          }
          cv.notify_all();
        });
        if (rc < 0 && rc != -EINTR) break;
        if (Clock::now() - last_alive_check > std::chrono::milliseconds(200)) {
          last_alive_check = Clock::now();
          if (!consumer.alive() || stopping()) break;
        }
      }
      std::lock_guard<std::mutex> guard(mu);
      // The consumer is gone: nothing more to wait for.
      if (budget > 0 && interrupted.empty() && next < plan.pieces.size()) interrupted = "the consumer exited";
      budget = 0;
      cv.notify_all();
    });
  }

  {
    std::vector<std::thread> workers;
    const unsigned n = std::max(1u, options.threads);
    running = n;
    for (unsigned i = 0; i < n; ++i) workers.emplace_back(worker);
    for (std::thread& t : workers) t.join();
  }
  if (follower.joinable()) {
    // Burn after reading goes on until the consumer is done or gone.
    while (listener && !stopping()) {
      {
        std::lock_guard<std::mutex> guard(mu);
        if (budget == 0) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    follow_done = true;
    follower.join();
  }
  (void)warming_done;
  sources.clear();
  report.dropped = tracker.dropped_bytes();
  report.interrupted = interrupted;
  report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return report;
}

}  // namespace pinload::trace
