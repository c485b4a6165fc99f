#include "pinload/byte_source.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <cerrno>

#include "base/log.h"
#include "os/read_full.h"
#include "pinload/error.h"
#include "remote/remote_url.h"
#include "source/mapped_copy.h"
#include "source/sources.h"

namespace pinload {

namespace detail {

bool on_network_filesystem(Env* env, int fd, const std::string& path) {
  std::int64_t magic = 0;
  if (env->filesystem_type(fd, &magic) != 0) return false;
  constexpr std::int64_t kNfs = 0x6969, kSmb = 0x517B, kCifs = 0xFF534D42, kSmb2 = 0xFE534D42, kFuse = 0x65735546,
                         kCeph = 0x00C36400, kLustre = 0x0BD00BD0;
  const bool network = magic == kNfs || magic == kSmb || magic == kCifs || magic == kSmb2 || magic == kFuse ||
                       magic == kCeph || magic == kLustre;
  if (network) log::debug("{}: on a network filesystem (f_type {:#x}): buffered reads, one reader per connection", path, magic);
  return network;
}

// ---- a local file ----

LocalFileSource::LocalFileSource(Env* env, std::string path, const FileIdentity* expected, const SourceOptions& options,
                                 int borrowed_fd)
    : env_(env),
      path_(std::move(path)),
      has_expected_(expected != nullptr),
      expected_(expected != nullptr ? *expected : FileIdentity{}),
      options_(options),
      borrowed_fd_(borrowed_fd) {}

LocalFileSource::~LocalFileSource() { close(); }

void LocalFileSource::probe_filesystem() {
  FileStat st;
  const ScopedFd fd = open_regular_or_throw(env_, path_, &st);
  if (has_expected_) check_identity(st, path_, expected_);
  network_fs_ = on_network_filesystem(env_, fd.get(), path_);
  probed_ = true;
}

void LocalFileSource::open() {
  if (open_.load(std::memory_order_acquire)) return;
  std::lock_guard lock(mu_);
  if (open_.load(std::memory_order_relaxed)) return;
  try {
    open_locked();
  } catch (...) {
    unmap();
    direct_fd_.reset();
    buffered_.reset();
    throw;
  }
  open_.store(true, std::memory_order_release);
}

void LocalFileSource::close() {
  std::lock_guard lock(mu_);
  unmap();
  direct_fd_.reset();
  buffered_.reset();
  direct_.store(false, std::memory_order_relaxed);
  open_.store(false, std::memory_order_release);
}

void LocalFileSource::unmap() {
  if (const std::byte* m = mapping_.exchange(nullptr); m != nullptr) env_->unmap(const_cast<std::byte*>(m), mapping_bytes_);
}

// Maps a file in the page cache for copying (Note [Mapped reads] in
// loader.h); where the mapping is refused, the file is pread.
void LocalFileSource::map() {
  if (stat_.size == 0) return;
  int err = 0;
  const void* data = env_->map_file(buffered_descriptor(), stat_.size, &err);
  if (data == nullptr) {
    log::debug("{}: cannot map ({}), reading with pread", path_, log::errno_text(err));
    return;
  }
  mapping_bytes_ = stat_.size;
  mapping_.store(static_cast<const std::byte*>(data), std::memory_order_release);
}

// Opens the file and decides direct or buffered (Note [Direct I/O] in
// loader.h): the residency decides under kAuto, and whether a buffered file
// is mapped (unless kPread).
void LocalFileSource::open_locked() {
  if (borrowed_fd_ >= 0) {
    stat_ = stat_regular_or_throw(env_, borrowed_fd_, path_);
  } else {
    buffered_ = open_regular_or_throw(env_, path_, &stat_);
  }
  if (!has_expected_) {
    expected_ = FileIdentity::of(stat_);
    has_expected_ = true;
  }
  check_identity(stat_, path_, expected_);
  const SourceOptions& o = options_;
  if (!probed_ && o.direct == DirectIo::kAuto) {
    network_fs_ = on_network_filesystem(env_, buffered_descriptor(), path_);
    probed_ = true;
  }
  if (o.direct == DirectIo::kOff && o.cached_read == CachedRead::kPread) {
    log::debug("{}: reading buffered with pread (direct off)", path_);
    return;
  }
  std::string why_direct = "direct on";
  if (o.direct != DirectIo::kOn) {
    const double resident = env_->resident_fraction(buffered_descriptor(), stat_.size, kResidencySamples);
    const bool cached = resident >= o.resident_threshold;
    if (cached && o.cached_read != CachedRead::kPread) map();
    if (o.direct == DirectIo::kOff) {
      log::debug("{}: reading buffered{} (direct off)", path_, mapped() ? " from a mapping" : "");
      return;
    }
    if (cached) {
      log::debug("{}: {:.0f}% in page cache, reading buffered{}", path_, resident * 100,
                 mapped() ? " from a mapping" : "");
      return;
    }
    why_direct = fmt::format("{:.0f}% in page cache, under {:.0f}%", resident * 100, o.resident_threshold * 100);
  }
  if (network_fs_ && o.direct == DirectIo::kAuto) return;  // buffered, many readers
  // Reads land at page-aligned places in pool blocks (Note [Direct I/O]).
  if (stat_.dio_mem_align > kFallbackDirectAlign) {
    const std::string why = "O_DIRECT needs " + std::to_string(stat_.dio_mem_align) +
                            "-byte aligned memory here; pool blocks are aligned to " +
                            std::to_string(kFallbackDirectAlign);
    if (o.direct == DirectIo::kOn) throw IoError(why, ErrorContext{path_});
    log::debug("{}: {}, reading buffered", path_, why);
    return;
  }
  const int fd = env_->open_read(path_, O_DIRECT);
  if (fd >= 0) {
    direct_fd_ = ScopedFd(env_, fd);
    check_identity(env_, fd, path_, expected_);
    direct_.store(true, std::memory_order_relaxed);
    log::debug("{}: {}, reading with O_DIRECT", path_, why_direct);
  } else if (o.direct == DirectIo::kOn) {
    throw_os_error("O_DIRECT open refused", -fd, ErrorContext{path_});
  } else {
    log::debug("{}: O_DIRECT refused at open ({}), reading buffered", path_, log::errno_text(-fd));
  }
}

int LocalFileSource::buffered_fd() {
  open();
  return buffered_descriptor();
}

// Reads [offset, offset + bytes) with pread, direct or buffered (read_full:
// the retries). A direct read refused (EINVAL) goes buffered from then on,
// unless direct was asked for; a short direct read, which leaves the
// position off the alignment, finishes buffered.
void LocalFileSource::read(std::uint64_t offset, std::uint64_t bytes, std::byte* dest, std::uint64_t capacity) {
  const int buffered = buffered_fd();  // opens the source
  bool direct = direct_.load(std::memory_order_relaxed);
  const std::uint64_t alignment = std::max<std::uint64_t>(stat_.dio_offset_align, kFallbackDirectAlign);
  std::uint64_t done = 0;
  while (done < bytes) {
    const int fd = direct ? direct_fd_.get() : buffered;
    // Direct reads ask for the whole aligned length; buffered for what is left.
    const ReadResult r = read_full(env_, fd, dest + done, bytes - done, offset + done,
                                   direct ? std::max(capacity, bytes) - done : 0, direct ? alignment : 1);
    done += r.bytes;
    const std::uint64_t at = offset + done;
    if (r.error == EINVAL && direct && options_.direct != DirectIo::kOn) {
      if (direct_.exchange(false)) log::debug("{}: O_DIRECT read refused, reading buffered", path_);
      direct = false;
      continue;
    }
    if (r.error != 0) throw_os_error("read failed", r.error, ErrorContext{path_, {}, at, offset + bytes});
    if (r.ended) {
      throw IoError("file ended early, at byte " + std::to_string(at) + " of the " + std::to_string(expected_.size) +
                        " it had when opened (truncated while reading?)",
                    ErrorContext{path_, {}, at, offset + bytes});
    }
    if (done < bytes) direct = false;
  }
}

// Copies from the file's mapping (Note [Mapped reads] in loader.h).
bool LocalFileSource::copy_mapped(std::uint64_t offset, std::uint64_t bytes, std::byte* dest) {
  const std::byte* mapping = mapping_.load(std::memory_order_acquire);
  if (mapping == nullptr || offset + bytes > mapping_bytes_) return false;
  const std::byte* src = mapping + offset;
  int rc;
  do {
    rc = env_->populate_read(src, bytes);
  } while (rc == -EINTR);
  // -EINVAL: a kernel before MADV_POPULATE_READ; the copy faults pages in.
  if (rc != 0 && rc != -EINVAL && rc != -ENOSYS) {
    log::debug("{}: populating [{}, {}) failed ({}), reading with pread", path_, offset, offset + bytes,
               log::errno_text(-rc));
    return false;
  }
  const bool copied = copy_from_mapping(dest, src, bytes);
  // Drop the range's page-table entries now, in this worker, rather than all
  // at once when the file is unmapped (the page cache keeps its pages).
  env_->advise(const_cast<std::byte*>(src), bytes, MADV_DONTNEED);
  if (!copied) {
    log::debug("{}: SIGBUS copying [{}, {}) from the mapping, reading with pread", path_, offset, offset + bytes);
  }
  return copied;
}

// ---- a remote object ----

RemoteObjectSource::RemoteObjectSource(std::shared_ptr<remote::RemoteClient> client, remote::ObjectInfo object,
                                       std::unique_ptr<remote::ObjectCache::Writer> cache_writer)
    : client_(std::move(client)), object_(std::move(object)), cache_writer_(std::move(cache_writer)) {}

RemoteObjectSource::~RemoteObjectSource() = default;

void RemoteObjectSource::read(std::uint64_t offset, std::uint64_t bytes, std::byte* dest, std::uint64_t capacity) {
  (void)capacity;
  client_->read(object_, offset, bytes, dest);
  if (cache_writer_) {
    // The bytes before the first range kept, once the rest has arrived: read here too.
    cache_writer_->write(offset, dest, bytes, [this](std::uint64_t at, std::uint64_t n, std::byte* into) {
      client_->read(object_, at, n, into);
    });
  }
}

unsigned RemoteObjectSource::connections() const { return client_->connections(); }

std::unique_ptr<LocalFileSource> open_local_file(Env* env, const std::string& path, const SourceOptions& options) {
  auto source = std::make_unique<LocalFileSource>(env, path, nullptr, options);
  source->open();
  return source;
}

std::unique_ptr<ByteSource> open_remote_object(std::shared_ptr<remote::RemoteClient> client,
                                               remote::ObjectInfo object) {
  return std::make_unique<RemoteObjectSource>(std::move(client), std::move(object), nullptr);
}

}  // namespace detail

std::unique_ptr<ByteSource> open_byte_source(Env* env, const SourceFile& file, const SourceOptions& options) {
  if (is_remote_path(file.path)) {  // Note [Remote reads] in src/remote/remote_client.h
    std::shared_ptr<remote::RemoteClient> client = remote::client_for(options.remote);
    remote::ObjectInfo object{file.path, file.stat.size, file.version, file.stat.mtime_ns};
    std::unique_ptr<remote::ObjectCache::Writer> writer;
    if (const remote::ObjectCache* cache = client->cache(); cache != nullptr) {
      if (std::string hit = cache->lookup(object, env); !hit.empty()) {
        // The cached copy is read as a local file, of its own identity: its
        // first open's, which later opens must match.
        return std::make_unique<detail::LocalFileSource>(env, std::move(hit), nullptr, options);
      }
      const std::uint64_t first = file.data_offset / detail::kFallbackDirectAlign * detail::kFallbackDirectAlign;
      writer = cache->begin(object, first, env);
    }
    return std::make_unique<detail::RemoteObjectSource>(std::move(client), std::move(object), std::move(writer));
  }
  const FileIdentity identity = FileIdentity::of(file.stat);
  auto source = std::make_unique<detail::LocalFileSource>(env, file.path, &identity, options);
  source->probe_filesystem();
  return source;
}

}  // namespace pinload
