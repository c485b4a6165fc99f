// pinload/env.h: the one seam between pinload and the operating system.
//
// Everything the loader asks of the OS (files, folders, reads, writes, stat, page-cache
// probes, file mappings, anonymous memory and locking) goes through an Env. Calls mirror the system
// calls they wrap and report failure as a negative errno, never by throwing,
// so that the code above them owns retries (EINTR, short reads) and fallbacks
// (O_DIRECT refused). Tests wrap an Env (EnvWrapper) to inject faults.
//
// Thread safety: every method may be called concurrently from many threads.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pinload {

// What kind of file a descriptor names (st_mode's S_IFMT). Only regular
// files are loaded; Note [Special files] in checkpoint.h.
enum class FileType : std::uint8_t { kRegular, kDirectory, kFifo, kSocket, kCharDevice, kBlockDevice, kSymlink, kOther };

// "regular file", "FIFO", "socket", ... for messages.
const char* file_type_name(FileType type) noexcept;

struct FileStat {
  FileType type = FileType::kRegular;
  std::uint64_t size = 0;
  std::uint64_t inode = 0;
  std::uint64_t device = 0;
  std::int64_t mtime_ns = 0;
  // The inode's change time (set by the kernel on every write, truncation,
  // chmod or link; a user cannot set it back) and its generation
  // (FS_IOC_GETVERSION: ext4, XFS, btrfs; a new inode that reuses a deleted
  // one's number gets another). 0 where the stat does not say.
  std::int64_t ctime_ns = 0;
  std::uint64_t generation = 0;
  // Direct-I/O alignment from statx(STATX_DIOALIGN); 0 when the kernel or the
  // filesystem does not say.
  std::uint32_t dio_mem_align = 0;
  std::uint32_t dio_offset_align = 0;
};

// One entry of a folder: its name and what it names, symbolic links
// followed (kSymlink: a link to nothing).
struct FolderEntry {
  std::string name;
  FileType type = FileType::kOther;
};

class Env;
// The process-wide POSIX Env. Never null; lives until exit.
Env* default_env();

class Env {
 public:
  virtual ~Env() = default;

  // As open(2) with O_RDONLY | O_CLOEXEC | O_NONBLOCK | extra_flags (O_DIRECT,
  // say): a file descriptor, or -errno. O_NONBLOCK, so that opening a FIFO
  // never waits for a writer (it changes nothing for regular files).
  virtual int open_read(const std::string& path, int extra_flags) = 0;
  // As close(2): 0 or -errno.
  virtual int close(int fd) = 0;
  // As pread(2): bytes read (0 at end of file, fewer than asked is legal),
  // or -errno (-EINTR included).
  virtual std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) = 0;
  // statx(2) of an open file: 0 or -errno.
  virtual int stat(int fd, FileStat* out) = 0;
  // stat(2) of a path, symbolic links followed; `type` and `size` are
  // filled. 0 or -errno (-ENOENT or -ENOTDIR: nothing is there). An Env that
  // does not say asks default_env().
  virtual int stat_path(const std::string& path, FileStat* out) { return default_env()->stat_path(path, out); }
  // The entries of a folder but "." and "..", in the order readdir(3) gives
  // them: 0 or -errno. An Env that does not say asks default_env().
  virtual int list_folder(const std::string& path, std::vector<FolderEntry>* out) {
    return default_env()->list_folder(path, out);
  }
  // The write half: what the converter, the remote cache, templates and
  // manifests write. An Env that does not say asks default_env().
  //
  // As open(2) with O_CLOEXEC | flags (O_WRONLY or O_RDWR, with O_CREAT,
  // O_TRUNC, O_EXCL as the caller needs) and `mode`: a file descriptor, or
  // -errno.
  virtual int open_write(const std::string& path, int flags, unsigned mode) {
    return default_env()->open_write(path, flags, mode);
  }
  // As pwrite(2): bytes written (fewer than asked is legal), or -errno
  // (-EINTR included). Callers write through write_full (os/read_full.h).
  virtual std::int64_t pwrite(int fd, const void* buffer, std::size_t bytes, std::uint64_t offset) {
    return default_env()->pwrite(fd, buffer, bytes, offset);
  }
  // ftruncate(2), fsync(2) of an open file or folder: 0 or -errno.
  virtual int truncate(int fd, std::uint64_t size) { return default_env()->truncate(fd, size); }
  virtual int sync(int fd) { return default_env()->sync(fd); }
  // rename(2) and unlink(2): 0 or -errno.
  virtual int rename(const std::string& from, const std::string& to) { return default_env()->rename(from, to); }
  virtual int remove(const std::string& path) { return default_env()->remove(path); }

  // posix_fadvise(2): 0 or -errno.
  virtual int fadvise(int fd, std::uint64_t offset, std::uint64_t length, int advice) = 0;
  // The f_type of fstatfs(2) for an open file (NFS_SUPER_MAGIC, FUSE's, ...):
  // 0 or -errno.
  virtual int filesystem_type(int fd, std::int64_t* magic) {
    (void)fd, (void)magic;
    return -ENOSYS;
  }
  // Fraction in [0, 1] of the file's pages resident in the page cache,
  // estimated from `samples` probes spread over the file; -1 when unknown.
  virtual double resident_fraction(int fd, std::uint64_t size, int samples) = 0;

  // A read-only shared mapping of the first `bytes` (> 0) of an open file, as
  // mmap(2) PROT_READ, MAP_SHARED: the address, or nullptr with *err set.
  // Released with unmap(). Note [Mapped reads] in loader.h.
  virtual const void* map_file(int fd, std::size_t bytes, int* err) {
    (void)fd, (void)bytes;
    *err = ENOSYS;
    return nullptr;
  }
  // A private, writable mapping of the first `bytes` (> 0) of an open file,
  // as mmap(2) PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE: a write
  // copies its page and never reaches the file. The address, or nullptr with
  // *err set. Its owner releases it with munmap(2) (a zero-copy load's
  // mapping may outlive the Env). Note [Leased mappings].
  virtual void* map_file_private(int fd, std::size_t bytes, int* err) {
    (void)fd, (void)bytes;
    *err = ENOSYS;
    return nullptr;
  }
  // A shared, writable mapping of the first `bytes` (> 0) of an open file, as
  // mmap(2) PROT_READ | PROT_WRITE, MAP_SHARED (the node store's entries):
  // the address, or nullptr with *err set. Released with unmap().
  virtual void* map_file_shared(int fd, std::size_t bytes, int* err) { return default_env()->map_file_shared(fd, bytes, err); }
  // An anonymous file in memory that can be sealed, as memfd_create(2) with
  // MFD_CLOEXEC | MFD_ALLOW_SEALING: a descriptor, or -errno.
  virtual int memory_file(const std::string& name) { return default_env()->memory_file(name); }
  // Seals a memory file against writes, growing and shrinking, for good
  // (fcntl(2) F_ADD_SEALS): 0 or -errno.
  virtual int seal_memory_file(int fd) { return default_env()->seal_memory_file(fd); }
  // Fills the page tables of [address, +bytes) of a file mapping, reading
  // from the file what the page cache lacks: madvise(2) MADV_POPULATE_READ.
  // 0 or -errno: -EFAULT where the file no longer has those bytes (it never
  // raises SIGBUS), -EINVAL where the kernel lacks it, -EINTR to retry.
  virtual int populate_read(const void* address, std::size_t bytes) {
    (void)address, (void)bytes;
    return -ENOSYS;
  }

  // Anonymous, page-aligned, zero-filled memory, as mmap(2) with
  // `extra_flags` (MAP_HUGETLB, say): the address, or nullptr with *err set.
  virtual void* map_anonymous(std::size_t bytes, int extra_flags, int* err) = 0;
  virtual int unmap(void* address, std::size_t bytes) = 0;
  // Locks the range as its pages are touched: mlock2(MLOCK_ONFAULT), or
  // mlock(2) where the kernel lacks it. Touching is left to the caller, so
  // the pool's pages are faulted in by the reader threads, in parallel,
  // rather than all at once by the thread that reserves them.
  virtual int lock(void* address, std::size_t bytes) = 0;
  virtual int unlock(void* address, std::size_t bytes) = 0;  // munlock(2)
  virtual int advise(void* address, std::size_t bytes, int advice) = 0;  // madvise(2)
  // Whether the page holding `address` is in memory (mincore(2)): 1 or 0,
  // or -errno where that cannot be told.
  virtual int page_resident(const void* address) {
    (void)address;
    return -ENOSYS;
  }

  // NUMA placement (numa.h). An Env that cannot place says -ENOSYS, and the
  // caller leaves placement to the OS.
  //
  // Prefers node `node` for the pages of [address, +bytes) that are touched
  // from now on: mbind(2) with MPOL_PREFERRED. 0 or -errno.
  virtual int bind_memory(void* address, std::size_t bytes, int node) {
    (void)address, (void)bytes, (void)node;
    return -ENOSYS;
  }
  // Prefers `node` for the calling thread's later allocations, those a
  // driver makes on its behalf included: set_mempolicy(2) MPOL_PREFERRED;
  // node < 0 restores MPOL_DEFAULT. 0 or -errno.
  virtual int set_thread_memory_node(int node) {
    (void)node;
    return -ENOSYS;
  }
  // The CPUs the calling thread may run on, ascending (sched_getaffinity(2)):
  // 0 or -errno.
  virtual int get_thread_affinity(std::vector<int>* cpus) {
    (void)cpus;
    return -ENOSYS;
  }
  // Restricts the calling thread to `cpus` (sched_setaffinity(2)): 0 or -errno.
  virtual int set_thread_affinity(const std::vector<int>& cpus) {
    (void)cpus;
    return -ENOSYS;
  }
};

// Forwards every call to a target Env. Subclass it and override one call to
// inject a fault. *target must outlive the wrapper.
class EnvWrapper : public Env {
 public:
  explicit EnvWrapper(Env* target) : target_(target) {}
  Env* target() const { return target_; }

  int open_read(const std::string& path, int extra_flags) override {
    return target_->open_read(path, extra_flags);
  }
  int close(int fd) override { return target_->close(fd); }
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    return target_->pread(fd, buffer, bytes, offset);
  }
  int stat(int fd, FileStat* out) override { return target_->stat(fd, out); }
  int stat_path(const std::string& path, FileStat* out) override { return target_->stat_path(path, out); }
  int list_folder(const std::string& path, std::vector<FolderEntry>* out) override {
    return target_->list_folder(path, out);
  }
  int open_write(const std::string& path, int flags, unsigned mode) override {
    return target_->open_write(path, flags, mode);
  }
  std::int64_t pwrite(int fd, const void* buffer, std::size_t bytes, std::uint64_t offset) override {
    return target_->pwrite(fd, buffer, bytes, offset);
  }
  int truncate(int fd, std::uint64_t size) override { return target_->truncate(fd, size); }
  int sync(int fd) override { return target_->sync(fd); }
  int rename(const std::string& from, const std::string& to) override { return target_->rename(from, to); }
  int remove(const std::string& path) override { return target_->remove(path); }
  int fadvise(int fd, std::uint64_t offset, std::uint64_t length, int advice) override {
    return target_->fadvise(fd, offset, length, advice);
  }
  double resident_fraction(int fd, std::uint64_t size, int samples) override {
    return target_->resident_fraction(fd, size, samples);
  }
  int filesystem_type(int fd, std::int64_t* magic) override { return target_->filesystem_type(fd, magic); }
  const void* map_file(int fd, std::size_t bytes, int* err) override { return target_->map_file(fd, bytes, err); }
  void* map_file_private(int fd, std::size_t bytes, int* err) override {
    return target_->map_file_private(fd, bytes, err);
  }
  int populate_read(const void* address, std::size_t bytes) override {
    return target_->populate_read(address, bytes);
  }
  void* map_file_shared(int fd, std::size_t bytes, int* err) override {
    return target_->map_file_shared(fd, bytes, err);
  }
  int memory_file(const std::string& name) override { return target_->memory_file(name); }
  int seal_memory_file(int fd) override { return target_->seal_memory_file(fd); }
  void* map_anonymous(std::size_t bytes, int extra_flags, int* err) override {
    return target_->map_anonymous(bytes, extra_flags, err);
  }
  int unmap(void* address, std::size_t bytes) override { return target_->unmap(address, bytes); }
  int lock(void* address, std::size_t bytes) override { return target_->lock(address, bytes); }
  int unlock(void* address, std::size_t bytes) override { return target_->unlock(address, bytes); }
  int advise(void* address, std::size_t bytes, int advice) override {
    return target_->advise(address, bytes, advice);
  }
  int page_resident(const void* address) override { return target_->page_resident(address); }
  int bind_memory(void* address, std::size_t bytes, int node) override {
    return target_->bind_memory(address, bytes, node);
  }
  int set_thread_memory_node(int node) override { return target_->set_thread_memory_node(node); }
  int get_thread_affinity(std::vector<int>* cpus) override { return target_->get_thread_affinity(cpus); }
  int set_thread_affinity(const std::vector<int>& cpus) override { return target_->set_thread_affinity(cpus); }

 private:
  Env* target_;
};

// An open file descriptor that closes itself. Owns the fd; move-only.
class ScopedFd {
 public:
  ScopedFd() = default;
  ScopedFd(Env* env, int fd) : env_(env), fd_(fd) {}
  ScopedFd(ScopedFd&& other) noexcept : env_(other.env_), fd_(other.release()) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept {
    if (this != &other) {
      reset();
      env_ = other.env_;
      fd_ = other.release();
    }
    return *this;
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset() {
    if (fd_ >= 0) env_->close(fd_);
    fd_ = -1;
  }

 private:
  Env* env_ = nullptr;
  int fd_ = -1;
};

// Opens `path` for reading through `env`; throws NotFoundError or IoError.
ScopedFd open_or_throw(Env* env, const std::string& path, int extra_flags = 0);
// Stats an open file; throws IoError naming `path`.
FileStat stat_or_throw(Env* env, int fd, const std::string& path);
// stat_or_throw of a file that must be a regular file: a FIFO, socket,
// device or folder throws InvalidFileError naming its type (Note [Special
// files] in checkpoint.h).
FileStat stat_regular_or_throw(Env* env, int fd, const std::string& path);
// open_or_throw + stat_regular_or_throw. *st receives the stat.
ScopedFd open_regular_or_throw(Env* env, const std::string& path, FileStat* st, int extra_flags = 0);
// Reads exactly `bytes` at `offset`, retrying EINTR and short reads. Throws
// IoError on failure and InvalidFileError if the file ends first.
void pread_exact(Env* env, int fd, void* buffer, std::size_t bytes, std::uint64_t offset,
                 const std::string& path);

// Writes exactly `bytes` at `offset` through write_full (os/read_full.h).
// Throws IoError naming `path` and the bytes not written.
void pwrite_exact(Env* env, int fd, const void* buffer, std::size_t bytes, std::uint64_t offset,
                  const std::string& path);

// Note [Atomic writes]
// A file that readers open by name (a manifest, a template, an index of a
// converted checkpoint) is never seen half-written: its bytes go to a
// temporary beside it (path + ".tmp." + the pid), which is synced, then
// renamed over `path`. On any failure (open, write, fsync, rename) the
// temporary is removed and `path` is left as it was; the error is an
// IoError (NotFoundError where the folder is missing) naming `path`.
void write_file_atomically(Env* env, const std::string& path, const void* bytes, std::size_t size);

// Note [OS calls outside the Env]
// What the loader asks of files and memory goes through an Env. These calls
// do not, each for its reason:
// - io/leased_mapping.cc: SIGBUS handling for leased mappings (sigaction,
//   the eventfd and poll of its watcher thread, fcntl leases, mmap/munmap of
//   the replacement pages): process-wide signal state that a per-load Env
//   cannot own (Note [Leased mappings]).
// - store/server.cc, store/client.cc, store/wire.cc, store/socket_path.cc:
//   the node store's Unix socket (socket, bind, listen, accept4, poll,
//   recvmsg/sendmsg with descriptors, SO_PEERCRED, shutdown), its descriptor
//   limit (getrlimit/setrlimit), the O_DIRECT flag of a client's descriptor
//   (fcntl F_GETFL/F_SETFL) and the client's private mapping of an entry: a
//   protocol between processes, not reads of a checkpoint. The store's
//   entries themselves (memfd, ftruncate, mmap, madvise, seals) go through
//   the Env.
// - remote/object_cache.cc: flock of .part files and the sweep that tells a
//   dead writer's file by its lock and inode (open, fstat, stat, unlink), and
//   utimensat for the LRU: a cache shared between processes; its reads and
//   writes go through the load's Env.
// - trace/pre_content.cc: fanotify (fanotify_init/mark, reading events,
//   readlink of their descriptors), which watches other processes' reads.
// - memory/huge_page_collapse.cc: madvise(MADV_COLLAPSE) through syscall, a
//   best-effort hint on memory the pool already holds.
// - Signals, pids and terminals in the CLI and the trace agent (sigaction,
//   kill, getpid, ioctl TIOCGWINSZ), sysconf for the page size, getrlimit of
//   RLIMIT_NOFILE in zero_copy.cc, and std::filesystem for folders
//   (create_directories, directory listing, remove_all of a failed
//   conversion, copy_file of a converted folder's configs).

// Note [Holding a file]
// safe_open reads a file's header at open and its data at the first
// get_tensor, which may be much later; the reference safetensors keeps the
// file open (mapped) in between and stays consistent when the path is
// replaced. HeldFileEnv does the same for a pinload load: it opens the file
// once and answers every open_read of that path by reopening the held file
// through /proc/self/fd (a new open file description of the same inode, so
// that O_DIRECT can still be asked for). Identity checks (Note [One version
// per load] in checkpoint.h) then always pass, and header and data come from
// one version of the file. Other paths go to the target Env.
class HeldFileEnv final : public EnvWrapper {
 public:
  // Opens `path` (a regular file) through `target` and holds it. Throws as
  // open_regular_or_throw. *target must outlive this Env.
  HeldFileEnv(Env* target, std::string path);

  const std::string& path() const noexcept { return path_; }

  // `path` reopens the held file; anything else goes to the target.
  int open_read(const std::string& path, int extra_flags) override;

 private:
  std::string path_;
  ScopedFd held_;
  std::string reopen_path_;  // /proc/self/fd/<held>
};

}  // namespace pinload
