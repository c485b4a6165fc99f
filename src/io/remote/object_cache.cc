#include "io/remote/object_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <vector>

#include "base/log.h"
#include "pinload/error.h"

namespace pinload::remote {
namespace fs = std::filesystem;

ObjectCache::ObjectCache(std::string dir, std::uint64_t budget_bytes) : dir_(std::move(dir)), budget_(budget_bytes) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) log::warn("remote cache {}: cannot create ({}); not caching", dir_, ec.message());
}

std::string ObjectCache::key_path(const ObjectInfo& object) const {
  const std::size_t h = std::hash<std::string>{}(object.path + '\n' + object.etag + '\n' + std::to_string(object.size));
  char name[64];
  std::snprintf(name, sizeof name, "%016zx-%llu.safetensors", h, static_cast<unsigned long long>(object.size));
  return (fs::path(dir_) / name).string();
}

std::string ObjectCache::lookup(const ObjectInfo& object) const {
  if (object.etag.empty()) return {};  // no version to check against
  const std::string path = key_path(object);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || static_cast<std::uint64_t>(st.st_size) != object.size) return {};
  ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0);  // most recently used
  log::debug("{}: from the local cache {}", display_url(object.path), path);
  return path;
}

std::unique_ptr<ObjectCache::Writer> ObjectCache::begin(const ObjectInfo& object, std::uint64_t first) const {
  if (object.etag.empty() || object.size == 0) return nullptr;
  const std::string final_path = key_path(object);
  // No thread_local engine: the Python module has little static TLS to spare.
  static std::atomic<std::uint64_t> serial{0};
  const std::string part = final_path + ".part-" + std::to_string(::getpid()) + "-" + std::to_string(serial++);
  const int fd = ::open(part.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    log::warn("remote cache: cannot create {}: {}; not caching", part, std::strerror(errno));
    return nullptr;
  }
  if (::ftruncate(fd, static_cast<off_t>(object.size)) != 0) {
    log::warn("remote cache: cannot size {}: {}; not caching", part, std::strerror(errno));
    ::close(fd);
    ::unlink(part.c_str());
    return nullptr;
  }
  return std::unique_ptr<Writer>(new Writer(this, object, first, part, final_path, fd));
}

ObjectCache::Writer::Writer(const ObjectCache* cache, ObjectInfo object, std::uint64_t first, std::string part,
                            std::string final_path, int fd)
    : cache_(cache), object_(std::move(object)), first_(first), part_(std::move(part)), final_(std::move(final_path)),
      fd_(fd) {}

ObjectCache::Writer::~Writer() {
  ::close(fd_);
  if (!committed_) ::unlink(part_.c_str());
}

namespace {
bool pwrite_all(int fd, const std::byte* data, std::uint64_t bytes, std::uint64_t offset) {
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, data, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    bytes -= static_cast<std::uint64_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
  return true;
}
}  // namespace

void ObjectCache::Writer::write(std::uint64_t offset, const std::byte* data, std::uint64_t bytes, RemoteClient& client) {
  if (failed_.load(std::memory_order_relaxed)) return;
  if (!pwrite_all(fd_, data, bytes, offset)) {
    if (!failed_.exchange(true)) log::warn("remote cache: cannot write {}: {}; not caching", part_, std::strerror(errno));
    return;
  }
  const std::uint64_t total = arrived_.fetch_add(bytes, std::memory_order_acq_rel) + bytes;
  if (total == object_.size - first_) commit(client);  // the last range: one caller only
}

void ObjectCache::Writer::commit(RemoteClient& client) {
  try {
    std::vector<std::byte> head(first_);
    if (first_ > 0) client.read(object_, 0, first_, head.data());
    if (!pwrite_all(fd_, head.data(), head.size(), 0) || ::fsync(fd_) != 0) {
      log::warn("remote cache: cannot finish {}: {}", part_, std::strerror(errno));
      return;
    }
    if (::rename(part_.c_str(), final_.c_str()) != 0) {
      log::warn("remote cache: cannot rename {}: {}", part_, std::strerror(errno));
      return;
    }
    committed_ = true;
    log::debug("{}: cached as {}", display_url(object_.path), final_);
    cache_->evict(final_);
  } catch (const std::exception& e) {
    log::warn("remote cache: not caching {}: {}", display_url(object_.path), e.what());
  }
}

void ObjectCache::evict(const std::string& keep) const {
  if (budget_ == 0) return;
  struct Entry {
    fs::file_time_type used;
    std::uint64_t bytes;
    std::string path;
  };
  std::vector<Entry> entries;
  std::uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.ends_with(".safetensors") || !e.is_regular_file(ec)) continue;
    const std::uint64_t bytes = e.file_size(ec);
    entries.push_back({e.last_write_time(ec), bytes, e.path().string()});
    total += bytes;
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.used < b.used; });
  for (const Entry& e : entries) {
    if (total <= budget_) break;
    if (e.path == keep) continue;
    if (fs::remove(e.path, ec)) {
      total -= e.bytes;
      log::debug("remote cache: evicted {}", e.path);
    }
  }
}

}  // namespace pinload::remote
