// The plain-data parts of the page-cache commands (src/trace/): the recorder's
// each-byte-once merging, warm plans, burn-after-reading bookkeeping, and the
// reader's system call that tells a mapping from a read.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "trace/pre_content.h"
#include "trace/trace_recorder.h"
#include "trace/warm_plan.h"

namespace pinload::trace {
namespace {

TemplateFile file(const std::string& path, std::uint64_t size) { return TemplateFile{path, "", size, 1, 2, 3}; }

TemplateReader reader(std::uint32_t pid, const std::string& comm = "python3") {
  return TemplateReader{pid, comm, "/usr/bin/" + comm};
}

TEST(TraceRecorder, MergesContiguousReadsAndRecordsEachByteOnce) {
  TraceRecorder r;
  const TemplateFile a = file("/m/a", 10 * 4096), b = file("/m/b", 4096);
  r.add(a, 0, 4096, reader(7));
  r.add(a, 4096, 8192, reader(7));   // contiguous: extends
  r.add(a, 0, 8192, reader(7));      // read again: nothing new
  r.add(b, 0, 8192, reader(8));      // clipped to the file
  r.add(a, 2 * 4096, 4 * 4096, reader(7));  // half new
  r.add(a, 20 * 4096, 4096, reader(7));     // past the end: dropped
  r.add(a, 6 * 4096, 4096, reader(7), /*mapped=*/true);
  const IoTemplate t = r.result();
  ASSERT_EQ(t.files.size(), 2u);
  const TemplateReads* reads = t.find(kPageCacheDestination);
  ASSERT_NE(reads, nullptr);
  EXPECT_EQ(reads->reads, (std::vector<TemplateRead>{{0, 0, 3 * 4096, 0}, {1, 0, 4096, 1}, {0, 3 * 4096, 3 * 4096, 0}}));
  const TemplateReads* mapped = t.find(kMappedDestination);
  ASSERT_NE(mapped, nullptr);
  EXPECT_EQ(mapped->reads, (std::vector<TemplateRead>{{0, 6 * 4096, 4096, 0}}));
  EXPECT_EQ(r.bytes(), 7u * 4096);
  EXPECT_EQ(r.readers(), 2u);
  EXPECT_EQ(t.readers, (std::vector<TemplateReader>{reader(7), reader(8)}));
  // The bytes round-trip through the template format (version 2: it names readers).
  const std::vector<std::uint8_t> bytes = serialize_template(t);
  EXPECT_EQ(bytes[8], 2);
  const auto parsed = parse_template(bytes);
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->find(kPageCacheDestination)->reads, reads->reads);
  EXPECT_EQ(parsed->readers, t.readers);
}

TEST(TraceRecorder, MergesOnlyWithinOneReaderAndNamesTheFirst) {
  TraceRecorder r;
  const TemplateFile a = file("/m/a", 10 * 4096);
  r.add(a, 0, 4096, reader(7));
  r.add(a, 4096, 4096, reader(8, "cat"));         // abuts 7's read: another reader, another range
  r.add(a, 2 * 4096, 4096, reader(8, "cat"));     // extends 8's
  r.add(a, 0, 3 * 4096, reader(9, "dd"));         // all read before: nothing, 9 named nowhere
  r.add(a, 3 * 4096, 4096, reader(7, "python3"));  // 7 again, after 8: a new range
  r.add(a, 4 * 4096, 4096, reader(7, "cat"));     // pid 7 after an exec: a new reader
  const IoTemplate t = r.result();
  EXPECT_EQ(t.find(kPageCacheDestination)->reads,
            (std::vector<TemplateRead>{{0, 0, 4096, 0}, {0, 4096, 2 * 4096, 1}, {0, 3 * 4096, 4096, 0}, {0, 4 * 4096, 4096, 2}}));
  EXPECT_EQ(t.readers, (std::vector<TemplateReader>{reader(7), reader(8, "cat"), reader(7, "cat")}));
  EXPECT_EQ(r.readers(), 4u);  // seen, including 9, whose reads added nothing
}

TEST(WarmPlan, ReadsThenMappingsOfUnreadFilesInPieces) {
  IoTemplate t;
  t.files = {file("/m/a", 10 << 20), file("/m/b", 3 << 20)};
  t.set(TemplateReads{std::string(kPageCacheDestination), {{0, 1 << 20, 5 << 20}, {0, 0, 2 << 20}}});
  t.set(TemplateReads{std::string(kMappedDestination), {{0, 0, 10 << 20}, {1, 0, 3 << 20}}});
  const WarmPlan plan = plan_from_template(t, 4 << 20);
  // a: [1M, 6M) in two pieces, then [0, 1M) (the overlap read once); b mapped only.
  ASSERT_EQ(plan.files.size(), 2u);
  EXPECT_EQ(plan.pieces, (std::vector<WarmPiece>{{0, 1 << 20, 4 << 20}, {0, 5 << 20, 1 << 20}, {0, 0, 1 << 20},
                                                 {1, 0, 3 << 20}}));
  EXPECT_EQ(plan.bytes, 9u << 20);
}

TEST(WarmPlan, PinloadTemplatesAndWholeFiles) {
  IoTemplate t;
  t.files = {file("/m/a", 8192)};
  t.set(TemplateReads{"cuda:0", {{0, 4096, 4096}}});
  t.set(TemplateReads{std::string(kHostDestination), {{0, 0, 4096}}});
  EXPECT_EQ(plan_from_template(t).pieces, (std::vector<WarmPiece>{{0, 0, 4096}}));
  EXPECT_EQ(plan_whole_files({file("/m/a", 5), file("/m/b", 0)}, 4).pieces,
            (std::vector<WarmPiece>{{0, 0, 4}, {0, 4, 1}}));
}

TEST(BurnTracker, DropsAPieceReadWholeOnceTheConsumerMovesOn) {
  WarmPlan plan;
  plan.files = {file("/m/a", 12 << 20)};
  plan.pieces = {{0, 0, 4 << 20}, {0, 4 << 20, 4 << 20}, {0, 8 << 20, 4 << 20}};
  BurnTracker burn(plan);
  burn.on_warmed(0);
  burn.on_warmed(1);
  EXPECT_EQ(burn.resident_bytes(), 8u << 20);
  EXPECT_TRUE(burn.on_consumer_read(0, 0, 2 << 20).empty());
  EXPECT_TRUE(burn.on_consumer_read(0, 2 << 20, 2 << 20).empty());  // piece 0 done; its read may still run
  EXPECT_TRUE(burn.touched(0));
  EXPECT_FALSE(burn.touched(2));
  EXPECT_EQ(burn.on_consumer_read(0, 4 << 20, 1 << 20), (std::vector<std::size_t>{0}));  // moved on: drop 0
  EXPECT_EQ(burn.resident_bytes(), 4u << 20);
  EXPECT_EQ(burn.dropped_bytes(), 4u << 20);
  EXPECT_TRUE(burn.on_consumer_read(0, 9 << 20, 1 << 20).empty());  // 1 not finished: kept
  EXPECT_TRUE(burn.touched(2));  // the consumer reached 2 first: the warmer skips it
  EXPECT_TRUE(burn.on_consumer_read(7, 0, 1).empty());  // another file: ignored
}

pid_t current_tid() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

TEST(BlockedSyscall, AThreadBlockedInAReadIsInRead) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  std::atomic<pid_t> tid{0};
  std::thread reader([&] {
    tid = current_tid();
    char c;
    (void)!::read(pipe_fds[0], &c, 1);
  });
  while (tid == 0) std::this_thread::yield();
  long call = kSyscallUnknown;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (call != SYS_read && std::chrono::steady_clock::now() < deadline) call = blocked_syscall(tid);
  EXPECT_EQ(call, SYS_read);
  (void)!::write(pipe_fds[1], "x", 1);
  reader.join();
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
}

// A page fault on a mapping (held here by userfaultfd) is outside any system
// call: the listener counts its event as the mapping's.
TEST(BlockedSyscall, AThreadBlockedInAPageFaultIsOutsideSystemCalls) {
  const int uffd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC));
  if (uffd < 0) GTEST_SKIP() << "userfaultfd: " << std::strerror(errno);
  uffdio_api api{.api = UFFD_API, .features = 0, .ioctls = 0};
  ASSERT_EQ(::ioctl(uffd, UFFDIO_API, &api), 0);
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  void* area = ::mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(area, MAP_FAILED);
  uffdio_register reg{.range = {reinterpret_cast<std::uint64_t>(area), page}, .mode = UFFDIO_REGISTER_MODE_MISSING,
                      .ioctls = 0};
  ASSERT_EQ(::ioctl(uffd, UFFDIO_REGISTER, &reg), 0);
  std::atomic<pid_t> tid{0};
  std::thread toucher([&] {
    tid = current_tid();
    EXPECT_EQ(*static_cast<volatile char*>(area), 0);
  });
  while (tid == 0) std::this_thread::yield();
  long call = kSyscallUnknown;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (call != kOutsideSyscalls && std::chrono::steady_clock::now() < deadline) call = blocked_syscall(tid);
  EXPECT_EQ(call, kOutsideSyscalls);
  uffdio_zeropage zero{.range = {reinterpret_cast<std::uint64_t>(area), page}, .mode = 0, .zeropage = 0};
  EXPECT_EQ(::ioctl(uffd, UFFDIO_ZEROPAGE, &zero), 0);
  ::ioctl(uffd, UFFDIO_UNREGISTER, &reg.range);  // wakes the toucher whatever happened
  toucher.join();
  ::munmap(area, page);
  ::close(uffd);
}

// /proc/<tid>/syscall says "running" for a thread on a CPU; parsed as a
// number that was 0, which is read(2) on x86-64: a mapping's event taken
// for a read.
TEST(BlockedSyscall, ARunningThreadIsUnknownNotARead) {
  std::atomic<bool> stop{false};
  std::atomic<pid_t> tid{0};
  std::thread spinner([&] {
    tid = current_tid();
    while (!stop.load(std::memory_order_relaxed)) {
    }
  });
  while (tid == 0) std::this_thread::yield();
  EXPECT_EQ(blocked_syscall(tid), kSyscallUnknown);
  stop = true;
  spinner.join();
  EXPECT_EQ(blocked_syscall(tid), kSyscallUnknown);  // gone
}

}  // namespace
}  // namespace pinload::trace
