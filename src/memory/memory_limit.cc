#include "pinload/memory_limit.h"

#include <charconv>
#include <string_view>
#include <vector>

#include "os/read_full.h"

namespace pinload {
namespace {

// The whole of a small file (proc and sysfs files stat as 0 bytes, so read
// to the end); nullopt where it cannot be read.
std::optional<std::string> read_text(Env* env, const std::string& path) {
  const int fd = env->open_read(path, 0);
  if (fd < 0) return std::nullopt;
  ScopedFd closer(env, fd);
  std::string text;
  char buffer[4096];
  for (;;) {
    const ReadResult r = read_full(env, fd, buffer, sizeof buffer, text.size());
    if (r.error != 0) return std::nullopt;
    text.append(buffer, static_cast<std::size_t>(r.bytes));
    if (text.size() > (1u << 20)) return std::nullopt;
    if (r.ended) return text;
  }
}

std::optional<std::uint64_t> parse_u64(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  std::uint64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::optional<std::uint64_t> read_u64(Env* env, const std::string& path) {
  const std::optional<std::string> text = read_text(env, path);
  return text ? parse_u64(*text) : std::nullopt;
}

// The value of `key` in a "key value" file (memory.stat) or "Key: value kB"
// (meminfo, scaled by `unit`).
std::optional<std::uint64_t> field(const std::string& text, std::string_view key, std::uint64_t unit = 1) {
  std::size_t at = 0;
  while (at < text.size()) {
    std::size_t eol = text.find('\n', at);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + at, eol - at);
    at = eol + 1;
    if (line.size() <= key.size() || line.substr(0, key.size()) != key) continue;
    std::string_view rest = line.substr(key.size());
    if (rest[0] != ' ' && rest[0] != ':') continue;
    rest.remove_prefix(1);
    while (!rest.empty() && rest[0] == ' ') rest.remove_prefix(1);
    if (const auto space = rest.find(' '); space != std::string_view::npos) rest = rest.substr(0, space);
    if (const std::optional<std::uint64_t> v = parse_u64(rest)) return *v * unit;
  }
  return std::nullopt;
}

// "/a/b" -> {"/a/b", "/a", ""}: a cgroup and its ancestors below the mount.
std::vector<std::string> self_and_ancestors(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  if (path == "/") path.clear();
  std::vector<std::string> out;
  for (;;) {
    out.push_back(path);
    if (path.empty()) return out;
    path.resize(path.rfind('/'));
  }
}

// Limits above this mean "none" (v1 writes LONG_MAX rounded to a page).
constexpr std::uint64_t kNoLimit = 1ull << 62;

void consider(std::optional<HostMemoryLimit>* best, std::uint64_t available, std::string source) {
  if (!*best || available < (*best)->available_bytes) *best = HostMemoryLimit{available, std::move(source)};
}

// One cgroup directory: its limit less its usage other than page cache.
void consider_cgroup(Env* env, const std::string& dir, bool v2, std::optional<HostMemoryLimit>* best) {
  std::optional<std::uint64_t> limit;
  if (v2) {
    const std::optional<std::string> text = read_text(env, dir + "/memory.max");
    if (!text || text->rfind("max", 0) == 0) return;
    limit = parse_u64(*text);
  } else {
    limit = read_u64(env, dir + "/memory.limit_in_bytes");
  }
  if (!limit || *limit >= kNoLimit) return;
  const std::optional<std::uint64_t> usage = read_u64(env, dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"));
  std::uint64_t cache = 0;
  if (const std::optional<std::string> stat = read_text(env, dir + "/memory.stat")) {
    cache = field(*stat, v2 ? "file" : "total_cache").value_or(field(*stat, "cache").value_or(0));
  }
  const std::uint64_t used = usage ? (*usage > cache ? *usage - cache : 0) : 0;
  const std::uint64_t available = *limit > used ? *limit - used : 0;
  consider(best, available,
           std::string(v2 ? "cgroup v2 memory.max " : "cgroup v1 memory.limit_in_bytes ") + std::to_string(*limit) +
               " at " + dir + ", of which " + std::to_string(used) + " bytes in use besides page cache");
}

}  // namespace

std::optional<HostMemoryLimit> read_host_memory_limit(Env* env, const std::string& root) {
  std::optional<HostMemoryLimit> best;
  if (const std::optional<std::string> meminfo = read_text(env, root + "/proc/meminfo")) {
    if (const std::optional<std::uint64_t> available = field(*meminfo, "MemAvailable", 1024)) {
      consider(&best, *available, "/proc/meminfo MemAvailable");
    }
  }
  const std::optional<std::string> cgroups = read_text(env, root + "/proc/self/cgroup");
  if (!cgroups) return best;
  // Lines "id:controllers:path": v2 is "0::path", v1 names "memory" among its controllers.
  std::size_t at = 0;
  while (at < cgroups->size()) {
    std::size_t eol = cgroups->find('\n', at);
    if (eol == std::string::npos) eol = cgroups->size();
    const std::string line = cgroups->substr(at, eol - at);
    at = eol + 1;
    const auto first = line.find(':');
    const auto second = first == std::string::npos ? std::string::npos : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    bool v1_memory = false;
    for (std::size_t c = 0; c <= controllers.size();) {
      std::size_t comma = controllers.find(',', c);
      if (comma == std::string::npos) comma = controllers.size();
      if (controllers.compare(c, comma - c, "memory") == 0) v1_memory = true;
      c = comma + 1;
    }
    const bool v2 = controllers.empty() && line.compare(0, first, "0") == 0;
    if (!v2 && !v1_memory) continue;
    const std::string mount = root + (v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory");
    // In a container the path may name a cgroup outside its view: the
    // ancestors that do not exist are skipped, the mount itself is the last.
    for (const std::string& dir : self_and_ancestors(path)) consider_cgroup(env, mount + dir, v2, &best);
  }
  return best;
}

}  // namespace pinload
