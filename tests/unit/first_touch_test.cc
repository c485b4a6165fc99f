// Tests of the first touch of fresh pool memory (Note [Page size of fresh
// memory] in src/memory/first_touch.h): the page-size choice, what the
// readers ask of the kernel, and that loads fault their fresh blocks in
// before writing them.
#include "memory/first_touch.h"
#include "memory/huge_page_collapse.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "file_check.h"
#include "pinload/loader.h"
#include "pinload/pool.h"
#include "test_files.h"

namespace pinload {
namespace {

using detail::FirstTouch;
using PageSize = FirstTouch::PageSize;

constexpr std::size_t MiB = 1u << 20;
constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE

// `bytes` taking the time that `gbps` gives them.
void record_at(FirstTouch& policy, PageSize size, double gbps, std::size_t bytes = 8 * MiB) {
  policy.record(size, bytes, static_cast<double>(bytes) / (gbps * 1e9));
}

bool resident(const void* address, std::size_t bytes) {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((bytes + page - 1) / page);
  if (::mincore(const_cast<void*>(address), bytes, vec.data()) != 0) return false;
  for (unsigned char v : vec) {
    if ((v & 1) == 0) return false;
  }
  return true;
}

// Records page_resident and advise calls; `populate_result` replaces the
// populate's result where nonzero, `resident_result` mincore's where >= -1000.
class RecordingEnv : public EnvWrapper {
 public:
  struct Advice {
    void* address;
    std::size_t bytes;
    int advice;
  };
  using EnvWrapper::EnvWrapper;

  int advise(void* address, std::size_t bytes, int advice) override {
    {
      std::lock_guard lock(mu_);
      advices_.push_back({address, bytes, advice});
    }
    if (advice == kPopulateWrite && populate_result != 0) return populate_result;
    return EnvWrapper::advise(address, bytes, advice);
  }
  int page_resident(const void* address) override {
    ++resident_calls;
    return resident_result >= -1000 ? resident_result : EnvWrapper::page_resident(address);
  }
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    {
      std::lock_guard lock(mu_);
      reads_.push_back({buffer, bytes, resident(buffer, 1)});
    }
    return EnvWrapper::pread(fd, buffer, bytes, offset);
  }

  std::vector<Advice> advices(int advice) const {
    std::lock_guard lock(mu_);
    std::vector<Advice> out;
    for (const Advice& a : advices_) {
      if (a.advice == advice) out.push_back(a);
    }
    return out;
  }
  // Whether every read of a chunk (64 KiB or more; not the header's small
  // reads into the stack or heap) found its destination's first page present.
  bool every_chunk_read_into_present_memory() const {
    std::lock_guard lock(mu_);
    std::size_t chunks = 0;
    for (const Read& r : reads_) {
      if (r.bytes < 64 * 1024) continue;
      ++chunks;
      if (!r.present) {
        std::fprintf(stderr, "read of %zu bytes into %p: memory not faulted in first\n", r.bytes, r.buffer);
        return false;
      }
    }
    return chunks > 0;
  }

  int populate_result = 0;
  int resident_result = -10000;
  std::atomic<int> resident_calls{0};

 private:
  struct Read {
    void* buffer;
    std::size_t bytes;
    bool present;
  };
  mutable std::mutex mu_;
  std::vector<Advice> advices_;
  std::vector<Read> reads_;
};

// A field of /proc/self/smaps for the mapping holding `address` (the number
// after `field`, e.g. "THPeligible:" or "AnonHugePages:" in kB); -1 where
// smaps does not say.
long smaps_value(const void* address, const char* field) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  const std::string name = field;
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    const bool header = line.find('-') < line.find(' ') && std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2;
    if (header) {
      inside = at >= lo && at < hi;
      continue;
    }
    if (inside && line.rfind(name, 0) == 0) return std::atol(line.c_str() + name.size());
  }
  return -1;
}

// Whether the kernel may back the mapping holding `address` with huge pages.
int thp_eligible(const void* address) { return static_cast<int>(smaps_value(address, "THPeligible:")); }

// Whether this kernel collapses memory into huge pages (MADV_COLLAPSE, 6.1).
bool kernel_collapses() {
  const std::size_t bytes = 4 * MiB;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  auto* aligned = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(p) + 2 * MiB - 1) & ~(2 * MiB - 1));
  std::memset(aligned, 1, 2 * MiB);
  const bool ok = ::madvise(aligned, 2 * MiB, 25 /* MADV_COLLAPSE */) == 0;
  ::munmap(p, bytes);
  return ok;
}

class FirstTouchTest : public ::testing::Test {
 protected:
  void SetUp() override { ::unsetenv(FirstTouch::kPagesVariable); }
  void TearDown() override { ::unsetenv(FirstTouch::kPagesVariable); }
  std::shared_ptr<Pool> host_pool() { return Pool::create(make_locked_memory_backend(default_env(), kHostPoolMemory)); }
  // Two readers, 1 MiB chunks, every chunk pread into pool memory.
  static LoadOptions pread_options() {
    LoadOptions options;
    options.threads = 2;
    options.block_size = 1 * MiB;
    options.direct = DirectIo::kOff;
    options.cached_read = CachedRead::kPread;
    options.zero_copy = ZeroCopy::kOff;
    return options;
  }
};

TEST_F(FirstTouchTest, HugePagesStayWhileTheyArriveFast) {
  FirstTouch policy;
  EXPECT_EQ(policy.choice(), PageSize::kHuge);  // nothing measured yet
  for (int i = 0; i < 10; ++i) record_at(policy, PageSize::kHuge, 5.0);
  EXPECT_EQ(policy.choice(), PageSize::kHuge);
  EXPECT_NEAR(policy.rate(PageSize::kHuge), 5e9, 1e6);
  EXPECT_EQ(policy.rate(PageSize::kSmall), 0);
}

TEST_F(FirstTouchTest, SlowHugePagesTrySmallPagesAndKeepTheFaster) {
  FirstTouch policy;
  record_at(policy, PageSize::kHuge, 0.3);
  EXPECT_EQ(policy.choice(), PageSize::kSmall);  // below kSlowHugePages: explore
  record_at(policy, PageSize::kSmall, 3.0);
  EXPECT_EQ(policy.choice(), PageSize::kSmall);  // faster than huge pages were
  for (int i = 0; i < 20 && policy.choice() == PageSize::kSmall; ++i) record_at(policy, PageSize::kSmall, 0.1);
  EXPECT_EQ(policy.choice(), PageSize::kHuge);  // small pages fell below huge pages' rate
  EXPECT_LT(policy.rate(PageSize::kSmall), policy.rate(PageSize::kHuge));
}

// Memory the host has not taken back yet arrives first and fast; a few such
// chunks must not hide that the rest arrives slowly.
TEST_F(FirstTouchTest, AFewFastChunksDoNotSettleTheChoice) {
  FirstTouch policy;
  for (int i = 0; i < 4; ++i) record_at(policy, PageSize::kHuge, 7.0);
  int slow = 0;
  while (policy.choice() == PageSize::kHuge && slow < 50) {
    record_at(policy, PageSize::kHuge, 0.25);
    ++slow;
  }
  EXPECT_EQ(policy.choice(), PageSize::kSmall);
  EXPECT_LE(slow, 12);
}

TEST_F(FirstTouchTest, TheEnvironmentVariableForcesAPageSize) {
  ::setenv(FirstTouch::kPagesVariable, "small", 1);
  FirstTouch small;
  EXPECT_EQ(small.choice(), PageSize::kSmall);
  ::setenv(FirstTouch::kPagesVariable, "huge", 1);
  FirstTouch huge;
  record_at(huge, PageSize::kHuge, 0.1);
  EXPECT_EQ(huge.choice(), PageSize::kHuge);
  ::setenv(FirstTouch::kPagesVariable, "sideways", 1);  // warns, measures
  FirstTouch measured;
  record_at(measured, PageSize::kHuge, 0.1);
  EXPECT_EQ(measured.choice(), PageSize::kSmall);
}

TEST_F(FirstTouchTest, FaultsAFreshChunkInOnceAndMeasuresIt) {
  RecordingEnv env(default_env());
  FirstTouch policy;
  const auto pool = host_pool();
  const auto block = pool->allocate(16 * MiB);
  ASSERT_FALSE(block->locked());
  ASSERT_FALSE(resident(block->data(), 8 * MiB));
  policy.fault_in(&env, *block, block->data(), 8 * MiB);
  const auto populates = env.advices(kPopulateWrite);
  ASSERT_EQ(populates.size(), 1u);
  EXPECT_EQ(populates[0].address, block->data());
  EXPECT_EQ(populates[0].bytes, 8 * MiB);
  EXPECT_TRUE(resident(block->data(), 8 * MiB));
  EXPECT_GT(policy.rate(PageSize::kHuge), 0);  // measured as the pool's default page size
  // Present now: one mincore, no second populate.
  policy.fault_in(&env, *block, block->data() + 4096, 1 * MiB);
  EXPECT_EQ(env.advices(kPopulateWrite).size(), 1u);
  EXPECT_EQ(env.resident_calls.load(), 2);
  // The bytes are zeros, as fresh memory is.
  std::vector<std::byte> zeros(8 * MiB);
  EXPECT_EQ(std::memcmp(block->data(), zeros.data(), zeros.size()), 0);
}

TEST_F(FirstTouchTest, SmallPagesAdviseTheWholeBlockOnce) {
  RecordingEnv env(default_env());
  FirstTouch policy;
  record_at(policy, PageSize::kHuge, 0.2);  // huge pages measured slow here
  ASSERT_EQ(policy.choice(), PageSize::kSmall);
  const auto pool = host_pool();
  const auto block = pool->allocate(32 * MiB);
  policy.fault_in(&env, *block, block->data(), 8 * MiB);
  policy.fault_in(&env, *block, block->data() + 16 * MiB, 8 * MiB);
  const auto no_huge = env.advices(MADV_NOHUGEPAGE);
  ASSERT_EQ(no_huge.size(), 1u);
  EXPECT_EQ(no_huge[0].address, block->data());
  EXPECT_EQ(no_huge[0].bytes, block->capacity());
  EXPECT_EQ(env.advices(kPopulateWrite).size(), 2u);
  EXPECT_GT(policy.rate(PageSize::kSmall), 0);
  const int eligible = thp_eligible(block->data() + 24 * MiB);
  if (eligible >= 0) {
    EXPECT_EQ(eligible, 0) << "the block's mapping may still take huge pages";
  }
}

TEST_F(FirstTouchTest, LockedBlocksAndUnknownResidencyAreLeftAlone) {
  RecordingEnv env(default_env());
  FirstTouch policy;
  const auto locked_pool = Pool::create(make_locked_memory_backend(default_env(), {}));
  const auto locked = locked_pool->allocate(4 * MiB);
  if (locked->locked()) {
    policy.fault_in(&env, *locked, locked->data(), 4 * MiB);
    EXPECT_EQ(env.resident_calls.load(), 0);
  }
  const auto pool = host_pool();
  const auto block = pool->allocate(4 * MiB);
  env.resident_result = -ENOSYS;
  policy.fault_in(&env, *block, block->data(), 4 * MiB);
  EXPECT_EQ(env.advices(kPopulateWrite).size(), 0u);
  EXPECT_FALSE(resident(block->data(), 4 * MiB));
}

// Before Linux 5.14 there is no MADV_POPULATE_WRITE: asked once, then never again.
TEST_F(FirstTouchTest, AKernelWithoutPopulateIsAskedOnce) {
  RecordingEnv env(default_env());
  env.populate_result = -EINVAL;
  FirstTouch policy;
  const auto pool = host_pool();
  const auto block = pool->allocate(16 * MiB);
  policy.fault_in(&env, *block, block->data(), 4 * MiB);
  policy.fault_in(&env, *block, block->data() + 8 * MiB, 4 * MiB);
  EXPECT_EQ(env.advices(kPopulateWrite).size(), 1u);
  EXPECT_EQ(policy.rate(PageSize::kHuge), 0);
  std::memset(block->data(), 1, 16 * MiB);  // the writes fault it in themselves
}

// A load into a host pool's fresh memory faults each chunk's destination in
// before reading into it (a populate, or a neighbour's huge page), and the
// bytes are the file's.
TEST_F(FirstTouchTest, ALoadFaultsEachFreshChunkInBeforeReadingIt) {
  const std::string dir = ::testing::TempDir() + "/first_touch_test." + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  std::mt19937_64 rng(7);
  const testing::FileImage image = testing::make_image(
      {{"a.weight", "F16", {1024, 1536}}, {"b.weight", "F32", {512, 1024}}, {"c.bias", "BF16", {1000}}}, rng);
  testing::write_file(path, image.bytes());
  RecordingEnv env(default_env());
  const LoadOptions options = pread_options();
  const Loader loader(options, host_pool(), &env);
  const StateDict sd = loader.load({path});
  testing::expect_matches_file(sd, path, image);
  EXPECT_TRUE(env.every_chunk_read_into_present_memory());
  EXPECT_GE(env.advices(kPopulateWrite).size(), 1u);  // fewer than the chunks where a huge page covers two
  std::filesystem::remove_all(dir);
}

// A conversion on load writes its output block from the readers' stores:
// that block's fresh memory is faulted in first too, and the values are
// torch's (bf16 of fp32 by round to nearest even, checked here on values that
// need no rounding: the high halves).
TEST_F(FirstTouchTest, AConversionFaultsItsFreshOutputInFirst) {
  const std::string dir = ::testing::TempDir() + "/first_touch_test.c." + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  const std::size_t elements = 1u << 20;  // 4 MiB of fp32, 2 MiB of bf16
  std::vector<std::uint8_t> data(elements * 4);
  std::mt19937 rng(3);
  for (std::size_t i = 0; i < elements; ++i) {
    const std::uint32_t bits = (rng() & 0x3fff0000u) | 0x3f000000u;  // exact in bf16: low half zero
    std::memcpy(data.data() + i * 4, &bits, 4);
  }
  const std::string n = std::to_string(elements);
  testing::write_file(path, testing::raw_file("{\"w\":{\"dtype\":\"F32\",\"shape\":[" + n +
                                                  "],\"data_offsets\":[0," + std::to_string(elements * 4) + "]}}",
                                              data));
  RecordingEnv env(default_env());
  LoadOptions options = pread_options();
  options.dtype.to = DType::kBF16;
  const Loader loader(options, host_pool(), &env);
  const StateDict sd = loader.load({path});
  const Tensor& w = sd.at("w");
  ASSERT_EQ(w.dtype(), DType::kBF16);
  ASSERT_EQ(w.nbytes(), elements * 2);
  for (std::size_t i = 0; i < elements; i += 4099) {
    std::uint16_t got = 0;
    std::memcpy(&got, w.data() + i * 2, 2);
    std::uint32_t stored = 0;
    std::memcpy(&stored, data.data() + i * 4, 4);
    ASSERT_EQ(got, stored >> 16) << "element " << i;
  }
  // Some populate reached the output. Not necessarily one at its first byte:
  // a later chunk's populate, converted first, may fault in a huge page that
  // covers it.
  bool output_populated = false;
  for (const RecordingEnv::Advice& a : env.advices(kPopulateWrite)) {
    auto* lo = static_cast<const std::byte*>(a.address);
    output_populated |= lo < w.data() + w.nbytes() && w.data() < lo + a.bytes;
  }
  EXPECT_TRUE(output_populated) << "the output was written without a populate";
  std::filesystem::remove_all(dir);
}

// A block first touched in 4 KiB pages: its memory while it is idle.
class IdleCollapseTest : public FirstTouchTest {
 protected:
  void SetUp() override {
    FirstTouchTest::SetUp();
    if (!kernel_collapses()) GTEST_SKIP() << "no MADV_COLLAPSE here (Linux 6.1)";
    record_at(policy_, PageSize::kHuge, 0.2);  // huge pages measured slow: 4 KiB chosen
    ASSERT_EQ(policy_.choice(), PageSize::kSmall);
  }
  // A block of `bytes` faulted in by the policy and filled with `seed`'s bytes.
  std::shared_ptr<Block> small_block(Pool& pool, std::size_t bytes, unsigned seed) {
    auto block = pool.allocate(bytes);
    policy_.fault_in(default_env(), *block, block->data(), bytes);
    EXPECT_EQ(thp_eligible(block->data()), 0);
    fill(*block, seed);
    return block;
  }
  static void fill(const Block& block, unsigned seed) {
    std::mt19937 rng(seed);
    for (std::size_t i = 0; i < block.size(); i += 4) {
      const std::uint32_t v = rng();
      std::memcpy(block.data() + i, &v, 4);
    }
  }
  static bool holds(const Block& block, unsigned seed) {
    std::mt19937 rng(seed);
    for (std::size_t i = 0; i < block.size(); i += 4) {
      const std::uint32_t v = rng();
      if (std::memcmp(block.data() + i, &v, 4) != 0) return false;
    }
    return true;
  }
  FirstTouch policy_;
};

// Released to its pool, the block collapses into huge pages in the
// background, and its bytes stay as they were.
TEST_F(IdleCollapseTest, AnIdleBlockInSmallPagesIsCollapsedIntoHugePages) {
  const auto pool = host_pool();
  auto block = small_block(*pool, 16 * MiB, 1);
  std::byte* const data = block->data();
  EXPECT_EQ(smaps_value(data, "AnonHugePages:"), 0);
  block.reset();
  detail::IdleBlocks::wait_idle();
  EXPECT_GE(pool->stats().collapsed_bytes, 16 * MiB);
  block = pool->allocate(16 * MiB);
  ASSERT_EQ(block->data(), data);  // the free list's block
  EXPECT_TRUE(holds(*block, 1));
  EXPECT_EQ(thp_eligible(data), 1);
  EXPECT_GE(smaps_value(data, "AnonHugePages:"), 16 * 1024);
}

// A block handed out again before its collapse is done stops it, and
// resumes at its next release; trim and a pool's end wait for a step in
// progress, and a pool that trims or goes never collapses freed memory.
TEST_F(IdleCollapseTest, ReuseStopsTheCollapseAndTheNextReleaseResumesIt) {
  auto pool = host_pool();
  auto block = small_block(*pool, 64 * MiB, 2);
  std::byte* const data = block->data();
  block.reset();
  block = pool->allocate(64 * MiB);  // at once: likely before the collapse ends
  ASSERT_EQ(block->data(), data);
  EXPECT_TRUE(holds(*block, 2));
  fill(*block, 3);
  block.reset();
  detail::IdleBlocks::wait_idle();
  EXPECT_GE(smaps_value(data, "AnonHugePages:"), 64 * 1024);
  block = pool->allocate(64 * MiB);
  ASSERT_EQ(block->data(), data);
  EXPECT_TRUE(holds(*block, 3));
  block.reset();
  // Released, then at once trimmed; another released as its pool goes.
  block = small_block(*pool, 32 * MiB, 4);
  block.reset();
  pool->trim();
  EXPECT_EQ(pool->stats().reserved_bytes, 0u);
  block = small_block(*pool, 32 * MiB, 5);
  block.reset();
  pool.reset();
  detail::IdleBlocks::wait_idle();
}

// While a load reads, no step starts; the collapse goes on once it ends.
TEST_F(IdleCollapseTest, NoStepWhileALoadReads) {
  const auto pool = host_pool();
  auto block = small_block(*pool, 16 * MiB, 8);
  {
    const detail::ReadsInFlight reading;
    block.reset();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // 16 MiB collapse in well under this
    EXPECT_EQ(pool->stats().collapsed_bytes, 0u);
  }
  detail::IdleBlocks::wait_idle();
  EXPECT_GE(pool->stats().collapsed_bytes, 16 * MiB);
}

// A fork while a collapse is queued: the child's pools end without waiting
// on the parent's thread, and the child collapses its own idle blocks.
TEST_F(IdleCollapseTest, AForkedChildCollapsesOnItsOwn) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "TSan does not start threads after a multi-threaded fork";
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
  GTEST_SKIP() << "TSan does not start threads after a multi-threaded fork";
#endif
#endif
  auto pool = host_pool();
  auto block = small_block(*pool, 64 * MiB, 6);
  block.reset();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(60);  // a deadlock fails the test, not the run
    pool.reset();
    auto own = host_pool();
    auto b = small_block(*own, 16 * MiB, 7);
    b.reset();
    detail::IdleBlocks::wait_idle();
    ::_exit(own->stats().collapsed_bytes >= 16 * MiB ? 0 : 3);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  // The parent's steps on pages it shared with the child failed (EAGAIN);
  // its block is as it was.
  detail::IdleBlocks::wait_idle();
  block = pool->allocate(64 * MiB);
  EXPECT_TRUE(holds(*block, 6));
}

TEST_F(FirstTouchTest, ForcedSmallPagesAreNotCollapsed) {
  EXPECT_TRUE(FirstTouch().collapses_idle_memory());
  ::setenv(FirstTouch::kPagesVariable, "small", 1);
  EXPECT_FALSE(FirstTouch().collapses_idle_memory());
  ::setenv(FirstTouch::kPagesVariable, "huge", 1);
  EXPECT_TRUE(FirstTouch().collapses_idle_memory());
}

}  // namespace
}  // namespace pinload
