#include "remote/object_cache.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>
#include <vector>

#include "base/log.h"
#include "base/sha256.h"
#include "os/read_full.h"
#include "pinload/error.h"

namespace pinload::remote {
namespace fs = std::filesystem;

namespace {

constexpr const char* kDigestSuffix = ".sha256";
constexpr std::string_view kPartMark = ".part-";
// A digest file without its entry is left alone this long: the entry is
// renamed into place just after its digests (Note [Remote cache]).
constexpr auto kOrphanGrace = std::chrono::seconds(60);

// write_full (os/read_full.h); false with errno set.
bool pwrite_all(Env* env, int fd, const std::byte* data, std::uint64_t bytes, std::uint64_t offset) {
  const WriteResult r = write_full(env, fd, data, bytes, offset);
  errno = r.error;
  return r.error == 0;
}

// The Env's 0-or-minus-errno as a bool with errno set.
bool ok(int rc) {
  errno = -rc;
  return rc == 0;
}

int flock_retry(int fd, int op) {
  int rc;
  do {
    rc = ::flock(fd, op);
  } while (rc != 0 && errno == EINTR);
  return rc;
}

// A new "<final>.part-<pid>-<n>", open read-write and flock'ed (Note [Remote
// cache]); -1 with errno. A sweeper may take the lock of a file just created
// and remove it before this process locks it: a file with no name left is
// dropped and another made.
int create_locked_part(Env* env, const std::string& final_path, std::string* part) {
  // No thread_local engine: the Python module has little static TLS to spare.
  static std::atomic<std::uint64_t> serial{0};
  for (int attempt = 0; attempt < 16; ++attempt) {
    *part = final_path + std::string(kPartMark) + std::to_string(::getpid()) + "-" + std::to_string(serial++);
    const int fd = env->open_write(*part, O_RDWR | O_CREAT | O_EXCL, 0644);
    if (fd < 0) {
      if (fd == -EEXIST) continue;
      errno = -fd;
      return -1;
    }
    struct stat st {};
    if (flock_retry(fd, LOCK_EX) != 0 || ::fstat(fd, &st) != 0) {
      const int err = errno;
      env->close(fd);
      env->remove(*part);
      errno = err;
      return -1;
    }
    if (st.st_nlink > 0) return fd;
    env->close(fd);  // swept before it was locked
  }
  errno = EEXIST;
  return -1;
}

using Digest = std::array<unsigned char, 32>;

// SHA-256 (OpenSSL) of each kPieceBytes piece of `fd`'s first `size` bytes,
// hashed by up to 16 threads; empty on a read error (errno set).
std::vector<std::string> hash_pieces(Env* env, int fd, std::uint64_t size) {
  const std::uint64_t piece = ObjectCache::kPieceBytes;
  const std::uint64_t pieces = std::max<std::uint64_t>(1, (size + piece - 1) / piece);
  std::vector<std::string> out(pieces);
  std::atomic<std::uint64_t> next{0};
  std::atomic<int> failed{0};
  env->fadvise(fd, 0, size, POSIX_FADV_SEQUENTIAL);
  auto work = [&] {
    std::vector<std::byte> buffer(4 << 20);
    EVP_MD_CTX* ctx = EVP_MD_CTX_new();
    while (ctx != nullptr && failed.load() == 0) {
      const std::uint64_t i = next.fetch_add(1);
      if (i >= pieces) break;
      const std::uint64_t begin = i * piece, end = std::min(size, begin + piece);
      if (EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) != 1) break;
      for (std::uint64_t at = begin; at < end;) {
        const std::uint64_t want = std::min<std::uint64_t>(buffer.size(), end - at);
        const ReadResult r = read_full(env, fd, buffer.data(), want, at);
        if (r.error != 0 || r.bytes < want) {
          failed.store(r.error != 0 ? r.error : EIO);
          break;
        }
        EVP_DigestUpdate(ctx, buffer.data(), static_cast<std::size_t>(want));
        at += want;
      }
      Digest d{};
      unsigned len = 0;
      if (failed.load() == 0 && EVP_DigestFinal_ex(ctx, d.data(), &len) == 1) out[i] = detail::hex_digest(d.data(), len);
    }
    if (ctx == nullptr) failed.store(ENOMEM);
    EVP_MD_CTX_free(ctx);
  };
  const unsigned threads = static_cast<unsigned>(
      std::min<std::uint64_t>({pieces, std::max(1u, std::thread::hardware_concurrency()), 16}));
  std::vector<std::thread> pool;
  for (unsigned i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (failed.load() != 0 || std::any_of(out.begin(), out.end(), [](const std::string& d) { return d.empty(); })) {
    errno = failed.load() != 0 ? failed.load() : EIO;
    return {};
  }
  return out;
}

// The digest file: "pinload-cache sha256 <piece bytes> <size>" then one
// digest a line.
std::string digest_text(const std::vector<std::string>& digests, std::uint64_t size) {
  std::string text = "pinload-cache sha256 " + std::to_string(ObjectCache::kPieceBytes) + " " + std::to_string(size) + "\n";
  for (const std::string& d : digests) text += d + "\n";
  return text;
}

}  // namespace

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

void ObjectCache::drop(const std::string& entry) const {
  ::unlink(entry.c_str());
  ::unlink((entry + kDigestSuffix).c_str());
}

std::string ObjectCache::lookup(const ObjectInfo& object, Env* env) const {
  if (object.etag.empty()) return {};  // no version to check against
  const std::string path = key_path(object);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || static_cast<std::uint64_t>(st.st_size) != object.size) return {};
  const std::string shown = display_url(object.path);
  std::ifstream in(path + kDigestSuffix);
  std::stringstream recorded;
  recorded << in.rdbuf();
  const int fd = env->open_read(path, 0);
  if (fd < 0) return {};
  const std::vector<std::string> digests = hash_pieces(env, fd, object.size);
  const int err = errno;
  env->close(fd);
  if (digests.empty()) {
    log::warn("remote cache: cannot read {} ({}); reading {} from the server", path, std::strerror(err), shown);
    return {};
  }
  const std::string expected = recorded.str();
  if (digest_text(digests, object.size) != expected) {
    // Which piece, for the message.
    std::string where = "no digests recorded";
    const std::size_t line_end = expected.find('\n');
    if (line_end != std::string::npos) {
      std::istringstream lines(expected.substr(line_end + 1));
      std::string line;
      where = "its digests do not parse";
      for (std::size_t i = 0; i < digests.size() && std::getline(lines, line); ++i) {
        if (line != digests[i]) {
          where = "bytes [" + std::to_string(i * kPieceBytes) + ", " +
                  std::to_string(std::min(object.size, (i + 1) * kPieceBytes)) +
                  ") differ from the SHA-256 recorded when it was written";
          break;
        }
      }
    }
    log::warn("remote cache: {} (of {}): {}; dropping it and reading from the server", path, shown, where);
    drop(path);
    return {};
  }
  ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0);  // most recently used (Note [OS calls outside the Env])
  log::debug("{}: from the local cache {} (SHA-256 verified)", shown, path);
  return path;
}

std::unique_ptr<ObjectCache::Writer> ObjectCache::begin(const ObjectInfo& object, std::uint64_t first,
                                                       Env* env) const {
  if (object.etag.empty() || object.size == 0) return nullptr;
  sweep();
  const std::string final_path = key_path(object);
  std::string part;
  const int fd = create_locked_part(env, final_path, &part);
  if (fd < 0) {
    log::warn("remote cache: cannot create {}: {}; not caching", part, std::strerror(errno));
    return nullptr;
  }
  if (!ok(env->truncate(fd, object.size))) {
    log::warn("remote cache: cannot size {}: {}; not caching", part, std::strerror(errno));
    env->remove(part);
    env->close(fd);
    return nullptr;
  }
  return std::unique_ptr<Writer>(new Writer(this, env, object, first, part, final_path, fd));
}

ObjectCache::Writer::Writer(const ObjectCache* cache, Env* env, ObjectInfo object, std::uint64_t first,
                            std::string part, std::string final_path, int fd)
    : cache_(cache), env_(env), object_(std::move(object)), first_(first), part_(std::move(part)),
      final_(std::move(final_path)), fd_(fd) {}

ObjectCache::Writer::~Writer() {
  if (!committed_) env_->remove(part_);  // under the lock: no sweeper races it
  env_->close(fd_);
}

void ObjectCache::Writer::write(std::uint64_t offset, const std::byte* data, std::uint64_t bytes,
                                const ReadHead& read_head) {
  if (failed_.load(std::memory_order_relaxed)) return;
  if (!pwrite_all(env_, fd_, data, bytes, offset)) {
    if (!failed_.exchange(true)) log::warn("remote cache: cannot write {}: {}; not caching", part_, std::strerror(errno));
    return;
  }
  const std::uint64_t total = arrived_.fetch_add(bytes, std::memory_order_acq_rel) + bytes;
  if (total == object_.size - first_) commit(read_head);  // the last range: one caller only
}

void ObjectCache::Writer::commit(const ReadHead& read_head) {
  try {
    std::vector<std::byte> head(first_);
    if (first_ > 0) read_head(0, first_, head.data());
    if (!pwrite_all(env_, fd_, head.data(), head.size(), 0) || !ok(env_->sync(fd_))) {
      log::warn("remote cache: cannot finish {}: {}", part_, std::strerror(errno));
      return;
    }
    // The digests of what is on disk now (in the page cache: just written).
    const std::vector<std::string> digests = hash_pieces(env_, fd_, object_.size);
    if (digests.empty()) {
      log::warn("remote cache: cannot read back {}: {}", part_, std::strerror(errno));
      return;
    }
    std::string digest_part;
    const int dfd = create_locked_part(env_, final_ + kDigestSuffix, &digest_part);
    if (dfd < 0) {
      log::warn("remote cache: cannot record the digests of {}: {}", part_, std::strerror(errno));
      return;
    }
    const std::string text = digest_text(digests, object_.size);
    const bool written = pwrite_all(env_, dfd, reinterpret_cast<const std::byte*>(text.data()), text.size(), 0) &&
                         ok(env_->sync(dfd)) && ok(env_->rename(digest_part, final_ + kDigestSuffix));
    const int err = errno;
    if (!written) env_->remove(digest_part);
    env_->close(dfd);
    if (!written) {
      log::warn("remote cache: cannot record the digests of {}: {}", part_, std::strerror(err));
      return;
    }
    if (!ok(env_->rename(part_, final_))) {
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

std::uint64_t ObjectCache::sweep() const {
  std::uint64_t live = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string path = e.path().string();
    if (e.path().filename().string().find(kPartMark) == std::string::npos) continue;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;
    struct stat held {}, named {};
    if (::fstat(fd, &held) == 0 && S_ISREG(held.st_mode)) {
      if (flock_retry(fd, LOCK_EX | LOCK_NB) == 0) {
        // Its writer is gone (a lock dies with its process): a leftover.
        if (::stat(path.c_str(), &named) == 0 && named.st_ino == held.st_ino && named.st_dev == held.st_dev &&
            ::unlink(path.c_str()) == 0) {
          log::info("remote cache: removed {} ({} bytes), left by a writer that died", path,
                    static_cast<std::uint64_t>(held.st_blocks) * 512);
        }
      } else {
        live += static_cast<std::uint64_t>(held.st_blocks) * 512;
      }
    }
    ::close(fd);
  }
  return live;
}

void ObjectCache::evict(const std::string& keep) const {
  const std::uint64_t live_parts = sweep();
  struct Entry {
    fs::file_time_type used;
    std::uint64_t bytes;
    std::string path;
  };
  std::vector<Entry> entries;
  std::uint64_t total = live_parts;
  std::error_code ec;
  const auto now = fs::file_time_type::clock::now();
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file(ec)) continue;
    if (name.ends_with(std::string(".safetensors") + kDigestSuffix)) {
      const std::string entry = e.path().string().substr(0, e.path().string().size() - std::strlen(kDigestSuffix));
      if (!fs::exists(entry, ec) && now - e.last_write_time(ec) > kOrphanGrace) fs::remove(e.path(), ec);
      continue;
    }
    if (!name.ends_with(".safetensors")) continue;
    const std::uint64_t bytes = e.file_size(ec);
    entries.push_back({e.last_write_time(ec), bytes, e.path().string()});
    total += bytes;
  }
  if (budget_ == 0) return;
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.used < b.used; });
  for (const Entry& e : entries) {
    if (total <= budget_) break;
    if (e.path == keep) continue;
    if (fs::remove(e.path, ec)) {
      fs::remove(e.path + kDigestSuffix, ec);
      total -= e.bytes;
      log::debug("remote cache: evicted {}", e.path);
    }
  }
}

}  // namespace pinload::remote
