#include "trace/pre_content.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/fanotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <linux/fanotify.h>
#include <thread>
#include <unordered_map>

namespace pinload::trace {

namespace {

// Linux 6.14's uapi, absent from older headers (glibc's and the distribution's).
#ifndef FAN_PRE_ACCESS
constexpr std::uint64_t kFanPreAccess = 0x00100000;
#else
constexpr std::uint64_t kFanPreAccess = FAN_PRE_ACCESS;
#endif
#ifndef FAN_EVENT_INFO_TYPE_RANGE
constexpr std::uint8_t kInfoTypeRange = 6;
#else
constexpr std::uint8_t kInfoTypeRange = FAN_EVENT_INFO_TYPE_RANGE;
#endif

struct RangeInfo {  // struct fanotify_event_info_range
  fanotify_event_info_header hdr;
  std::uint32_t pad;
  std::uint64_t offset;
  std::uint64_t count;
};

#if defined(__x86_64__)
constexpr long kSysMmap = 9;
#elif defined(__aarch64__)
constexpr long kSysMmap = 222;
#else
constexpr long kSysMmap = kSyscallUnknown - 1;  // matches no thread
#endif

// Thread `tid`'s process id and command name, from the head of
// /proc/<tid>/status ("Name:\t...\n...Tgid:\t...\n"), one read(2); the
// process id is tid itself and the name "" if the thread is gone.
void describe_thread(pid_t tid, ReadEvent* e) {
  e->pid = tid;
  char path[64], text[1024];
  std::snprintf(path, sizeof path, "/proc/%d/status", tid);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  const ssize_t n = ::read(fd, text, sizeof text - 1);
  ::close(fd);
  if (n <= 0) return;
  const std::string_view status(text, static_cast<std::size_t>(n));
  auto field = [&](std::string_view key) -> std::string_view {
    std::size_t at = status.starts_with(key) ? 0 : status.find("\n" + std::string(key));
    if (at == std::string_view::npos) return {};
    at = status.find(':', at) + 1;
    while (at < status.size() && (status[at] == '\t' || status[at] == ' ')) ++at;
    const std::size_t end = status.find('\n', at);
    return end == std::string_view::npos ? std::string_view{} : status.substr(at, end - at);
  };
  // The kernel escapes a newline in the name as "\n" here, so a name can't forge a field.
  e->comm = std::string(field("Name:"));
  const std::string tgid(field("Tgid:"));
  if (!tgid.empty()) e->pid = static_cast<pid_t>(std::strtol(tgid.c_str(), nullptr, 10));
  char link[64], target[4096];
  std::snprintf(link, sizeof link, "/proc/%d/exe", tid);
  const ssize_t len = ::readlink(link, target, sizeof target);
  if (len > 0) e->exe.assign(target, static_cast<std::size_t>(len));
}

}  // namespace

long blocked_syscall(pid_t tid) {
  char path[64], text[64];
  std::snprintf(path, sizeof path, "/proc/%d/syscall", tid);
  // "running" while the thread is on a CPU. A reader queues its event before
  // it sleeps until the answer, so the listener can look in between: ask
  // again (read as a number, "running" would be 0, read(2) on x86-64).
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kSyscallUnknown;
    const ssize_t n = ::read(fd, text, sizeof text - 1);
    ::close(fd);
    if (n <= 0) return kSyscallUnknown;
    text[n] = '\0';
    char* end = nullptr;
    const long number = std::strtol(text, &end, 10);
    if (end != text) return number;
    if (std::strncmp(text, "running", 7) != 0) return kSyscallUnknown;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return kSyscallUnknown;
}

std::unique_ptr<PreContentListener> PreContentListener::open(std::string* why) {
  const int group = ::fanotify_init(FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK | FAN_UNLIMITED_QUEUE | FAN_REPORT_TID,
                                    O_RDONLY | O_LARGEFILE | O_CLOEXEC);
  if (group < 0) {
    const int e = errno;
    if (why) {
      *why = std::string("fanotify_init(FAN_CLASS_PRE_CONTENT) failed: ") + std::strerror(e) +
             (e == EPERM ? " (needs CAP_SYS_ADMIN)" : "");
    }
    return nullptr;
  }
  return std::unique_ptr<PreContentListener>(new PreContentListener(group));
}

PreContentListener::~PreContentListener() { ::close(group_); }

int PreContentListener::mark_directory(const std::string& dir) {
  if (::fanotify_mark(group_, FAN_MARK_ADD | FAN_MARK_ONLYDIR | FAN_MARK_DONT_FOLLOW, kFanPreAccess | FAN_EVENT_ON_CHILD,
                      AT_FDCWD, dir.c_str()) < 0) {
    return -errno;
  }
  return 0;
}

int PreContentListener::mark_tree(const std::string& root, std::vector<std::string>* marked) {
  namespace fs = std::filesystem;
  int count = 0;
  auto mark_one = [&](const fs::path& p) -> int {
    const std::string s = p.lexically_normal().string();
    for (const std::string& m : *marked) {
      if (m == s) return 0;
    }
    const int rc = mark_directory(s);
    if (rc < 0) return rc;
    marked->push_back(s);
    ++count;
    return 0;
  };
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(root, ec))) return -ENOTDIR;
  if (int rc = mark_one(root); rc < 0) return rc;
  // The default options never follow a directory symlink.
  for (fs::recursive_directory_iterator it(root, fs::directory_options::skip_permission_denied, ec), end;
       !ec && it != end; it.increment(ec)) {
    if (it->is_directory(ec) && !it->is_symlink(ec)) {
      if (int rc = mark_one(it->path()); rc < 0) return rc;
    }
  }
  return count;
}

int PreContentListener::poll(int timeout_ms, const std::function<void(const ReadEvent&)>& on_read) {
  pollfd p{group_, POLLIN, 0};
  const int ready = ::poll(&p, 1, timeout_ms);
  if (ready < 0) return -errno;
  if (ready == 0) return 0;
  alignas(fanotify_event_metadata) char buffer[64 << 10];
  const ssize_t n = ::read(group_, buffer, sizeof buffer);
  if (n < 0) return errno == EAGAIN ? 0 : -errno;
  int events = 0;
  auto* meta = reinterpret_cast<fanotify_event_metadata*>(buffer);
  ssize_t left = n;
  // First allow every event of the batch (Note [Pre-content events]), each
  // once its system call is known (Note [Mapped or read]), then look at
  // them: the readers run while the callback records.
  std::vector<ReadEvent> described;
  for (auto* m = meta; FAN_EVENT_OK(m, left); m = FAN_EVENT_NEXT(m, left)) {
    ReadEvent& d = described.emplace_back();
    if (m->fd >= 0) {
      d.tid = m->pid;
      const long call = blocked_syscall(m->pid);
      d.mapped = call == kSysMmap || call == kOutsideSyscalls;
      // Note [Naming the reader]: before the allow. Consecutive events of one
      // thread (a batch of one reader's reads) are named once.
      if (described.size() >= 2 && described[described.size() - 2].tid == d.tid) {
        const ReadEvent& prev = described[described.size() - 2];
        d.pid = prev.pid, d.comm = prev.comm, d.exe = prev.exe;
      } else {
        describe_thread(m->pid, &d);
      }
      fanotify_response response{m->fd, FAN_ALLOW};
      (void)!::write(group_, &response, sizeof response);
    }
  }
  left = n;
  std::size_t index = 0;
  for (auto* m = meta; FAN_EVENT_OK(m, left); m = FAN_EVENT_NEXT(m, left), ++index) {
    ++events;
    if (m->fd < 0) continue;  // FAN_NOFD: a queue overflow
    ReadEvent& e = described[index];
    e.fd = m->fd;
    bool has_range = false;
    const char* info = reinterpret_cast<const char*>(m) + m->metadata_len;
    const char* end = reinterpret_cast<const char*>(m) + m->event_len;
    while (info + sizeof(fanotify_event_info_header) <= end) {
      const auto* h = reinterpret_cast<const fanotify_event_info_header*>(info);
      if (h->len == 0 || info + h->len > end) break;
      if (h->info_type == kInfoTypeRange && h->len >= sizeof(RangeInfo)) {
        RangeInfo r;
        std::memcpy(&r, info, sizeof r);
        e.offset = r.offset;
        e.length = r.count;
        has_range = true;
      }
      info += h->len;
    }
    if (has_range && e.length > 0) on_read(e);
    ::close(m->fd);
  }
  return events;
}

std::string pre_content_unavailable_reason(const std::string& dir) {
  std::string why;
  std::unique_ptr<PreContentListener> listener = PreContentListener::open(&why);
  if (!listener) return why;
  const int rc = listener->mark_directory(dir);
  if (rc == -EINVAL) return "fanotify_mark(FAN_PRE_ACCESS) refused: the kernel lacks pre-content events (Linux >= 6.14)";
  if (rc == -EOPNOTSUPP) return "the filesystem of " + dir + " does not report pre-content events";
  if (rc < 0) return "fanotify_mark(FAN_PRE_ACCESS) on " + dir + " failed: " + std::strerror(-rc);
  return "";
}

std::string path_of_fd(int fd) {
  char link[64];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  char target[4096];
  const ssize_t n = ::readlink(link, target, sizeof target - 1);
  if (n <= 0) return "";
  return std::string(target, static_cast<std::size_t>(n));
}

std::string canonical_root(const std::string& root) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::weakly_canonical(root, ec);
  return ec ? std::filesystem::absolute(root).lexically_normal().string() : p.string();
}

bool path_is_under(const std::string& path, const std::string& root) {
  if (root.empty()) return false;
  std::string r = root;
  while (r.size() > 1 && r.back() == '/') r.pop_back();
  if (path.compare(0, r.size(), r) != 0) return false;
  return path.size() == r.size() || r == "/" || path[r.size()] == '/';
}

bool is_descendant(pid_t pid, pid_t ancestor) {
  for (int depth = 0; depth < 64 && pid > 1; ++depth) {
    if (pid == ancestor) return true;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return false;
    // pid (comm) state ppid ...: comm may hold spaces and parentheses.
    const std::size_t close = line.rfind(')');
    if (close == std::string::npos) return false;
    char state = 0;
    int ppid = 0;
    if (std::sscanf(line.c_str() + close + 1, " %c %d", &state, &ppid) != 2) return false;
    pid = ppid;
  }
  return pid == ancestor;
}

}  // namespace pinload::trace
