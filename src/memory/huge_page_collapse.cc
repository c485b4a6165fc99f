#include "memory/huge_page_collapse.h"

#include <pthread.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <thread>

#include "base/madvise.h"

namespace pinload::detail {
namespace {

constexpr std::uintptr_t kHugePage = 2u << 20;
// No step starts until the process's reads have been quiet this long: loads
// in quick succession (a library of small files, one call each) are not
// slowed by collapses between them.
constexpr std::chrono::milliseconds kQuiet{1000};
using Clock = std::chrono::steady_clock;

}  // namespace

// The process's collapsing thread: started at the first job, never stopped
// (a step outlives no pool: IdleBlocks::forget waits for it). A fork waits
// for the step in progress; the child starts its own thread at its first
// job, and forgets the parent's queue.
class Collapser {
 public:
  struct Job {
    std::shared_ptr<IdleBlocks> blocks;
    std::byte* data;
    std::size_t bytes;
  };

  static Collapser& process() {
    static Collapser* collapser = [] {
      auto* c = new Collapser();  // never destroyed: its thread runs until exit
      ::pthread_atfork([] { process().before_fork(); }, [] { process().after_fork(false); },
                       [] { process().after_fork(true); });
      return c;
    }();
    return *collapser;
  }

  // Held across each step.
  std::mutex& step_mutex() { return step_mu_; }

  void push(Job job) {
    {
      std::lock_guard lock(mu_);
      jobs_.push_back(std::move(job));
      if (!started_) {
        started_ = true;
        std::thread([this] { run(); }).detach();
      }
    }
    wake_.notify_all();
  }

  void wait_idle() {
    std::unique_lock lock(mu_);
    idle_.wait(lock, [&] { return jobs_.empty() && !running_; });
  }

  void reads_began() {
    std::lock_guard lock(mu_);
    ++reads_;
  }
  void reads_ended() {
    {
      std::lock_guard lock(mu_);
      --reads_;
      last_read_ = Clock::now();
    }
    wake_.notify_all();
  }
  // Before each step: waits until no load has read for kQuiet.
  void wait_for_quiet() {
    std::unique_lock lock(mu_);
    for (;;) {
      if (reads_ > 0) {
        wake_.wait(lock, [&] { return reads_ == 0; });
        continue;
      }
      const Clock::time_point quiet = last_read_ + kQuiet;
      if (Clock::now() >= quiet) return;
      wake_.wait_until(lock, quiet);
    }
  }

 private:
  void before_fork() {
    mu_.lock();
    step_mu_.lock();
  }
  void after_fork(bool child) {
    if (child) {  // the thread is not here, nor the parent's readers
      jobs_.clear();
      started_ = running_ = false;
      reads_ = 0;
    }
    step_mu_.unlock();
    mu_.unlock();
  }

  void run() {
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mu_);
        running_ = false;
        idle_.notify_all();
        wake_.wait(lock, [&] { return !jobs_.empty(); });
        job = std::move(jobs_.front());
        jobs_.pop_front();
        running_ = true;
      }
      collapse(job);
      job.blocks.reset();
    }
  }

  static void collapse(const Job& job) {
    IdleBlocks& blocks = *job.blocks;
    const auto begin = (reinterpret_cast<std::uintptr_t>(job.data) + kHugePage - 1) & ~(kHugePage - 1);
    const auto end = (reinterpret_cast<std::uintptr_t>(job.data) + job.bytes) & ~(kHugePage - 1);
    for (std::uintptr_t at = begin; at < end; at += kHugePage) {
      process().wait_for_quiet();
      if (!blocks.step(job.data, job.bytes, reinterpret_cast<std::byte*>(at), at == begin)) return;
    }
    std::lock_guard lock(blocks.mu_);
    blocks.pending_.erase(job.data);  // collapsed: its next block starts as THP
  }

  std::mutex mu_;       // guards jobs_, started_, running_, reads_
  std::mutex step_mu_;  // held across each step
  std::condition_variable wake_, idle_;
  std::deque<Job> jobs_;
  bool started_ = false;
  bool running_ = false;
  unsigned reads_ = 0;  // ReadsInFlight held
  Clock::time_point last_read_{};  // when the last ReadsInFlight ended
};

void IdleBlocks::collapse_later(const std::shared_ptr<IdleBlocks>& blocks, std::byte* data, std::size_t bytes) {
  {
    std::lock_guard lock(blocks->mu_);
    if (blocks->closed_) return;
    blocks->pending_.insert(data);
  }
  Collapser::process().push({blocks, data, bytes});
}

bool IdleBlocks::take(std::byte* data) {
  std::lock_guard lock(mu_);
  return pending_.erase(data) > 0;
}

void IdleBlocks::forget(const std::byte* begin, const std::byte* end) {
  {
    std::lock_guard lock(mu_);
    pending_.erase(pending_.lower_bound(const_cast<std::byte*>(begin)), pending_.lower_bound(const_cast<std::byte*>(end)));
  }
  std::lock_guard wait_for_step(Collapser::process().step_mutex());
}

void IdleBlocks::close() {
  {
    std::lock_guard lock(mu_);
    closed_ = true;
    pending_.clear();
  }
  std::lock_guard wait_for_step(Collapser::process().step_mutex());
}

std::uint64_t IdleBlocks::collapsed_bytes() const {
  std::lock_guard lock(mu_);
  return collapsed_;
}

void IdleBlocks::wait_idle() { Collapser::process().wait_idle(); }

ReadsInFlight::ReadsInFlight() { Collapser::process().reads_began(); }
ReadsInFlight::~ReadsInFlight() { Collapser::process().reads_ended(); }

bool IdleBlocks::step(std::byte* data, std::size_t bytes, std::byte* at, bool first) {
  std::lock_guard step_lock(Collapser::process().step_mutex());
  {
    std::lock_guard lock(mu_);
    if (closed_ || !pending_.contains(data)) return false;  // handed out again, or being released
  }
  // FirstTouch advised the block MADV_NOHUGEPAGE, which MADV_COLLAPSE obeys.
  if (first && ::madvise(data, bytes, MADV_HUGEPAGE) != 0) return false;
  if (::madvise(at, kHugePage, kMadvCollapse) == 0) {
    std::lock_guard lock(mu_);
    collapsed_ += kHugePage;
    return true;
  }
  // EAGAIN: a page is pinned or busy; EINVAL: pages not present, or a kernel
  // without MADV_COLLAPSE (each step fails at once). ENOMEM: no huge page to
  // be had, so the rest would fail too.
  return errno == EAGAIN || errno == EINVAL;
}

}  // namespace pinload::detail
