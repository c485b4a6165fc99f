// pinload-bench: pinload's load bandwidth next to the machine's physical limits,
// measured in the same run on the same files.
//
//   pinload-bench [options] PATH...      (files, *.safetensors.index.json, folders)
//
// Phases (--phases, default all but sweep):
//   memcpy    memcpy bandwidth, one thread and all cores: the ceiling of a warm load
//   fio       fio direct reads of the same files (bs 2M, iodepth 32 and 1; bs 8M, iodepth 8; libaio):
//             the ceiling of a cold load
//   buffered  a plain single-thread read() of the files, cold then warm
//   cold      pinload loads after dropping the page cache: a first load into a fresh
//             pool, then --repeat re-loads after an unload, each in a round with fio
//   warm      pinload loads with the files in the page cache, --repeat times
//   cached-read  in each warm round, also a load with --cached-read map and one
//             with pread (Note [Mapped reads] in loader.h), in an order rotated by round
//   pool      a fresh pool reserving the checkpoint's blocks, timed alone: what a
//             first load pays before its first read. It runs after a cache drop and
//             --pool-settle idle seconds: in a VM with free page reporting
//             (virtio-balloon), memory that has been free a while goes back to the
//             host, and faulting it in again is several times slower than memory
//             freed a moment ago.
//   sweep     cold (and warm) loads over threads {1,2,4,8,16} x block {256K,1M,2M,8M}
//             (--sweep adds it)
//   device    with --device (cuda:N, or sim, the CPU stand-in; --device adds it):
//             the physical limit, one large copy from pinned memory to the device
//             (pinned cudaMemcpy on a GPU), best of 3; the copy engine alone
//             (upload() of the checkpoint already in pinned memory); warm and cold
//             loads to the device (cached mode) next to host-only loads of the same
//             round; a cold streaming load within --staging-bytes
//   switch    switching back to a model held in a ModelCache (model_cache.h): the
//             host-side cost of a hit (re-stat the files, copy the state dict) against
//             the cold load that filled the cache, and the preads and OS reservations
//             the hits made (both should be 0); with --device, a hit to the device
//             (get_on) against a bare upload() of the same bytes. Only when named in
//             --phases.
//
// fio's buffers are malloc'ed 4 KiB pages: a 2 MiB direct read then needs 512
// scatter-gather segments, more than many virtual disks take in one request
// (virtio-blk here: max_segments 254), so the kernel splits it. pinload's pool
// is THP-backed, so its reads go out whole. With --hugetlb, fio also runs with
// huge-page buffers (--iomem=shmhuge), which removes that difference.
//
// The cold target: Note [Comparing with fio] in fio_compare.h.
//
// Cold means: sync + `echo 1 > /proc/sys/vm/drop_caches` where that is writable
// (root), otherwise posix_fadvise(POSIX_FADV_DONTNEED) on every file; the report
// says which, and the page-cache residency measured just before each cold load.
//
// GB/s are 1e9 bytes per second of tensor data (pinload) or file bytes (fio, read).
#include <fcntl.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pinload/checkpoint.h"
#include "pinload/copy_engine.h"
#include "pinload/device.h"
#include "pinload/error.h"
#include "pinload/host_memory.h"
#include "pinload/loader.h"
#include "pinload/model_cache.h"
#include "pinload/pool.h"
#include "cli/load_option_args.h"
#include "cli/size_arg.h"
#include "fio_compare.h"

namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage =
    "usage: pinload-bench [options] PATH...\n"
    "  --threads N            reader threads (default 8)\n"
    "  --block-size B         bytes per read, K/M suffix (default 8M)\n"
    "  --direct auto|on|off   O_DIRECT policy (default auto)\n"
    "  --cached-read auto|map|pread   files in the page cache: the faster of the two measured,\n"
    "                         copied from a mapping, or pread (default auto)\n"
    "  --repeat N             runs per measurement (default 3)\n"
    "  --huge-pages off|thp|explicit   pool memory (default thp)\n"
    "  --lock on|off          mlock the pool's memory (default off, as the library's host pools)\n"
    "  --phases LIST          comma list of memcpy,fio,buffered,cold,warm,cached-read,pool,sweep,\n"
    "                         device,switch\n"
    "                         (default all but sweep and switch; device only with --device)\n"
    "  --device SPEC          also load to cuda:N or sim (the CPU stand-in): adds the device phase\n"
    "  --streams N            copy streams (default 2)\n"
    "  --chunk-size B         bytes per copy (default 8M)\n"
    "  --staging-bytes B      host budget of the streaming load (default 256M)\n"
    "  --sweep                add the threads x block-size sweep\n"
    "  --sweep-threads LIST   default 1,2,4,8,16\n"
    "  --sweep-blocks LIST    default 256K,1M,2M,8M\n"
    "  --sweep-repeat N       runs per sweep point (default 1)\n"
    "  --sweep-warm on|off    also sweep warm loads (default on)\n"
    "  --fio-runtime S        cap each fio run at S seconds (default: whole files)\n"
    "  --hugetlb off|auto|N   as root, set vm.nr_hugepages for the run and restore it at exit:\n"
    "                         fio then also runs with huge-page buffers (--iomem=shmhuge), and\n"
    "                         --huge-pages explicit gets its pages (auto: what those need)\n"
    "  --memcpy-bytes B       memcpy buffer size (default 512M)\n"
    "  --pool-settle S        idle seconds after the cache drop before the pool phase (default 10)\n"
    "  --variant V            checkpoint variant (fp16, ...)\n"
    "  --label TEXT           free text stored in the JSON\n"
    "  --json OUT             write the results as JSON\n";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::uint64_t parse_size(const std::string& text) {
  const std::optional<std::uint64_t> size = pinload::cli::parse_size_arg(text);
  if (!size) throw UsageError("not a size: '" + text + "' (bytes, or a number with K, M or G)");
  return *size;
}

std::vector<std::string> split(const std::string& text, char sep = ',') {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, sep);) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string size_name(std::uint64_t bytes) {
  if (bytes % (1u << 20) == 0) return std::to_string(bytes >> 20) + "M";
  if (bytes % (1u << 10) == 0) return std::to_string(bytes >> 10) + "K";
  return std::to_string(bytes);
}

struct Args {
  std::vector<std::string> paths;
  pinload::LoadOptions load;
  int repeat = 3;
  pinload::HugePages huge_pages = pinload::HugePages::kTransparent;
  std::vector<std::string> phases = {"memcpy", "fio", "buffered", "cold", "warm", "cached-read", "pool"};
  std::vector<unsigned> sweep_threads = {1, 2, 4, 8, 16};
  std::vector<std::size_t> sweep_blocks = {256u << 10, 1u << 20, 2u << 20, 8u << 20};
  int sweep_repeat = 1;
  bool sweep_warm = true;
  int fio_runtime = 0;
  std::string hugetlb = "off";
  int pool_settle = 10;
  bool lock = pinload::kHostPoolMemory.lock;  // LockedMemoryOptions::lock
  std::size_t memcpy_bytes = 512u << 20;
  std::string label;
  std::string json_out;
  std::string device;  // --device: empty for none
  pinload::CopyOptions copy;
  std::uint64_t staging_bytes = pinload::kDefaultStagingBytes;

  bool has(const std::string& phase) const {
    return std::find(phases.begin(), phases.end(), phase) != phases.end();
  }
};

const char* huge_pages_name(pinload::HugePages h) {
  switch (h) {
    case pinload::HugePages::kOff: return "off";
    case pinload::HugePages::kTransparent: return "thp";
    case pinload::HugePages::kExplicit: return "explicit";
  }
  return "?";
}

using pinload::cli::cached_read_arg_name;
using pinload::cli::direct_arg_name;

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(s + " needs a value");
      return argv[++i];
    };
    if (s == "-h" || s == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (s == "--threads") {
      a.load.threads = static_cast<unsigned>(parse_size(value()));
    } else if (s == "--block-size") {
      a.load.block_size = parse_size(value());
    } else if (s == "--direct") {
      const auto d = pinload::cli::parse_direct_arg(value());
      if (!d) throw UsageError("--direct takes auto, on or off");
      a.load.direct = *d;
    } else if (s == "--cached-read") {
      const auto c = pinload::cli::parse_cached_read_arg(value());
      if (!c) throw UsageError("--cached-read takes auto, map or pread");
      a.load.cached_read = *c;
    } else if (s == "--repeat") {
      a.repeat = std::max(1, std::stoi(value()));
    } else if (s == "--huge-pages") {
      const std::string v = value();
      if (v == "off") a.huge_pages = pinload::HugePages::kOff;
      else if (v == "thp") a.huge_pages = pinload::HugePages::kTransparent;
      else if (v == "explicit") a.huge_pages = pinload::HugePages::kExplicit;
      else throw UsageError("--huge-pages takes off, thp or explicit");
    } else if (s == "--phases") {
      a.phases = split(value());
      for (const auto& p : a.phases) {
        if (p != "memcpy" && p != "fio" && p != "buffered" && p != "cold" && p != "warm" && p != "pool" &&
            p != "sweep" && p != "device" && p != "switch" && p != "cached-read") {
          throw UsageError("unknown phase '" + p + "'");
        }
      }
    } else if (s == "--sweep") {
      if (!a.has("sweep")) a.phases.push_back("sweep");
    } else if (s == "--sweep-threads") {
      a.sweep_threads.clear();
      for (const auto& t : split(value())) a.sweep_threads.push_back(static_cast<unsigned>(parse_size(t)));
    } else if (s == "--sweep-blocks") {
      a.sweep_blocks.clear();
      for (const auto& b : split(value())) a.sweep_blocks.push_back(parse_size(b));
    } else if (s == "--sweep-repeat") {
      a.sweep_repeat = std::max(1, std::stoi(value()));
    } else if (s == "--sweep-warm") {
      a.sweep_warm = value() != "off";
    } else if (s == "--hugetlb") {
      a.hugetlb = value();
      if (a.hugetlb != "off" && a.hugetlb != "auto") parse_size(a.hugetlb);
    } else if (s == "--lock") {
      const std::string v = value();
      if (v != "on" && v != "off") throw UsageError("--lock takes on or off");
      a.lock = v == "on";
    } else if (s == "--pool-settle") {
      a.pool_settle = std::max(0, std::stoi(value()));
    } else if (s == "--fio-runtime") {
      a.fio_runtime = std::stoi(value());
    } else if (s == "--memcpy-bytes") {
      a.memcpy_bytes = parse_size(value());
    } else if (s == "--variant") {
      a.load.resolve.variant = value();
    } else if (s == "--device") {
      a.device = value();
      if (!a.has("device")) a.phases.push_back("device");
    } else if (s == "--streams") {
      a.copy.streams = std::max<std::size_t>(1, parse_size(value()));
    } else if (s == "--chunk-size") {
      a.copy.chunk_bytes = std::max<std::size_t>(4096, parse_size(value()));
    } else if (s == "--staging-bytes") {
      a.staging_bytes = parse_size(value());
    } else if (s == "--label") {
      a.label = value();
    } else if (s == "--json") {
      a.json_out = value();
    } else if (s == "--") {
      for (++i; i < argc; ++i) a.paths.emplace_back(argv[i]);
    } else if (s.size() > 1 && s[0] == '-') {
      throw UsageError("unknown option " + s);
    } else {
      a.paths.push_back(s);
    }
  }
  if (a.paths.empty()) throw UsageError("no path given");
  if (a.has("device") && a.device.empty()) throw UsageError("the device phase needs --device");
  return a;
}

// ---- small system helpers ----

std::string run_command(const std::string& cmd, int* status = nullptr) {
  std::string out;
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) {
    if (status) *status = -1;
    return out;
  }
  char buf[65536];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int rc = ::pclose(p);
  if (status) *status = rc;
  return out;
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// A field of /proc/meminfo in bytes, or -1.
std::int64_t meminfo(const std::string& key) {
  std::ifstream f("/proc/meminfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind(key + ":", 0) == 0) {
      std::istringstream ss(line.substr(key.size() + 1));
      std::int64_t v = 0;
      std::string unit;
      ss >> v >> unit;
      return unit == "kB" ? v * 1024 : v;
    }
  }
  return -1;
}

std::string read_first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("model name", 0) == 0) {
      auto p = line.find(':');
      return p == std::string::npos ? line : trim(line.substr(p + 2));
    }
  }
  return "unknown";
}

json host_info(const std::vector<std::string>& files) {
  json h;
  utsname u{};
  ::uname(&u);
  h["hostname"] = u.nodename;
  h["kernel"] = std::string(u.sysname) + " " + u.release;
  h["cpu"] = cpu_model();
  h["cores"] = std::thread::hardware_concurrency();
  h["mem_total_bytes"] = meminfo("MemTotal");
  h["loadavg_at_start"] = read_first_line("/proc/loadavg");
  h["thp_enabled"] = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled");
  h["nr_hugepages"] = read_first_line("/proc/sys/vm/nr_hugepages");
  if (!files.empty()) {
    const std::string f = shell_quote(files.front());
    h["df"] = trim(run_command("df --output=source,fstype,size " + f + " 2>/dev/null | tail -1"));
    const std::string src = trim(run_command("df --output=source " + f + " 2>/dev/null | tail -1"));
    h["lsblk"] = trim(run_command("lsblk -dno NAME,SIZE,ROTA,TYPE,MODEL " + shell_quote(src) + " 2>/dev/null"));
  }
  char date[64];
  std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  h["date"] = date;
  return h;
}

// ---- explicit huge pages for the run ----

// Sets vm.nr_hugepages for the lifetime of the object and restores it after.
class HugeTlbReservation {
 public:
  HugeTlbReservation() = default;
  HugeTlbReservation(const HugeTlbReservation&) = delete;
  HugeTlbReservation& operator=(const HugeTlbReservation&) = delete;
  bool set(long pages, json* report) {
    const std::string before = read_first_line("/proc/sys/vm/nr_hugepages");
    (*report)["nr_hugepages_before"] = before;
    (*report)["requested"] = pages;
    if (::geteuid() != 0) {
      (*report)["error"] = "not root";
      return false;
    }
    if (!write_sysctl(std::to_string(pages))) {
      (*report)["error"] = "cannot write /proc/sys/vm/nr_hugepages";
      return false;
    }
    saved_ = before;
    (*report)["got"] = read_first_line("/proc/sys/vm/nr_hugepages");
    return true;
  }
  ~HugeTlbReservation() {
    if (!saved_.empty()) write_sysctl(saved_);
  }

 private:
  static bool write_sysctl(const std::string& value) {
    std::ofstream f("/proc/sys/vm/nr_hugepages");
    f << value << "\n";
    f.flush();
    return static_cast<bool>(f);
  }
  std::string saved_;
};

// ---- page cache ----

struct DropResult {
  std::string method;
  double resident_after = -1;
};

double residency(const std::vector<std::string>& files, const std::vector<std::uint64_t>& sizes) {
  pinload::Env* env = pinload::default_env();
  double weighted = 0, total = 0;
  for (std::size_t i = 0; i < files.size(); ++i) {
    const int fd = env->open_read(files[i], 0);
    if (fd < 0) return -1;
    const double r = env->resident_fraction(fd, sizes[i], 256);
    env->close(fd);
    if (r < 0) return -1;
    weighted += r * static_cast<double>(sizes[i]);
    total += static_cast<double>(sizes[i]);
  }
  return total > 0 ? weighted / total : 0;
}

DropResult drop_caches(const std::vector<std::string>& files, const std::vector<std::uint64_t>& sizes) {
  DropResult r;
  ::sync();
  bool dropped = false;
  if (::geteuid() == 0) {
    const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
      dropped = ::write(fd, "1\n", 2) == 2;
      ::close(fd);
    }
  }
  if (dropped) {
    r.method = "drop_caches";
  } else {
    r.method = "fadvise_dontneed";
    for (const auto& f : files) {
      const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      ::fdatasync(fd);
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  }
  r.resident_after = residency(files, sizes);
  return r;
}

// ---- measurements ----

struct Sample {
  double seconds = 0;
  double gbps = 0;
  json extra = json::object();
};

struct Series {
  std::vector<Sample> runs;
  bool empty() const { return runs.empty(); }
  double best() const {
    double b = 0;
    for (const auto& s : runs) b = std::max(b, s.gbps);
    return b;
  }
  double median() const {
    std::vector<double> v;
    for (const auto& s : runs) v.push_back(s.gbps);
    return pinload::bench::median(std::move(v)).value_or(0);
  }
  json to_json() const {
    json j;
    j["best_gbps"] = best();
    j["median_gbps"] = median();
    json runs_j = json::array();
    for (const auto& s : runs) {
      json r = {{"seconds", s.seconds}, {"gbps", s.gbps}};
      for (auto& [k, v] : s.extra.items()) r[k] = v;
      runs_j.push_back(r);
    }
    j["runs"] = runs_j;
    return j;
  }
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// memcpy of `bytes` from one prefaulted buffer to another, split over `threads`.
double memcpy_gbps(std::size_t bytes, unsigned threads, int reps) {
  std::unique_ptr<std::byte[]> src(new std::byte[bytes]);
  std::unique_ptr<std::byte[]> dst(new std::byte[bytes]);
  std::memset(src.get(), 0x5a, bytes);
  std::memset(dst.get(), 0x00, bytes);
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    if (threads <= 1) {
      std::memcpy(dst.get(), src.get(), bytes);
    } else {
      std::vector<std::jthread> ts;
      const std::size_t per = (bytes / threads + 4095) / 4096 * 4096;
      for (unsigned t = 0; t < threads; ++t) {
        const std::size_t begin = std::min(bytes, per * t), end = std::min(bytes, per * (t + 1));
        ts.emplace_back([&, begin, end] { std::memcpy(dst.get() + begin, src.get() + begin, end - begin); });
      }
    }
    const double s = seconds_since(t0);
    best = std::max(best, static_cast<double>(bytes) / s / 1e9);
  }
  volatile std::byte sink = dst[bytes / 2];
  (void)sink;
  return best;
}

// One single-threaded read() sweep over the files with a 1 MiB buffer.
Sample buffered_read(const std::vector<std::string>& files) {
  std::vector<char> buf(1u << 20);
  std::uint64_t total = 0;
  const auto t0 = Clock::now();
  for (const auto& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error("cannot open " + f);
    for (;;) {
      const ssize_t n = ::read(fd, buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw std::runtime_error("read failed on " + f);
      if (n == 0) break;
      total += static_cast<std::uint64_t>(n);
    }
    ::close(fd);
  }
  Sample s;
  s.seconds = seconds_since(t0);
  s.gbps = static_cast<double>(total) / s.seconds / 1e9;
  s.extra["bytes"] = total;
  return s;
}

// fio's direct sequential read of the files: one job over all of them
// (--filename=a:b:..., fio round-robins between the files), so a multi-file
// checkpoint is read with one queue of `iodepth` as deep as asked.
//   "iodepth32", "iodepth1": the reference runs (numjobs=1, libaio, bs 2M);
//   "parallel": 4 jobs x iodepth 8, each reading a quarter of the bytes: what
//               several concurrent streams (as pinload's threads) can get.
//   "iodepth32_hugebuf", "iodepth1_hugebuf": the same with buffers in explicit
//               huge pages (--iomem=shmhuge), where vm.nr_hugepages has room;
//   "iodepth8_bs8M_hugebuf": bs 8M, iodepth 8, huge-page buffers: pinload's
//               default request size and count (8 threads x 8 MiB) in one queue.
struct FioVariant {
  const char* name;
  const char* bs;
  int iodepth;
  bool parallel;  // 4 jobs, each a quarter of the bytes
  bool hugebuf;   // --iomem=shmhuge
};
constexpr FioVariant kFioVariants[] = {
    {"iodepth32", "2M", 32, false, false},        {"iodepth1", "2M", 1, false, false},
    {"parallel", "2M", 8, true, false},           {"iodepth32_hugebuf", "2M", 32, false, true},
    {"iodepth1_hugebuf", "2M", 1, false, true},   {"iodepth8_bs8M_hugebuf", "8M", 8, false, true},
};

// The fio row's name in the summary table.
std::string fio_variant_title(const FioVariant& v) {
  std::string name = std::string("fio direct, bs ") + v.bs + ", " +
                     (v.parallel ? "4 jobs x " : "") + "iodepth " + std::to_string(v.iodepth);
  if (v.hugebuf) name += ", huge-page buffers";
  return name;
}

std::optional<Sample> fio_read(const std::vector<std::string>& files, const FioVariant& variant, int runtime,
                               std::string* error) {
  std::string names;
  for (const auto& f : files) {
    if (!names.empty()) names += ':';
    for (char c : f) {
      if (c == ':') names += '\\';
      names += c;
    }
  }
  std::string cmd = "fio --name=r --filename=" + shell_quote(names) +
                    " --rw=read --direct=1 --ioengine=libaio --readonly --output-format=json";
  cmd += std::string(" --bs=") + variant.bs + " --iodepth=" + std::to_string(variant.iodepth);
  cmd += variant.parallel ? " --numjobs=4 --size=25% --offset_increment=25% --group_reporting" : " --numjobs=1";
  if (variant.hugebuf) cmd += " --iomem=shmhuge";
  if (runtime > 0) cmd += " --runtime=" + std::to_string(runtime);
  cmd += " 2>/dev/null";
  int status = 0;
  const std::string out = run_command(cmd, &status);
  const auto brace = out.find('{');
  if (status != 0 || brace == std::string::npos) {
    *error = "fio failed or is not installed (exit status " + std::to_string(status) + ")";
    return std::nullopt;
  }
  Sample s;
  try {
    const json j = json::parse(out.substr(brace));
    const json& rd = j.at("jobs").at(0).at("read");
    const std::uint64_t bytes = rd.at("io_bytes").get<std::uint64_t>();
    s.seconds = rd.at("runtime").get<double>() / 1000;
    s.gbps = s.seconds > 0 ? static_cast<double>(bytes) / s.seconds / 1e9 : 0;
    s.extra["bytes"] = bytes;
    s.extra["fio_bw_bytes"] = rd.at("bw_bytes");
    s.extra["fio_version"] = j.value("fio version", "");
  } catch (const std::exception& e) {
    *error = std::string("cannot parse fio output: ") + e.what();
    return std::nullopt;
  }
  s.extra["variant"] = variant.name;
  s.extra["command"] = cmd;
  return s;
}

// Counts the preads that go through it (the switch phase: a cache hit makes none).
class PreadCountingEnv : public pinload::EnvWrapper {
 public:
  PreadCountingEnv() : EnvWrapper(pinload::default_env()) {}
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    preads.fetch_add(1, std::memory_order_relaxed);
    return EnvWrapper::pread(fd, buffer, bytes, offset);
  }
  std::atomic<std::uint64_t> preads{0};
};

// One pinload load; the state dict is released (unloaded) after timing.
Sample pinload_load(const std::vector<std::string>& paths, const pinload::LoadOptions& options,
                    const std::shared_ptr<pinload::Pool>& pool) {
  pinload::Loader loader(options, pool);
  const auto before = pool->stats();
  const auto t0 = Clock::now();
  pinload::LoadHandle handle = loader.load_async(paths);
  pinload::StateDict sd = handle.wait();
  Sample s;
  s.seconds = seconds_since(t0);
  const pinload::LoadProgress p = handle.progress();
  const auto after = pool->stats();
  s.gbps = static_cast<double>(sd.total_bytes()) / s.seconds / 1e9;
  s.extra["bytes"] = sd.total_bytes();
  s.extra["tensors"] = sd.size();
  s.extra["files_direct"] = p.files_direct;
  s.extra["files_buffered"] = p.files_buffered;
  s.extra["new_os_reservations"] = after.os_reservations - before.os_reservations;
  s.extra["free_list_hits"] = after.free_list_hits - before.free_list_hits;
  return s;
}

std::string fmt(double v, int prec = 2) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

void log_sample(const std::string& what, const Sample& s) {
  std::cerr << "  " << what << ": " << fmt(s.seconds, 3) << " s, " << fmt(s.gbps) << " GB/s";
  for (const char* k : {"files_direct", "files_buffered", "new_os_reservations", "resident_before"}) {
    if (s.extra.contains(k)) std::cerr << ", " << k << "=" << s.extra[k].dump();
  }
  std::cerr << "\n";
}

double median_of(std::vector<double> v) { return pinload::bench::median(std::move(v)).value_or(0); }

// Runs every step once, starting with step `round % steps.size()` and wrapping
// around, so that over the rounds no step always goes first: a shared machine's
// weather drifts within a round too.
void in_rotated_order(std::size_t round, const std::vector<std::function<void()>>& steps) {
  for (std::size_t k = 0; k < steps.size(); ++k) steps[(k + round) % steps.size()]();
}

// ---- device ----

// One copy of `bytes` from pinned host memory to the device, best of `reps`
// after a warm-up: on CUDA, pinned cudaMemcpy bandwidth, the ceiling of every
// load to the device.
double pinned_copy_gbps(pinload::Device& device, std::size_t bytes, int reps) {
  auto pool = pinload::Pool::create(device.make_pinned_backend());
  std::shared_ptr<pinload::Block> block = pool->allocate(bytes);
  std::memset(block->data(), 0x5a, bytes);
  std::shared_ptr<pinload::DeviceBuffer> buffer = device.allocate(bytes);
  pinload::Stream stream = device.create_stream();
  double best = 0;
  for (int r = 0; r <= reps; ++r) {
    const auto t0 = Clock::now();
    device.copy_to_device_async(*buffer, 0, block->data(), bytes, stream);
    stream.synchronize();
    if (r > 0) best = std::max(best, static_cast<double>(bytes) / seconds_since(t0) / 1e9);
  }
  return best;
}

struct DevicePhase {
  json results = json::object();
  json ratios = json::object();
  json targets = json::object();
  std::vector<std::pair<std::string, const Series*>> rows;
  std::map<std::string, Series> series;
};

// The device phase (see the top of the file). Host-only loads of the same
// rounds go into the same pinned pool, so the ratios compare like with like.
DevicePhase device_phase(const Args& args, pinload::Device* device, const std::vector<std::string>& files,
                         const std::function<double()>& drop, double fio_best) {
  DevicePhase out;
  std::cerr << "[device] " << device->description() << "\n";
  out.results["device"] = device->description();
  const double limit = pinned_copy_gbps(*device, args.memcpy_bytes, 3);
  std::cerr << "  pinned copy to the device, " << size_name(args.memcpy_bytes) << ": " << fmt(limit) << " GB/s\n";
  out.results["pinned_copy_gbps"] = limit;
  out.results["pinned_copy_bytes"] = args.memcpy_bytes;
  out.results["streams"] = args.copy.streams;
  out.results["chunk_bytes"] = args.copy.chunk_bytes;
  out.results["staging_bytes"] = args.staging_bytes;

  auto pinned = pinload::Pool::create(device->make_pinned_backend());
  pinload::LoadOptions host = args.load;
  pinload::LoadOptions cached = args.load;
  cached.target = {device, pinload::DeviceMode::kCached, args.copy, args.staging_bytes};
  pinload::LoadOptions streaming = cached;
  streaming.target.mode = pinload::DeviceMode::kStreaming;
  Series& engine = out.series["engine"];
  Series& warm_host = out.series["warm_host"];
  Series& warm_device = out.series["warm_device"];
  Series& cold_host = out.series["cold_host"];
  Series& cold_device = out.series["cold_device"];
  Series& cold_streaming = out.series["cold_streaming"];

  buffered_read(files);  // warm: the files in the page cache
  {
    const pinload::StateDict sd = pinload::Loader(host, pinned).load(args.paths);
    for (int r = 0; r < args.repeat; ++r) {
      const auto t0 = Clock::now();
      const pinload::StateDict on_device = pinload::upload(sd, *device, args.copy);
      Sample s;
      s.seconds = seconds_since(t0);
      s.gbps = static_cast<double>(sd.total_bytes()) / s.seconds / 1e9;
      log_sample("copy engine alone (upload)", s);
      engine.runs.push_back(s);
    }
  }
  std::vector<double> warm_round, cold_round, streaming_round;
  for (int r = 0; r < args.repeat; ++r) {
    warm_host.runs.push_back(pinload_load(args.paths, host, pinned));
    warm_device.runs.push_back(pinload_load(args.paths, cached, pinned));
    log_sample("warm, host only", warm_host.runs.back());
    log_sample("warm, to the device", warm_device.runs.back());
    warm_round.push_back(warm_device.runs.back().gbps / warm_host.runs.back().gbps);
  }
  std::uint64_t staging_peak = 0;
  for (int r = 0; r < args.repeat; ++r) {
    drop();
    cold_host.runs.push_back(pinload_load(args.paths, host, pinned));
    drop();
    cold_device.runs.push_back(pinload_load(args.paths, cached, pinned));
    log_sample("cold, host only", cold_host.runs.back());
    log_sample("cold, to the device", cold_device.runs.back());
    cold_round.push_back(cold_device.runs.back().gbps / cold_host.runs.back().gbps);
    drop();
    cold_streaming.runs.push_back(pinload_load(args.paths, streaming, pinned));
    log_sample("cold, streaming to the device", cold_streaming.runs.back());
    streaming_round.push_back(cold_streaming.runs.back().gbps / cold_device.runs.back().gbps);
  }
  {
    // The staging pool's peak, from one more streaming load whose loader we keep.
    drop();
    pinload::Loader loader(streaming, pinned);
    (void)loader.load(args.paths);
    staging_peak = loader.staging_pool()->stats().peak_reserved_bytes;
  }
  for (auto& [name, series] : out.series) out.results[name] = series.to_json();
  out.results["streaming_staging_peak_reserved_bytes"] = staging_peak;

  out.ratios["device_engine_over_pinned_copy"] = engine.best() / limit;
  out.ratios["device_warm_over_pinned_copy"] = warm_device.best() / limit;
  out.ratios["device_warm_over_host_warm_same_round_median"] = median_of(warm_round);
  out.ratios["device_cold_over_host_cold_same_round_median"] = median_of(cold_round);
  // Burn after reading: a host budget instead of the whole model in the pool.
  out.ratios["device_streaming_over_cached_cold_same_round_median"] = median_of(streaming_round);
  out.ratios["device_streaming_staging_peak_over_budget"] =
      static_cast<double>(staging_peak) / static_cast<double>(args.staging_bytes);
  out.targets["device_engine_ge_0.9_pinned_copy"] = engine.best() / limit >= 0.9;
  out.targets["device_warm_ge_0.85_pinned_copy"] = warm_device.best() / limit >= 0.85;
  out.targets["device_streaming_peak_le_budget"] = staging_peak <= args.staging_bytes;
  out.targets["device_streaming_within_15pct_of_cached"] = median_of(streaming_round) >= 0.85;
  if (fio_best > 0) {
    out.ratios["device_cold_over_fio_best"] = cold_device.best() / fio_best;
    out.targets["device_cold_ge_0.9_fio"] = cold_device.best() / fio_best >= 0.9;
  }
  const std::string on = " (" + args.device + ")";
  out.rows = {{"copy engine alone, upload()" + on, &engine},
              {"warm, host only, pinned pool", &warm_host},
              {"warm, to the device, cached" + on, &warm_device},
              {"cold, host only, pinned pool", &cold_host},
              {"cold, to the device, cached" + on, &cold_device},
              {"cold, streaming, " + size_name(args.staging_bytes) + " staging" + on, &cold_streaming}};
  return out;
}

int run(const Args& args) {
  // --device opens first, so that a missing GPU fails before minutes of fio.
  // The stand-in does not poison fresh memory here: a GPU's cudaMalloc writes nothing.
  std::unique_ptr<pinload::Device> target_device;
  if (!args.device.empty()) {
    // "cpu" is host memory, not a device: open_device refuses it.
    target_device = pinload::open_device(pinload::parse_device_spec(args.device, "--device"), {.poison = false});
  }
  pinload::Checkpoint ck = pinload::open_checkpoint(pinload::default_env(), args.paths, args.load.resolve);
  std::vector<std::string> files;
  std::vector<std::uint64_t> sizes;
  std::uint64_t file_bytes = 0;
  for (const auto& f : ck.files) {
    files.push_back(f.path);
    sizes.push_back(f.stat.size);
    file_bytes += f.stat.size;
  }
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());

  json out;
  out["tool"] = "pinload-bench";
  out["label"] = args.label;
  out["host"] = host_info(files);
  out["paths"] = args.paths;
  json files_j = json::array();
  for (std::size_t i = 0; i < files.size(); ++i) files_j.push_back({{"path", files[i]}, {"bytes", sizes[i]}});
  out["files"] = files_j;
  out["tensors"] = ck.tensor_count();
  out["data_bytes"] = ck.data_bytes();
  out["file_bytes"] = file_bytes;
  out["options"] = {{"threads", args.load.threads},
                    {"block_size", args.load.block_size},
                    {"direct", direct_arg_name(args.load.direct)},
                    {"cached_read", cached_read_arg_name(args.load.cached_read)},
                    {"files_in_flight", args.load.files_in_flight},
                    {"repeat", args.repeat},
                    {"huge_pages", huge_pages_name(args.huge_pages)},
                    {"lock", args.lock},
                    {"phases", args.phases}};
  std::cerr << "pinload-bench: " << files.size() << " file(s), " << ck.tensor_count() << " tensors, "
            << fmt(static_cast<double>(ck.data_bytes()) / 1e9, 3) << " GB of tensor data\n";

  HugeTlbReservation hugetlb;
  if (args.hugetlb != "off") {
    long pages = 0;
    if (args.hugetlb == "auto") {
      pages = 80;  // fio: 32 x 2 MiB buffers and slack
      if (args.huge_pages == pinload::HugePages::kExplicit) {
        // A block is a whole size class (pool.h); a class is a multiple of 2 MiB.
        for (std::uint64_t sz : sizes) {
          pages += static_cast<long>(pinload::Pool::size_class(sz + 8192) / (2u << 20)) + 1;
        }
      }
    } else {
      pages = static_cast<long>(parse_size(args.hugetlb));
    }
    json report;
    hugetlb.set(pages, &report);
    std::cerr << "[hugetlb] vm.nr_hugepages " << report.dump() << " (restored at exit)\n";
    out["hugetlb"] = report;
  }

  std::string drop_method;
  auto drop = [&]() {
    DropResult d = drop_caches(files, sizes);
    drop_method = d.method;
    if (d.resident_after > 0.05) {
      std::cerr << "  warning: " << fmt(d.resident_after * 100, 0) << "% of the files still in the page cache after "
                << d.method << "\n";
    }
    return std::round(d.resident_after * 1000) / 1000;
  };

  json results;
  // ---- memcpy ----
  double memcpy_single = 0, memcpy_multi = 0;
  if (args.has("memcpy")) {
    std::cerr << "[memcpy] " << size_name(args.memcpy_bytes) << " buffers\n";
    memcpy_single = memcpy_gbps(args.memcpy_bytes, 1, 3);
    memcpy_multi = memcpy_gbps(args.memcpy_bytes, cores, 3);
    std::cerr << "  1 thread " << fmt(memcpy_single) << " GB/s, " << cores << " threads " << fmt(memcpy_multi)
              << " GB/s\n";
    results["memcpy"] = {{"bytes", args.memcpy_bytes},
                         {"single_gbps", memcpy_single},
                         {"multi_gbps", memcpy_multi},
                         {"multi_threads", cores}};
  }

  // ---- plain buffered read ----
  double buffered_cold = 0, buffered_warm = 0;
  if (args.has("buffered")) {
    std::cerr << "[buffered] single-thread read(), 1 MiB buffer\n";
    const double resident = drop();
    Sample c = buffered_read(files);
    log_sample("cold", c);
    Sample w = buffered_read(files);
    log_sample("warm", w);
    buffered_cold = c.gbps;
    buffered_warm = w.gbps;
    results["buffered_read"] = {{"cold_gbps", c.gbps}, {"cold_seconds", c.seconds}, {"warm_gbps", w.gbps},
                                {"warm_seconds", w.seconds}, {"resident_before_cold", resident}};
  }

  // ---- the pool every pinload load of this run uses ----
  pinload::LockedMemoryOptions mem;
  mem.huge_pages = args.huge_pages;
  mem.lock = args.lock;
  const std::int64_t anon_huge_before = meminfo("AnonHugePages");
  const std::int64_t huge_free_before = meminfo("HugePages_Free");
  auto pool = pinload::Pool::create(pinload::make_locked_memory_backend(pinload::default_env(), mem));
  Series cold, warm;
  std::optional<Sample> first;
  std::uint64_t reload_new_reservations = 0;
  int reloads = 0;
  auto record = [&](Series* series, Sample s) {
    s.extra["fresh_pool"] = !first.has_value();
    if (!first) {
      first = s;
      // How the pool's memory is backed, once it holds the whole checkpoint.
      results["pool_memory"] = {
          {"backend", std::string(pool->backend_name())},
          {"huge_pages_option", huge_pages_name(args.huge_pages)},
          {"reserved_bytes", pool->stats().reserved_bytes},
          {"anon_huge_pages_delta_bytes", meminfo("AnonHugePages") - anon_huge_before},
          {"explicit_huge_pages_used", huge_free_before - meminfo("HugePages_Free")},
      };
    } else {
      reload_new_reservations += s.extra["new_os_reservations"].get<std::uint64_t>();
      ++reloads;
    }
    series->runs.push_back(std::move(s));
  };

  // ---- cold rounds: fio and pinload interleaved, so that both see the same
  // storage weather (this is a shared machine); ratios are taken per round.
  // Note [Comparing with fio] ----
  std::map<std::string, Series> fio;
  std::string fio_error;
  const bool do_fio = args.has("fio"), do_cold = args.has("cold");
  const auto rounds = static_cast<std::size_t>(std::max(args.repeat, 0));
  if (do_fio || do_cold) {
    std::cerr << "[cold rounds] " << (do_cold ? "1 first load, then " : "") << rounds << " x ("
              << (do_fio ? "fio iodepth 32, 1, parallel; " : "")
              << (do_cold ? "pinload " + std::to_string(args.load.threads) + " threads, block " +
                                size_name(args.load.block_size) + ", direct " + direct_arg_name(args.load.direct)
                          : std::string())
              << "), alternating which goes first\n";
  }
  // Each sample of a round carries extra["round"], from which the comparison
  // with fio is built.
  auto cold_load = [&](const char* what, std::optional<std::size_t> round) {
    const double resident = drop();
    Sample s = pinload_load(args.paths, args.load, pool);
    s.extra["resident_before"] = resident;
    if (round) s.extra["round"] = *round;
    log_sample(what, s);
    record(&cold, std::move(s));
  };
  // The first load fills a fresh pool: it is reported alone, and every round
  // then compares a re-load with fio.
  if (do_cold) cold_load("pinload cold, fresh pool", std::nullopt);
  for (std::size_t r = 0; r < rounds && (do_fio || do_cold); ++r) {
    auto run_fio = [&] {
      if (!do_fio || !fio_error.empty()) return;
      for (const FioVariant& v : kFioVariants) {
        if (v.hugebuf && meminfo("HugePages_Free") < 72) continue;
        drop();
        auto s = fio_read(files, v, args.fio_runtime, &fio_error);
        if (!s) {
          std::cerr << "  fio skipped: " << fio_error << "\n";
          return;
        }
        log_sample(std::string("fio ") + v.name, *s);
        s->extra["round"] = r;
        fio[v.name].runs.push_back(std::move(*s));
      }
    };
    auto run_pinload = [&] {
      if (do_cold) cold_load("pinload cold, re-load", r);
    };
    in_rotated_order(r, {run_fio, run_pinload});
  }
  pinload::bench::ColdRounds cold_rounds;
  cold_rounds.fio.resize(rounds);
  cold_rounds.pinload.assign(rounds, 0);
  for (const auto& [variant, series] : fio) {
    for (const Sample& s : series.runs) cold_rounds.fio[s.extra["round"].get<std::size_t>()][variant] = s.gbps;
  }
  for (const Sample& s : cold.runs) {
    if (s.extra.contains("round")) cold_rounds.pinload[s.extra["round"].get<std::size_t>()] = s.gbps;
  }
  const pinload::bench::FioComparison vs_fio = pinload::bench::compare_with_fio(cold_rounds);
  double fio_best = 0, fio_parallel_best = 0, fio_hugebuf_best = 0;
  if (do_fio) {
    json fio_j;
    if (!fio_error.empty()) fio_j["error"] = fio_error;
    for (const FioVariant& v : kFioVariants) {
      if (!fio.count(v.name)) continue;
      const Series& series = fio[v.name];
      fio_j[v.name] = series.to_json();
      fio_j[v.name]["command"] = series.runs.front().extra["command"];
      fio_j[v.name]["title"] = fio_variant_title(v);
      if (v.parallel) fio_parallel_best = series.best();
      else if (v.hugebuf) fio_hugebuf_best = std::max(fio_hugebuf_best, series.best());
    }
    fio_best = vs_fio.fio_best_any;
    fio_j["best_gbps"] = fio_best;  // of every iodepth 32 and 1 run, numjobs 1 (huge-page buffers included)
    fio_j["hugebuf_best_gbps"] = fio_hugebuf_best;
    fio_j["parallel_best_gbps"] = fio_parallel_best;
    if (!vs_fio.reference.empty()) {
      fio_j["reference"] = vs_fio.reference;  // Note [Comparing with fio]
      fio_j["reference_best_gbps"] = vs_fio.reference_best;
      fio_j["reference_median_gbps"] = vs_fio.reference_median;
    }
    results["fio"] = fio_j;
  }

  // ---- warm ----
  std::vector<double> warm_round_ratio;  // pinload warm / memcpy of the same round
  // The same rounds with each forced CachedRead (Note [Mapped reads]).
  std::map<std::string, Series> warm_forced;
  std::vector<double> warm_map_over_pread;
  const std::pair<const char*, pinload::CachedRead> kForced[] = {{"map", pinload::CachedRead::kMap},
                                                                 {"pread", pinload::CachedRead::kPread}};
  if (args.has("warm")) {
    std::cerr << "[pinload warm]\n";
    buffered_read(files);  // bring the files into the page cache
    const double resident = std::round(residency(files, sizes) * 1000) / 1000;
    for (int r = 0; r < args.repeat; ++r) {
      // memcpy in the same round, so the ratio sees the same CPU weather.
      const double round_memcpy = args.has("memcpy") ? std::max(memcpy_gbps(args.memcpy_bytes, 1, 1),
                                                                memcpy_gbps(args.memcpy_bytes, cores, 1))
                                                     : 0;
      // The load as configured, then (cached-read) one with each forced CachedRead.
      std::vector<std::function<void()>> loads = {[&] {
        Sample s = pinload_load(args.paths, args.load, pool);
        s.extra["resident_before"] = resident;
        if (round_memcpy > 0) {
          s.extra["round_memcpy_gbps"] = round_memcpy;
          warm_round_ratio.push_back(s.gbps / round_memcpy);
        }
        log_sample("warm", s);
        record(&warm, std::move(s));
      }};
      double forced_gbps[2] = {0, 0};
      if (args.has("cached-read")) {
        for (std::size_t m = 0; m < 2; ++m) {
          loads.push_back([&, m] {
            const auto& [name, method] = kForced[m];
            pinload::LoadOptions forced = args.load;
            forced.cached_read = method;
            Sample o = pinload_load(args.paths, forced, pool);
            log_sample(std::string("warm, --cached-read ") + name, o);
            forced_gbps[m] = o.gbps;
            warm_forced[name].runs.push_back(std::move(o));
          });
        }
      }
      in_rotated_order(static_cast<std::size_t>(r), loads);
      if (args.has("cached-read")) warm_map_over_pread.push_back(forced_gbps[0] / forced_gbps[1]);
    }
  }
  for (const auto& [name, series] : warm_forced) results["pinload_warm_cached_read_" + name] = series.to_json();

  // Cold without the fresh-pool run: the steady state of a server re-loading.
  Series cold_reused;
  for (const auto& s : cold.runs) {
    if (!s.extra.value("fresh_pool", false)) cold_reused.runs.push_back(s);
  }
  if (!cold.empty()) {
    results["pinload_cold"] = cold.to_json();
    results["pinload_cold"]["reused_pool_best_gbps"] = cold_reused.best();
    results["pinload_cold"]["reused_pool_median_gbps"] = cold_reused.median();
  }
  if (!warm.empty()) results["pinload_warm"] = warm.to_json();
  if (first) {
    const auto st = pool->stats();
    results["reload"] = {{"first_load_seconds", first->seconds},
                         {"first_load_gbps", first->gbps},
                         {"first_load_new_os_reservations", first->extra["new_os_reservations"]},
                         {"reloads", reloads},
                         {"reload_new_os_reservations", reload_new_reservations},
                         {"pool_stats_after", {{"reserved_bytes", st.reserved_bytes},
                                               {"os_reservations", st.os_reservations},
                                               {"os_releases", st.os_releases},
                                               {"allocations", st.allocations},
                                               {"free_list_hits", st.free_list_hits}}}};
    if (!cold_reused.empty()) {
      std::vector<double> t;
      for (const auto& s : cold_reused.runs) t.push_back(s.seconds);
      results["reload"]["cold_reload_median_seconds"] = median_of(t);
    }
  }

  // ---- sweep ----
  if (args.has("sweep")) {
    json sweep = json::array();
    const auto before = pool->stats();
    std::cerr << "[sweep] cold";
    for (unsigned t : args.sweep_threads) {
      for (std::size_t b : args.sweep_blocks) {
        pinload::LoadOptions o = args.load;
        o.threads = t;
        o.block_size = b;
        Series c;
        for (int r = 0; r < args.sweep_repeat; ++r) {
          drop();
          c.runs.push_back(pinload_load(args.paths, o, pool));
        }
        std::cerr << " " << fmt(c.best()) << std::flush;
        sweep.push_back({{"threads", t}, {"block_size", b}, {"cold", c.to_json()}});
      }
    }
    std::cerr << "\n";
    if (args.sweep_warm) {
      std::cerr << "[sweep] warm";
      buffered_read(files);
      std::size_t i = 0;
      for (unsigned t : args.sweep_threads) {
        for (std::size_t b : args.sweep_blocks) {
          pinload::LoadOptions o = args.load;
          o.threads = t;
          o.block_size = b;
          Series w;
          for (int r = 0; r < args.sweep_repeat; ++r) w.runs.push_back(pinload_load(args.paths, o, pool));
          std::cerr << " " << fmt(w.best()) << std::flush;
          sweep[i++]["warm"] = w.to_json();
        }
      }
      std::cerr << "\n";
    }
    results["sweep"] = sweep;
    results["sweep_new_os_reservations"] = pool->stats().os_reservations - before.os_reservations;
  }
  // ---- switch: switching back to a model held in the cache, against a cold load ----
  std::optional<double> switch_ratio;
  if (args.has("switch")) {
    PreadCountingEnv env;
    pinload::ModelCache cache(UINT64_MAX, std::make_shared<const pinload::Loader>(args.load, pool, &env));
    const double resident = drop();
    const auto t0 = Clock::now();
    const std::uint64_t bytes = cache.get(args.paths).total_bytes();  // a miss: the cold load
    const double cold_s = seconds_since(t0);
    const std::uint64_t cold_preads = env.preads.load();
    const auto before = pool->stats();
    const int hits = 20 * args.repeat;
    std::vector<double> hit_s;
    for (int i = 0; i < hits; ++i) {
      const auto t = Clock::now();
      const pinload::StateDict sd = cache.get(args.paths);
      hit_s.push_back(seconds_since(t));
    }
    const auto after = pool->stats();
    const double hit_median = median_of(hit_s);
    switch_ratio = hit_median / cold_s;
    const pinload::ModelCacheStats cs = cache.stats();
    results["switch"] = {{"bytes", bytes},
                         {"resident_before_cold", resident},
                         {"cold_seconds", cold_s},
                         {"cold_gbps", static_cast<double>(bytes) / cold_s / 1e9},
                         {"cold_preads", cold_preads},
                         {"hits", hits},
                         {"hit_median_seconds", hit_median},
                         {"hit_best_seconds", *std::min_element(hit_s.begin(), hit_s.end())},
                         {"hit_over_cold", *switch_ratio},
                         {"preads_on_hits", env.preads.load() - cold_preads},
                         {"new_os_reservations_on_hits", after.os_reservations - before.os_reservations},
                         {"allocations_on_hits", after.allocations - before.allocations},
                         {"cache_hits", cs.hits},
                         {"cache_misses", cs.misses},
                         {"cached_bytes", cs.cached_bytes}};
    std::cerr << "[switch] cold load " << fmt(cold_s, 3) << " s (" << cold_preads << " preads); switching back, "
              << hits << " hits: median " << fmt(hit_median * 1e6, 1) << " us = " << fmt(*switch_ratio * 100, 4)
              << " % of the cold load, " << results["switch"]["preads_on_hits"].dump() << " preads, "
              << results["switch"]["new_os_reservations_on_hits"].dump() << " new OS reservations\n";

    // With --device: a hit to the device (get_on) against a bare upload() of the same host
    // copy, alternated; host copies in the device's pinned memory, as a GPU service sets it up.
    if (!args.device.empty()) {
      pinload::Device* device = target_device.get();
      auto pinned = pinload::Pool::create(device->make_pinned_backend());
      pinload::ModelCache on_device(UINT64_MAX, std::make_shared<const pinload::Loader>(args.load, pinned, &env));
      const pinload::StateDict host = on_device.get(args.paths);
      const std::uint64_t preads = env.preads.load();
      std::vector<double> bare_s, get_on_s;
      // Each result is freed before the next copy, and the order alternates, so that neither
      // side always gets the device memory the other has just freed.
      auto time_upload = [&] {
        const auto t = Clock::now();
        const pinload::StateDict bare = pinload::upload(host, *device, args.copy);
        bare_s.push_back(seconds_since(t));
      };
      auto time_get_on = [&] {
        const auto t = Clock::now();
        const pinload::StateDict hit = on_device.get_on(*device, args.paths, args.copy);
        get_on_s.push_back(seconds_since(t));
      };
      for (int i = 0; i < 4 * args.repeat + 1; ++i) in_rotated_order(static_cast<std::size_t>(i), {time_upload, time_get_on});
      const double bare = median_of(bare_s), hit = median_of(get_on_s);
      results["switch"]["device"] = {{"device", args.device},
                                     {"streams", args.copy.streams},
                                     {"chunk_bytes", args.copy.chunk_bytes},
                                     {"rounds", bare_s.size()},
                                     {"upload_median_seconds", bare},
                                     {"upload_gbps", static_cast<double>(bytes) / bare / 1e9},
                                     {"get_on_hit_median_seconds", hit},
                                     {"get_on_hit_gbps", static_cast<double>(bytes) / hit / 1e9},
                                     {"hit_over_upload", hit / bare},
                                     {"preads_on_hits", env.preads.load() - preads}};
      std::cerr << "[switch] to " << args.device << ": get_on hit " << fmt(hit, 4) << " s, bare upload() "
                << fmt(bare, 4) << " s of the same bytes: " << fmt(hit / bare, 3) << "x, "
                << results["switch"]["device"]["preads_on_hits"].dump() << " preads\n";
    }
  }

  // ---- pool: a fresh reservation of the checkpoint's blocks, timed alone ----
  if (args.has("pool")) {
    const std::uint64_t main_reserved = pool->stats().reserved_bytes;
    pool.reset();  // give its memory back first, so both do not coexist
    std::cerr << "[pool] fresh pool reserving the checkpoint's blocks after a cache drop (huge pages "
              << huge_pages_name(args.huge_pages) << ")\n";
    drop();
    std::this_thread::sleep_for(std::chrono::seconds(args.pool_settle));
    auto fresh = pinload::Pool::create(pinload::make_locked_memory_backend(pinload::default_env(), mem));
    std::vector<std::shared_ptr<pinload::Block>> blocks;
    const auto t0 = Clock::now();
    for (std::uint64_t sz : sizes) blocks.push_back(fresh->allocate((sz + 2 * 4096 - 1) / 4096 * 4096));
    const double reserve_s = seconds_since(t0);
    const auto t1 = Clock::now();
    for (auto& b : blocks) {
      for (std::size_t i = 0; i < b->size(); i += 4096) b->data()[i] = std::byte{1};
    }
    const double touch_s = seconds_since(t1);
    const auto st = fresh->stats();
    const double total_s = reserve_s + touch_s;
    results["pool_reserve"] = {{"reserved_bytes", st.reserved_bytes},
                               {"os_reservations", st.os_reservations},
                               {"reserve_seconds", reserve_s},
                               {"first_touch_seconds", touch_s},
                               {"gbps", static_cast<double>(st.reserved_bytes) / total_s / 1e9},
                               {"locked", !blocks.empty() && blocks.front()->locked()},
                               {"settle_seconds", args.pool_settle},
                               {"main_pool_reserved_bytes", main_reserved}};
    std::cerr << "  " << fmt(static_cast<double>(st.reserved_bytes) / 1e9) << " GB: reserve " << fmt(reserve_s, 3)
              << " s + first touch " << fmt(touch_s, 3) << " s = "
              << fmt(static_cast<double>(st.reserved_bytes) / total_s / 1e9) << " GB/s\n";
  }

  std::optional<DevicePhase> device_results;
  if (args.has("device")) {
    device_results = device_phase(args, target_device.get(), files, drop, fio_best);
    results["device"] = device_results->results;
  }

  out["drop_cache_method"] = drop_method.empty() ? "none" : drop_method;
  out["host"]["loadavg_at_end"] = read_first_line("/proc/loadavg");
  out["results"] = results;

  // ---- ratios and targets ----
  json ratios, targets;
  if (vs_fio.reference_best > 0 && vs_fio.pinload_best > 0) {
    // Note [Comparing with fio]: the target is on the reference variant.
    ratios["cold_best_over_fio_reference_best"] = vs_fio.best_over_reference_best();
    if (vs_fio.same_round_reference) {
      ratios["cold_over_fio_reference_same_round_median"] = *vs_fio.same_round_reference;
    }
    ratios["cold_best_over_fio_best"] = vs_fio.pinload_best / vs_fio.fio_best_any;
    if (vs_fio.same_round_best_variant) {
      ratios["cold_over_fio_best_variant_same_round_median"] = *vs_fio.same_round_best_variant;
    }
    targets["cold_ge_0.9_fio"] = vs_fio.meets(0.9);
  }
  if (!cold.empty() && fio_best > 0 && cold.runs.front().extra.value("fresh_pool", false)) {
    ratios["cold_fresh_pool_over_fio_best"] = cold.runs.front().gbps / fio_best;
  }
  if (vs_fio.same_round_parallel) {
    ratios["cold_best_over_fio_parallel_best"] = vs_fio.pinload_best / fio_parallel_best;
    ratios["cold_over_fio_parallel_same_round_median"] = *vs_fio.same_round_parallel;
  }
  if (!cold_reused.empty() && buffered_cold > 0) ratios["cold_over_read_1thread_cold"] = cold_reused.best() / buffered_cold;
  if (!warm.empty() && memcpy_multi > 0) {
    // The machine's memcpy ceiling is the better of one thread and all cores.
    ratios["warm_best_over_memcpy_best"] = warm.best() / std::max(memcpy_multi, memcpy_single);
    ratios["warm_median_over_memcpy_best"] = warm.median() / std::max(memcpy_multi, memcpy_single);
    if (!warm_round_ratio.empty()) ratios["warm_over_memcpy_same_round_median"] = median_of(warm_round_ratio);
    targets["warm_ge_0.8_memcpy"] = warm.best() / std::max(memcpy_multi, memcpy_single) >= 0.8;
  }
  if (!warm.empty() && buffered_warm > 0) ratios["warm_over_read_1thread_warm"] = warm.best() / buffered_warm;
  if (!warm_map_over_pread.empty()) ratios["warm_map_over_pread_same_round_median"] = median_of(warm_map_over_pread);
  if (reloads > 0) targets["reload_zero_new_os_reservations"] = reload_new_reservations == 0;
  if (device_results) {
    ratios.update(device_results->ratios);
    targets.update(device_results->targets);
  }
  if (switch_ratio) {
    ratios["switch_hit_over_cold"] = *switch_ratio;
    targets["switch_hit_le_0.01_cold"] = *switch_ratio <= 0.01;
    targets["switch_hit_zero_preads"] = results["switch"]["preads_on_hits"].get<std::uint64_t>() == 0;
    if (results["switch"].contains("device")) {
      const json& d = results["switch"]["device"];
      ratios["switch_device_hit_over_upload"] = d["hit_over_upload"];
      targets["switch_device_hit_le_1.10_upload"] = d["hit_over_upload"].get<double>() <= 1.10;
    }
  }
  out["ratios"] = ratios;
  out["targets"] = targets;

  // ---- table ----
  std::printf("\n%-56s %8s %8s %8s\n", "measurement", "best", "median", "runs");
  auto row = [](const std::string& name, double best, double median, std::size_t runs) {
    std::printf("%-56s %8.2f %8s %8zu\n", name.c_str(), best, median > 0 ? fmt(median).c_str() : "", runs);
  };
  if (memcpy_multi > 0) {
    row("memcpy, " + std::to_string(cores) + " threads", memcpy_multi, 0, 3);
    row("memcpy, 1 thread", memcpy_single, 0, 3);
  }
  for (const FioVariant& v : kFioVariants) {
    if (!fio.count(v.name)) continue;
    row(fio_variant_title(v), fio[v.name].best(), fio[v.name].median(), fio[v.name].runs.size());
  }
  if (buffered_cold > 0) {
    row("read(), 1 thread, 1 MiB, cold", buffered_cold, 0, 1);
    row("read(), 1 thread, 1 MiB, warm", buffered_warm, 0, 1);
  }
  const std::string cfg = std::to_string(args.load.threads) + " thr, " + size_name(args.load.block_size) + ", direct " +
                          direct_arg_name(args.load.direct);
  if (!cold.empty()) {
    if (cold.runs.front().extra.value("fresh_pool", false)) {
      row("pinload cold, fresh pool (" + cfg + ")", cold.runs.front().gbps, 0, 1);
    }
    if (!cold_reused.empty()) {
      row("pinload cold, re-load (" + cfg + ")", cold_reused.best(), cold_reused.median(), cold_reused.runs.size());
    }
  }
  if (!warm.empty()) row("pinload warm (" + cfg + ")", warm.best(), warm.median(), warm.runs.size());
  for (const auto& [name, series] : warm_forced) {
    row("pinload warm, --cached-read " + name, series.best(), series.median(), series.runs.size());
  }
  if (results.contains("pool_reserve")) {
    const json& pr = results["pool_reserve"];
    row("fresh pool: reserve" + std::string(pr["locked"].get<bool>() ? " + mlock" : "") + " + touch, no I/O",
        pr["gbps"].get<double>(), 0, 1);
  }
  if (device_results) {
    row("pinned copy to " + args.device + ", " + size_name(args.memcpy_bytes),
        device_results->results["pinned_copy_gbps"].get<double>(), 0, 3);
    for (const auto& [name, series] : device_results->rows) row(name, series->best(), series->median(), series->runs.size());
  }
  std::printf("GB/s = 1e9 B/s. cache drop: %s. loadavg at start: %s, at end: %s\n",
              drop_method.empty() ? "none" : drop_method.c_str(),
              out["host"]["loadavg_at_start"].get<std::string>().c_str(),
              out["host"]["loadavg_at_end"].get<std::string>().c_str());
  if (!ratios.empty()) {
    std::printf("ratios:\n");
    for (auto& [k, v] : ratios.items()) {
      const double r = v.get<double>();
      std::printf(r < 0.01 ? "  %-44s %.6f\n" : "  %-44s %6.2f\n", k.c_str(), r);  // the switch ratio is tiny
    }
  }
  if (first) {
    std::printf("re-load after unload: %d re-load(s), %llu new OS reservations (the first load made %llu)\n", reloads,
                static_cast<unsigned long long>(reload_new_reservations),
                static_cast<unsigned long long>(first->extra["new_os_reservations"].get<std::uint64_t>()));
  }
  if (results.contains("pool_memory")) {
    std::printf("pool memory: huge pages %s, %.2f GB reserved, THP-backed delta %.2f GB, explicit huge pages %lld\n",
                huge_pages_name(args.huge_pages), results["pool_memory"]["reserved_bytes"].get<double>() / 1e9,
                results["pool_memory"]["anon_huge_pages_delta_bytes"].get<double>() / 1e9,
                static_cast<long long>(results["pool_memory"]["explicit_huge_pages_used"].get<std::int64_t>()));
  }
  if (!targets.empty()) {
    std::printf("targets:\n");
    for (auto& [k, v] : targets.items()) std::printf("  %-44s %s\n", k.c_str(), v.get<bool>() ? "met" : "MISSED");
  }
  if (results.contains("sweep")) {
    std::printf("\nsweep (GB/s, cold%s):\n%8s", args.sweep_warm ? " / warm" : "", "threads");
    for (std::size_t b : args.sweep_blocks) std::printf(" %14s", size_name(b).c_str());
    std::printf("\n");
    std::size_t i = 0;
    for (unsigned t : args.sweep_threads) {
      std::printf("%8u", t);
      for (std::size_t b = 0; b < args.sweep_blocks.size(); ++b, ++i) {
        const json& p = results["sweep"][i];
        std::string cell = fmt(p["cold"]["best_gbps"].get<double>());
        if (p.contains("warm")) cell += " / " + fmt(p["warm"]["best_gbps"].get<double>());
        std::printf(" %14s", cell.c_str());
      }
      std::printf("\n");
    }
  }
  if (!args.json_out.empty()) {
    std::ofstream f(args.json_out);
    f << out.dump(2) << "\n";
    if (!f) throw std::runtime_error("cannot write " + args.json_out);
    std::printf("\nwrote %s\n", args.json_out.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const UsageError& e) {
    std::cerr << "pinload-bench: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "pinload-bench: " << e.what() << "\n";
    return 1;
  }
}
