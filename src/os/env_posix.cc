#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <linux/mempolicy.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string_view>
#include <vector>

#include "base/madvise.h"
#include "os/read_full.h"
#include "pinload/env.h"
#include "pinload/error.h"

namespace pinload {
namespace {

// The inode's generation (FS_IOC_GETVERSION), 0 where the filesystem keeps
// none (ENOTTY, EOPNOTSUPP) or the descriptor cannot be asked (O_PATH).
std::uint64_t generation_of(int fd) {
  int generation = 0;
  return ::ioctl(fd, FS_IOC_GETVERSION, &generation) == 0 ? static_cast<std::uint32_t>(generation) : 0;
}

// Far above any real machine's node or CPU ids; bounds the masks built here.
constexpr int kMaxNumaNode = 4095;
constexpr int kMaxCpu = 1 << 20;

// A node mask with bit `node` set, and the `maxnode` the kernel wants for it:
// it counts one bit past the mask (mbind(2), set_mempolicy(2)).
struct NodeMask {
  explicit NodeMask(int node) : bits(static_cast<std::size_t>(node) / kBitsPerWord + 1, 0) {
    bits[static_cast<std::size_t>(node) / kBitsPerWord] |= 1ul << (static_cast<unsigned>(node) % kBitsPerWord);
  }
  unsigned long maxnode() const { return bits.size() * kBitsPerWord + 1; }
  static constexpr unsigned kBitsPerWord = sizeof(unsigned long) * 8;
  std::vector<unsigned long> bits;
};

// A heap cpu_set_t for `cpus` CPUs (CPU_ALLOC): machines may have more than
// CPU_SETSIZE.
class CpuSet {
 public:
  explicit CpuSet(int cpus) : set_(CPU_ALLOC(cpus)), bytes_(CPU_ALLOC_SIZE(cpus)) {
    if (set_ != nullptr) CPU_ZERO_S(bytes_, set_);
  }
  ~CpuSet() { CPU_FREE(set_); }
  CpuSet(const CpuSet&) = delete;
  CpuSet& operator=(const CpuSet&) = delete;
  cpu_set_t* get() const { return set_; }
  std::size_t bytes() const { return bytes_; }

 private:
  cpu_set_t* set_;
  std::size_t bytes_;
};

FileType file_type_of(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG: return FileType::kRegular;
    case S_IFDIR: return FileType::kDirectory;
    case S_IFIFO: return FileType::kFifo;
    case S_IFSOCK: return FileType::kSocket;
    case S_IFCHR: return FileType::kCharDevice;
    case S_IFBLK: return FileType::kBlockDevice;
    case S_IFLNK: return FileType::kSymlink;
    default: return FileType::kOther;
  }
}

class PosixEnv final : public Env {
 public:
  int open_read(const std::string& path, int extra_flags) override {
    int fd;
    do {
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | extra_flags);
    } while (fd < 0 && errno == EINTR);
    return fd >= 0 ? fd : -errno;
  }

  int close(int fd) override { return ::close(fd) == 0 ? 0 : -errno; }

  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    ssize_t n = ::pread(fd, buffer, bytes, static_cast<off_t>(offset));
    return n >= 0 ? n : -errno;
  }

  int open_write(const std::string& path, int flags, unsigned mode) override {
    int fd;
    do {
      fd = ::open(path.c_str(), O_CLOEXEC | flags, static_cast<mode_t>(mode));
    } while (fd < 0 && errno == EINTR);
    return fd >= 0 ? fd : -errno;
  }

  std::int64_t pwrite(int fd, const void* buffer, std::size_t bytes, std::uint64_t offset) override {
    const ssize_t n = ::pwrite(fd, buffer, bytes, static_cast<off_t>(offset));
    return n >= 0 ? n : -errno;
  }

  int truncate(int fd, std::uint64_t size) override {
    return ::ftruncate(fd, static_cast<off_t>(size)) == 0 ? 0 : -errno;
  }
  int sync(int fd) override { return ::fsync(fd) == 0 ? 0 : -errno; }
  int rename(const std::string& from, const std::string& to) override {
    return ::rename(from.c_str(), to.c_str()) == 0 ? 0 : -errno;
  }
  int remove(const std::string& path) override { return ::unlink(path.c_str()) == 0 ? 0 : -errno; }

  int filesystem_type(int fd, std::int64_t* magic) override {
    struct statfs sf {};
    if (::fstatfs(fd, &sf) != 0) return -errno;
    *magic = static_cast<std::int64_t>(sf.f_type);
    return 0;
  }

  int stat(int fd, FileStat* out) override {
#ifdef STATX_BASIC_STATS
    struct statx sx {};
    unsigned mask = STATX_BASIC_STATS;
#ifdef STATX_DIOALIGN
    mask |= STATX_DIOALIGN;
#endif
    if (::statx(fd, "", AT_EMPTY_PATH, mask, &sx) == 0) {
      out->type = file_type_of(sx.stx_mode);
      out->size = sx.stx_size;
      out->inode = sx.stx_ino;
      out->device = (static_cast<std::uint64_t>(sx.stx_dev_major) << 32) | sx.stx_dev_minor;
      out->mtime_ns = static_cast<std::int64_t>(sx.stx_mtime.tv_sec) * 1'000'000'000 + sx.stx_mtime.tv_nsec;
      out->ctime_ns = static_cast<std::int64_t>(sx.stx_ctime.tv_sec) * 1'000'000'000 + sx.stx_ctime.tv_nsec;
      out->generation = out->type == FileType::kRegular ? generation_of(fd) : 0;
#ifdef STATX_DIOALIGN
      if (sx.stx_mask & STATX_DIOALIGN) {
        out->dio_mem_align = sx.stx_dio_mem_align;
        out->dio_offset_align = sx.stx_dio_offset_align;
      }
#endif
      return 0;
    }
    if (errno != ENOSYS) return -errno;
#endif
    struct ::stat st {};
    if (::fstat(fd, &st) != 0) return -errno;
    out->type = file_type_of(st.st_mode);
    out->size = static_cast<std::uint64_t>(st.st_size);
    out->inode = st.st_ino;
    out->device = st.st_dev;
    out->mtime_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
    out->ctime_ns = static_cast<std::int64_t>(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec;
    out->generation = out->type == FileType::kRegular ? generation_of(fd) : 0;
    return 0;
  }

  int stat_path(const std::string& path, FileStat* out) override {
    struct ::stat st {};
    if (::stat(path.c_str(), &st) != 0) return -errno;
    out->type = file_type_of(st.st_mode);
    out->size = static_cast<std::uint64_t>(st.st_size);
    return 0;
  }

  int list_folder(const std::string& path, std::vector<FolderEntry>* out) override {
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr) return -errno;
    std::vector<FolderEntry> entries;
    int rc = 0;
    for (;;) {
      errno = 0;
      const dirent* entry = ::readdir(dir);
      if (entry == nullptr) {
        rc = -errno;  // 0 at the end
        break;
      }
      const std::string_view name(entry->d_name);
      if (name == "." || name == "..") continue;
      FileType type;
      if (entry->d_type != DT_UNKNOWN && entry->d_type != DT_LNK) {
        type = file_type_of(DTTOIF(entry->d_type));
      } else {  // a link, or a filesystem that does not say: follow it
        struct ::stat st {};
        type = ::fstatat(::dirfd(dir), entry->d_name, &st, 0) == 0 ? file_type_of(st.st_mode) : FileType::kSymlink;
      }
      entries.push_back(FolderEntry{std::string(name), type});
    }
    ::closedir(dir);
    if (rc == 0) *out = std::move(entries);
    return rc;
  }

  int fadvise(int fd, std::uint64_t offset, std::uint64_t length, int advice) override {
    return -::posix_fadvise(fd, static_cast<off_t>(offset), static_cast<off_t>(length), advice);
  }

  // Files up to this many pages (64 MiB of 4 KiB pages) are measured whole.
  static constexpr std::uint64_t kWholeFileResidencyPages = 16384;

  double resident_fraction(int fd, std::uint64_t size, int samples) override {
    if (size == 0) return 1.0;
    const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) return -1.0;
    const std::uint64_t pages = (size + page - 1) / page;
    const std::uint64_t probes = std::min<std::uint64_t>(pages, static_cast<std::uint64_t>(std::max(samples, 1)));
    // A file of few pages: every page, in one call (a small file's load pays
    // one syscall here, not one per sample).
    if (pages <= kWholeFileResidencyPages) {
      std::vector<unsigned char> vec(pages);
      const bool ok = ::mincore(map, size, vec.data()) == 0;
      ::munmap(map, size);
      if (!ok) return -1.0;
      std::uint64_t resident = 0;
      for (unsigned char v : vec) resident += v & 1u;
      return static_cast<double>(resident) / static_cast<double>(pages);
    }
    std::uint64_t resident = 0;
    unsigned char vec = 0;
    for (std::uint64_t i = 0; i < probes; ++i) {
      const std::uint64_t p = probes == 1 ? 0 : i * (pages - 1) / (probes - 1);
      if (::mincore(static_cast<char*>(map) + p * page, page, &vec) != 0) {
        ::munmap(map, size);
        return -1.0;
      }
      resident += vec & 1u;
    }
    ::munmap(map, size);
    return static_cast<double>(resident) / static_cast<double>(probes);
  }

  const void* map_file(int fd, std::size_t bytes, int* err) override {
    void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      *err = errno;
      return nullptr;
    }
    return p;
  }

  void* map_file_private(int fd, std::size_t bytes, int* err) override {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) {
      *err = errno;
      return nullptr;
    }
    return p;
  }

  void* map_file_shared(int fd, std::size_t bytes, int* err) override {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      *err = errno;
      return nullptr;
    }
    return p;
  }

  int memory_file(const std::string& name) override {
    const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    return fd >= 0 ? fd : -errno;
  }

  int seal_memory_file(int fd) override {
    return ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) == 0 ? 0 : -errno;
  }

  int populate_read(const void* address, std::size_t bytes) override {
    // The start must be page-aligned; the kernel rounds the length up.
    return ::madvise(const_cast<void*>(address), bytes, detail::kMadvPopulateRead) == 0 ? 0 : -errno;
  }

  void* map_anonymous(std::size_t bytes, int extra_flags, int* err) override {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | extra_flags, -1, 0);
    if (p == MAP_FAILED) {
      *err = errno;
      return nullptr;
    }
    return p;
  }
  int unmap(void* address, std::size_t bytes) override { return ::munmap(address, bytes) == 0 ? 0 : -errno; }
  int lock(void* address, std::size_t bytes) override {
#ifdef MLOCK_ONFAULT
    if (::mlock2(address, bytes, MLOCK_ONFAULT) == 0) return 0;
    if (errno != EINVAL && errno != ENOSYS) return -errno;
#endif
    return ::mlock(address, bytes) == 0 ? 0 : -errno;
  }
  int unlock(void* address, std::size_t bytes) override { return ::munlock(address, bytes) == 0 ? 0 : -errno; }
  int advise(void* address, std::size_t bytes, int advice) override {
    return ::madvise(address, bytes, advice) == 0 ? 0 : -errno;
  }
  int page_resident(const void* address) override {
    static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    unsigned char in_memory = 0;
    void* start = reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(address) & ~(page - 1));
    if (::mincore(start, 1, &in_memory) != 0) return -errno;
    return in_memory & 1;
  }

  // Raw system calls, so that pinload does not need libnuma.
  int bind_memory(void* address, std::size_t bytes, int node) override {
    if (node < 0 || node > kMaxNumaNode) return -EINVAL;
    const NodeMask mask(node);
    return ::syscall(SYS_mbind, address, bytes, MPOL_PREFERRED, mask.bits.data(), mask.maxnode(), 0u) == 0 ? 0
                                                                                                          : -errno;
  }
  int set_thread_memory_node(int node) override {
    if (node > kMaxNumaNode) return -EINVAL;
    if (node < 0) return ::syscall(SYS_set_mempolicy, MPOL_DEFAULT, nullptr, 0ul) == 0 ? 0 : -errno;
    const NodeMask mask(node);
    return ::syscall(SYS_set_mempolicy, MPOL_PREFERRED, mask.bits.data(), mask.maxnode()) == 0 ? 0 : -errno;
  }
  int get_thread_affinity(std::vector<int>* cpus) override {
    // Grow the set until the kernel's CPU count fits in it (EINVAL: too small).
    for (int n = 1024; n <= kMaxCpu; n *= 2) {
      CpuSet set(n);
      if (set.get() == nullptr) return -ENOMEM;
      if (::sched_getaffinity(0, set.bytes(), set.get()) != 0) {
        if (errno == EINVAL) continue;
        return -errno;
      }
      cpus->clear();
      for (int cpu = 0; cpu < n; ++cpu) {
        if (CPU_ISSET_S(cpu, set.bytes(), set.get())) cpus->push_back(cpu);
      }
      return 0;
    }
    return -EINVAL;
  }
  int set_thread_affinity(const std::vector<int>& cpus) override {
    if (cpus.empty()) return -EINVAL;
    const int top = *std::max_element(cpus.begin(), cpus.end());
    if (top >= kMaxCpu || *std::min_element(cpus.begin(), cpus.end()) < 0) return -EINVAL;
    CpuSet set(top + 1);
    if (set.get() == nullptr) return -ENOMEM;
    for (int cpu : cpus) CPU_SET_S(cpu, set.bytes(), set.get());
    return ::sched_setaffinity(0, set.bytes(), set.get()) == 0 ? 0 : -errno;  // 0: this thread only
  }
};

}  // namespace

const char* file_type_name(FileType type) noexcept {
  switch (type) {
    case FileType::kRegular: return "regular file";
    case FileType::kDirectory: return "folder";
    case FileType::kFifo: return "FIFO";
    case FileType::kSocket: return "socket";
    case FileType::kCharDevice: return "character device";
    case FileType::kBlockDevice: return "block device";
    case FileType::kSymlink: return "symbolic link";
    case FileType::kOther: break;
  }
  return "special file";
}

Env* default_env() {
  static PosixEnv* env = new PosixEnv();  // never destroyed: usable during exit
  return env;
}

ScopedFd open_or_throw(Env* env, const std::string& path, int extra_flags) {
  int fd = env->open_read(path, extra_flags);
  if (fd < 0) throw_os_error("cannot open", -fd, ErrorContext{path});
  return ScopedFd(env, fd);
}

FileStat stat_or_throw(Env* env, int fd, const std::string& path) {
  FileStat st;
  if (int rc = env->stat(fd, &st); rc != 0) throw_os_error("cannot stat", -rc, ErrorContext{path});
  return st;
}

FileStat stat_regular_or_throw(Env* env, int fd, const std::string& path) {
  const FileStat st = stat_or_throw(env, fd, path);
  if (st.type != FileType::kRegular) {
    throw InvalidFileError(std::string("is a ") + file_type_name(st.type) + ", not a regular file", ErrorContext{path});
  }
  return st;
}

ScopedFd open_regular_or_throw(Env* env, const std::string& path, FileStat* st, int extra_flags) {
  ScopedFd fd = open_or_throw(env, path, extra_flags);
  *st = stat_regular_or_throw(env, fd.get(), path);
  return fd;
}

void pread_exact(Env* env, int fd, void* buffer, std::size_t bytes, std::uint64_t offset,
                 const std::string& path) {
  const ReadResult r = read_full(env, fd, buffer, bytes, offset);
  if (r.error != 0) {
    throw_os_error("read failed", r.error, ErrorContext{path, {}, offset + r.bytes, offset + bytes});
  }
  if (r.ended) {
    throw InvalidFileError("file ended early: expected bytes up to " + std::to_string(offset + bytes),
                           ErrorContext{path, {}, offset + r.bytes, offset + bytes});
  }
}

void pwrite_exact(Env* env, int fd, const void* buffer, std::size_t bytes, std::uint64_t offset,
                  const std::string& path) {
  const WriteResult r = write_full(env, fd, buffer, bytes, offset);
  if (r.error != 0) {
    throw_os_error("write failed", r.error, ErrorContext{path, {}, offset + r.bytes, offset + bytes});
  }
}

void write_file_atomically(Env* env, const std::string& path, const void* bytes, std::size_t size) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = env->open_write(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw_os_error("cannot create the temporary " + tmp, -fd, ErrorContext{path});
  // Removes the temporary and throws: nothing half-written stays behind.
  auto fail = [&](const std::string& what, int err, bool open) {
    if (open) env->close(fd);
    env->remove(tmp);
    throw_os_error(what, err, ErrorContext{path});
  };
  if (const WriteResult r = write_full(env, fd, bytes, size, 0); r.error != 0) {
    fail("write failed at byte " + std::to_string(r.bytes) + " of " + std::to_string(size) + " (to " + tmp + ")",
         r.error, true);
  }
  if (const int rc = env->sync(fd); rc != 0) fail("fsync failed (of " + tmp + ")", -rc, true);
  if (const int rc = env->close(fd); rc != 0) fail("close failed (of " + tmp + ")", -rc, false);
  if (const int rc = env->rename(tmp, path); rc != 0) fail("cannot rename " + tmp + " into place", -rc, false);
}

}  // namespace pinload
