// bench/system_probe.cc: see system_probe.h.
#include "system_probe.h"

#include <fcntl.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "pinload/env.h"
#include "pinload/pool.h"

namespace pinload::bench {
namespace {

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

bool write_nr_hugepages(const std::string& value) {
  std::ofstream f("/proc/sys/vm/nr_hugepages");
  f << value << "\n";
  f.flush();
  return static_cast<bool>(f);
}

}  // namespace

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

bool HugeTlbReservation::set(long pages, json* report) {
  const std::string before = read_first_line("/proc/sys/vm/nr_hugepages");
  (*report)["nr_hugepages_before"] = before;
  (*report)["requested"] = pages;
  if (::geteuid() != 0) {
    (*report)["error"] = "not root";
    return false;
  }
  if (!write_nr_hugepages(std::to_string(pages))) {
    (*report)["error"] = "cannot write /proc/sys/vm/nr_hugepages";
    return false;
  }
  saved_ = before;
  (*report)["got"] = read_first_line("/proc/sys/vm/nr_hugepages");
  return true;
}

HugeTlbReservation::~HugeTlbReservation() {
  if (!saved_.empty()) write_nr_hugepages(saved_);
}

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

FirstTouch fresh_pool_first_touch(const pinload::LockedMemoryOptions& memory,
                                  const std::vector<std::uint64_t>& sizes) {
  auto fresh = pinload::Pool::create(pinload::make_locked_memory_backend(pinload::default_env(), memory));
  std::vector<std::shared_ptr<pinload::Block>> blocks;
  FirstTouch out;
  const auto t0 = Clock::now();
  for (std::uint64_t sz : sizes) blocks.push_back(fresh->allocate((sz + 2 * 4096 - 1) / 4096 * 4096));
  out.reserve_seconds = seconds_since(t0);
  const auto t1 = Clock::now();
  for (auto& b : blocks) {
    for (std::size_t i = 0; i < b->size(); i += 4096) b->data()[i] = std::byte{1};
  }
  out.first_touch_seconds = seconds_since(t1);
  const auto st = fresh->stats();
  out.reserved_bytes = st.reserved_bytes;
  out.os_reservations = st.os_reservations;
  out.locked = !blocks.empty() && blocks.front()->locked();
  return out;
}

}  // namespace pinload::bench
