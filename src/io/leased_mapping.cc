#include "io/leased_mapping.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "base/log.h"
#include "source/mapped_copy.h"
#include "pinload/env.h"

namespace pinload::detail {

// The one thread that owns every lease (Note [Leased mappings]). It runs
// while at least one mapping is registered. Never destroyed, so that tensors
// released at process exit find it.
class LeaseWatcher {
 public:
  static LeaseWatcher& get() {
    static LeaseWatcher* w = new LeaseWatcher;  // leaked on purpose
    return *w;
  }

  // Starts the thread if needed. Returns false (and sets *why) where no
  // signal or thread can be had. On true, release() must follow.
  bool acquire(std::string* why) {
    std::lock_guard life(lifecycle_mu_);
    if (users_ == 0 && !start(why)) return false;
    ++users_;
    return true;
  }
  void release() noexcept {
    std::lock_guard life(lifecycle_mu_);
    if (--users_ == 0) stop();
  }
  int signal() const noexcept { return signal_; }
  pid_t tid() const noexcept { return tid_; }

  void add(LeasedMapping* m) {
    std::lock_guard lock(mu_);
    by_fd_[m->fd_] = m;
  }
  void remove(LeasedMapping* m) noexcept {
    std::lock_guard lock(mu_);
    if (m->fd_ >= 0) by_fd_.erase(m->fd_);
  }
  // Moves `m` out of its file now (a break, or move_out()).
  void move(LeasedMapping* m) noexcept {
    std::lock_guard lock(mu_);
    if (m->fd_ >= 0) by_fd_.erase(m->fd_);
    m->move_locked();
  }
  // A break of the lease on `fd` was signalled, or (fd < 0) of some lease.
  void on_break(int fd) noexcept {
    std::lock_guard lock(mu_);
    std::vector<LeasedMapping*> breaking;
    for (auto& [f, m] : by_fd_) {
      if (fd >= 0 && f != fd) continue;
      // A stale signal for an fd number since reused: its lease is whole.
      if (::fcntl(f, F_GETLEASE) == F_RDLCK) continue;
      breaking.push_back(m);
    }
    for (LeasedMapping* m : breaking) {
      by_fd_.erase(m->fd_);
      m->move_locked();
    }
  }
  std::size_t live() noexcept {
    std::lock_guard lock(mu_);
    return by_fd_.size();
  }
  bool running() noexcept {
    std::lock_guard life(lifecycle_mu_);
    return thread_.joinable();
  }

 private:
  // A real-time signal nobody uses, set to SIG_IGN once (see the Note).
  bool choose_signal(std::string* why) {
    if (signal_ != 0) return true;
    for (int s = SIGRTMAX - 1; s > SIGRTMIN + 2; --s) {
      struct sigaction old {};
      if (::sigaction(s, nullptr, &old) != 0) continue;
      if ((old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL) continue;
      struct sigaction ignore {};
      ignore.sa_handler = SIG_IGN;
      sigemptyset(&ignore.sa_mask);
      if (::sigaction(s, &ignore, nullptr) != 0) continue;
      signal_ = s;
      return true;
    }
    *why = "no unused real-time signal for lease breaks";
    return false;
  }

  bool start(std::string* why) {
    if (!choose_signal(why)) return false;
    stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
    if (stop_fd_ < 0) {
      *why = std::string("eventfd: ") + std::strerror(errno);
      return false;
    }
    std::promise<int> started;  // the thread's tid, or -errno
    std::future<int> tid = started.get_future();
    const int sig = signal_;
    const int stop_fd = stop_fd_;
    thread_ = std::thread([this, sig, stop_fd, &started] { run(sig, stop_fd, &started); });
    const int t = tid.get();
    if (t < 0) {
      thread_.join();
      ::close(stop_fd_);
      stop_fd_ = -1;
      *why = std::string("signalfd: ") + std::strerror(-t);
      return false;
    }
    tid_ = t;
    return true;
  }

  void stop() noexcept {
    const std::uint64_t one = 1;
    if (::write(stop_fd_, &one, sizeof one) != static_cast<ssize_t>(sizeof one)) {
      log::warn("lease watcher: cannot signal its stop ({})", std::strerror(errno));
    }
    thread_.join();
    ::close(stop_fd_);
    stop_fd_ = -1;
    tid_ = 0;
  }

  void run(int sig, int stop_fd, std::promise<int>* started) {
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, sig);
    sigaddset(&mask, SIGIO);
    ::pthread_sigmask(SIG_BLOCK, &mask, nullptr);
    const int sfd = ::signalfd(-1, &mask, SFD_CLOEXEC);
    if (sfd < 0) {
      started->set_value(-errno);
      return;
    }
    started->set_value(static_cast<int>(::syscall(SYS_gettid)));
    pollfd fds[2] = {{sfd, POLLIN, 0}, {stop_fd, POLLIN, 0}};
    for (;;) {
      if (::poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        log::warn("lease watcher: poll failed ({}); leased mappings are no longer guarded", std::strerror(errno));
        break;
      }
      if ((fds[1].revents & POLLIN) != 0) break;
      signalfd_siginfo info{};
      if (::read(sfd, &info, sizeof info) != static_cast<ssize_t>(sizeof info)) continue;
      if (static_cast<int>(info.ssi_signo) == sig) {
        on_break(info.ssi_fd);
      } else {
        on_break(-1);  // SIGIO: the real-time queue overflowed, the fd is unknown
      }
    }
    ::close(sfd);
  }

  std::mutex lifecycle_mu_;  // users_, thread_ (start and stop)
  std::size_t users_ = 0;
  std::thread thread_;
  std::atomic<pid_t> tid_{0};
  int signal_ = 0;
  int stop_fd_ = -1;
  std::mutex mu_;  // by_fd_ and every move
  std::unordered_map<int, LeasedMapping*> by_fd_;
};

std::shared_ptr<LeasedMapping> LeasedMapping::open(Env* env, const std::string& path, const FileIdentity& expected,
                                                   std::string* why) {
  auto fail = [&](std::string text) {
    *why = std::move(text);
    return std::shared_ptr<LeasedMapping>();
  };
  const int opened = env->open_read(path, 0);
  if (opened < 0) return fail(std::string("open: ") + std::strerror(-opened));
  // The lease lives on the open file, held by a duplicate descriptor of the
  // mapping's own for as long as the mapping lives, which may be longer than
  // the Env: the Env's descriptor goes back to it at once.
  const int fd = ::fcntl(opened, F_DUPFD_CLOEXEC, 0);
  const int dup_errno = errno;
  env->close(opened);
  if (fd < 0) return fail(std::string("dup: ") + std::strerror(dup_errno));
  auto close_fd = [&] { ::close(fd); };
  FileStat st;
  auto identity_now = [&] {
    return env->stat(fd, &st) == 0 && st.type == FileType::kRegular && FileIdentity::of(st) == expected;
  };
  if (!identity_now()) {
    close_fd();
    return fail("not the file whose header was read");
  }
  LeaseWatcher& watcher = LeaseWatcher::get();
  if (!watcher.acquire(why)) {
    close_fd();
    return nullptr;
  }
  auto give_up = [&](std::string text) {
    close_fd();  // drops a lease taken
    watcher.release();
    return fail(std::move(text));
  };
  if (::fcntl(fd, F_SETSIG, watcher.signal()) != 0) return give_up(std::string("F_SETSIG: ") + std::strerror(errno));
  if (::fcntl(fd, F_SETLEASE, F_RDLCK) != 0) return give_up(std::string("no read lease: ") + std::strerror(errno));
  f_owner_ex owner{F_OWNER_TID, watcher.tid()};
  if (::fcntl(fd, F_SETOWN_EX, &owner) != 0) return give_up(std::string("F_SETOWN_EX: ") + std::strerror(errno));
  // Between the header's read and the lease a writer may have been at work.
  if (!identity_now()) return give_up("changed before its lease was taken");
  const std::size_t size = static_cast<std::size_t>(st.size);
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t mapped = std::max<std::size_t>((size + page - 1) / page * page, page);
  // Private and writable: a caller's write to a tensor copies that page
  // (copy-on-write) and never reaches the file.
  int err = 0;
  void* p = env->map_file_private(fd, mapped, &err);
  if (p == nullptr) return give_up(std::string("mmap: ") + std::strerror(err));
  std::shared_ptr<LeasedMapping> m(new LeasedMapping);
  m->path_ = path;
  m->fd_ = fd;
  m->base_ = static_cast<std::byte*>(p);
  m->size_ = size;
  m->mapped_ = mapped;
  m->block_.data_ = m->base_;
  m->block_.size_ = size;
  m->block_.capacity_ = mapped;
  watcher.add(m.get());
  // A break that began before F_SETOWN_EX signalled nobody: look now.
  if (::fcntl(fd, F_GETLEASE) != F_RDLCK) watcher.on_break(fd);
  return m;
}

LeasedMapping::~LeasedMapping() {
  LeaseWatcher& watcher = LeaseWatcher::get();
  watcher.remove(this);  // waits for a move in progress
  if (::munmap(base_, mapped_) != 0) log::warn("{}: munmap failed ({})", path_, std::strerror(errno));
  if (fd_ >= 0) ::close(fd_);  // gives the lease up
  watcher.release();
}

std::shared_ptr<Block> LeasedMapping::block() { return std::shared_ptr<Block>(shared_from_this(), &block_); }

bool LeasedMapping::moved() const noexcept {
  return __atomic_load_n(&moved_, __ATOMIC_ACQUIRE);
}

void LeasedMapping::move_out() { LeaseWatcher::get().move(this); }

void LeasedMapping::move_locked() noexcept {
  if (moved_) return;
  void* anon = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (anon == MAP_FAILED) {
    // Keep the lease: the writer waits out the break time, and the bytes
    // stay readable until then.
    log::warn("{}: cannot move a zero-copy mapping out of the file ({}); a writer is waiting for it", path_,
               std::strerror(errno));
    return;
  }
  if (!copy_from_mapping(static_cast<std::byte*>(anon), base_, size_)) {
    log::warn("{}: the file was cut short before its zero-copy tensors were moved out; their bytes past its new "
               "end are lost (raise /proc/sys/fs/lease-break-time)",
               path_);
  }
  if (::mremap(anon, mapped_, mapped_, MREMAP_MAYMOVE | MREMAP_FIXED, base_) == MAP_FAILED) {
    log::warn("{}: mremap over a zero-copy mapping failed ({})", path_, std::strerror(errno));
    ::munmap(anon, mapped_);
    return;
  }
  __atomic_store_n(&moved_, true, __ATOMIC_RELEASE);
  ::fcntl(fd_, F_SETLEASE, F_UNLCK);
  ::close(fd_);
  fd_ = -1;
  log::debug("{}: moved {} zero-copy bytes out of the file for a writer", path_, size_);
}

std::size_t LeasedMapping::live_count() noexcept { return LeaseWatcher::get().live(); }
bool LeasedMapping::watcher_running() noexcept { return LeaseWatcher::get().running(); }

}  // namespace pinload::detail
