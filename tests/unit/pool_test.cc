// Tests of the two-level pinned-memory pool (pinload/pool.h).
#include "pinload/pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "fault_env.h"
#include "pinload/error.h"
#include "pinload/host_memory.h"

namespace pinload {
namespace {

using testing::FaultEnv;
using testing::Faults;
using Clock = std::chrono::steady_clock;

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

// Delegates to a locked backend; records reserve() sizes and can hold the
// next reserve() at a gate, then fail it or let it through.
class TestBackend final : public HostMemoryBackend {
 public:
  explicit TestBackend(Env* env) : inner_(make_locked_memory_backend(env)) {}

  HostRange reserve(std::size_t bytes) override {
    {
      std::unique_lock lock(mu_);
      sizes_.push_back(bytes);
      if (gate_armed_) {
        gate_armed_ = false;
        at_gate_ = true;
        cv_.notify_all();
        cv_.wait(lock, [&] { return gate_open_; });
        if (gate_fails_) throw OutOfMemoryError("test backend refused");
      }
    }
    return inner_->reserve(bytes);
  }
  void release(const HostRange& range) noexcept override { inner_->release(range); }
  std::size_t alignment() const noexcept override { return inner_->alignment(); }
  std::string_view name() const noexcept override { return "test"; }

  // The next reserve() waits for open_gate(), then throws if `fail`.
  void arm_gate(bool fail) {
    std::lock_guard lock(mu_);
    gate_armed_ = true;
    gate_fails_ = fail;
  }
  bool wait_at_gate() {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return at_gate_; });
  }
  void open_gate() {
    std::lock_guard lock(mu_);
    gate_open_ = true;
    cv_.notify_all();
  }
  std::vector<std::size_t> sizes() const {
    std::lock_guard lock(mu_);
    return sizes_;
  }

 private:
  std::unique_ptr<HostMemoryBackend> inner_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::size_t> sizes_;
  bool gate_armed_ = false, gate_fails_ = false, at_gate_ = false, gate_open_ = false;
};

// Fills a block with a pattern derived from `seed`, and checks it.
void stamp(Block& b, std::uint8_t seed) {
  std::memset(b.data(), seed, std::min<std::size_t>(b.size(), 64));
  std::memset(b.data() + b.size() - std::min<std::size_t>(b.size(), 64), seed ^ 0x5a,
              std::min<std::size_t>(b.size(), 64));
}
bool stamped(const Block& b, std::uint8_t seed) {
  const std::size_t n = std::min<std::size_t>(b.size(), 64);
  for (std::size_t i = 0; i < n; ++i) {
    if (b.data()[b.size() - n + i] != std::byte(seed ^ 0x5a)) return false;
  }
  // When the block is shorter than 128 bytes the tail stamp overwrote the head.
  if (b.size() >= 128) {
    for (std::size_t i = 0; i < n; ++i) {
      if (b.data()[i] != std::byte(seed)) return false;
    }
  }
  return true;
}

// ---- size classes ----

TEST(SizeClassTest, SmallRequestsRoundUpToFourKiBGranules) {
  EXPECT_EQ(Pool::size_class(1), 4 * KiB);
  EXPECT_EQ(Pool::size_class(4 * KiB), 4 * KiB);
  EXPECT_EQ(Pool::size_class(4 * KiB + 1), 8 * KiB);
  EXPECT_EQ(Pool::size_class(60 * KiB + 1), 64 * KiB);
  EXPECT_EQ(Pool::size_class(64 * KiB), 64 * KiB);
  EXPECT_EQ(Pool::size_class(64 * KiB + 1), 72 * KiB);  // 8 classes per power of two above
}

TEST(SizeClassTest, FourGigabytesNeverCostsEight) {
  const std::size_t gb4 = 4'000'000'000;
  EXPECT_GE(Pool::size_class(gb4), gb4);
  EXPECT_LT(Pool::size_class(gb4), 4'600'000'000u);
  EXPECT_EQ(Pool::size_class(std::size_t{4} << 30), std::size_t{4} << 30);
  EXPECT_LT(Pool::size_class((std::size_t{4} << 30) + 1), 4'600'000'000u + 300'000'000u);
}

TEST(SizeClassTest, MonotonicGranularAndWithinOneEighth) {
  std::size_t prev = 0;
  for (std::size_t n = 1; n <= 4 * MiB; n += (n < 256 * KiB ? 1 : 61)) {
    const std::size_t c = Pool::size_class(n);
    ASSERT_GE(c, n);
    ASSERT_GE(c, prev) << n;
    ASSERT_EQ(c % (4 * KiB), 0u) << n;
    if (n > 64 * KiB) {
      ASSERT_LE(c - n, n / 8) << n;
    }
    ASSERT_EQ(Pool::size_class(c), c) << n;
    prev = c;
  }
  std::mt19937_64 rng(7);
  std::vector<std::size_t> sample;
  for (int shift = 17; shift < 62; ++shift) {
    for (int i = 0; i < 200; ++i) sample.push_back((std::size_t{1} << shift) + rng() % (std::size_t{1} << shift));
  }
  std::sort(sample.begin(), sample.end());
  prev = 0;
  for (std::size_t n : sample) {
    const std::size_t c = Pool::size_class(n);
    ASSERT_GE(c, n);
    ASSERT_GE(c, prev) << n;
    ASSERT_LE(c - n, n / 8) << n;
    prev = c;
  }
}

TEST(SizeClassTest, HugeRequestsNeverWrapToSmallClasses) {
  const std::size_t max = std::numeric_limits<std::size_t>::max();
  for (std::size_t n : {max, max - 1, max / 2 + 2, (max >> 3) * 7}) EXPECT_GE(Pool::size_class(n), n) << n;
}

// ---- blocks, reuse, stats ----

class PoolTest : public ::testing::Test {
 protected:
  std::shared_ptr<Pool> make(PoolOptions options = {}) {
    return Pool::create(make_locked_memory_backend(&env_), options);
  }
  FaultEnv env_;
};

TEST_F(PoolTest, BlocksArePageAlignedWritableAndCounted) {
  auto pool = make();
  auto a = pool->allocate(10'000);
  auto b = pool->allocate(100 * KiB + 3);
  EXPECT_EQ(a->size(), 10'000u);
  EXPECT_EQ(a->capacity(), Pool::size_class(10'000));
  EXPECT_EQ(b->capacity(), Pool::size_class(100 * KiB + 3));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a->data()) % 4096, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 4096, 0u);
  std::memset(a->data(), 0xab, a->size());
  std::memset(b->data(), 0xcd, b->size());
  EXPECT_EQ(a->data()[9'999], std::byte{0xab});
  EXPECT_EQ(b->data()[0], std::byte{0xcd});

  PoolStats s = pool->stats();
  EXPECT_EQ(s.live_blocks, 2u);
  EXPECT_EQ(s.in_use_bytes, a->capacity() + b->capacity());
  EXPECT_EQ(s.allocations, 2u);
  EXPECT_GE(s.reserved_bytes, s.in_use_bytes);
  EXPECT_EQ(s.os_reservations, 2u);  // a slab per small class
  a.reset();
  b.reset();
  s = pool->stats();
  EXPECT_EQ(s.live_blocks, 0u);
  EXPECT_EQ(s.in_use_bytes, 0u);
}

TEST_F(PoolTest, SmallBlocksOfOneClassShareASlab) {
  auto pool = make();
  std::vector<std::shared_ptr<Block>> blocks;
  std::set<std::byte*> addresses;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(pool->allocate(4 * KiB));
    addresses.insert(blocks.back()->data());
  }
  EXPECT_EQ(addresses.size(), 16u);
  EXPECT_EQ(pool->stats().os_reservations, 1u);
  EXPECT_EQ(pool->stats().reserved_bytes, pool->options().slab_bytes);
}

TEST_F(PoolTest, ReallocationAfterFreeMakesNoNewReservation) {
  auto pool = make();
  const std::vector<std::size_t> sizes = {1, 5'000, 70'000, 1 * MiB + 1, 3 * MiB, 20 * MiB + 17};
  std::vector<std::shared_ptr<Block>> blocks;
  for (std::size_t n : sizes) blocks.push_back(pool->allocate(n));
  blocks.clear();
  const PoolStats before = pool->stats();
  for (std::size_t n : sizes) blocks.push_back(pool->allocate(n));
  const PoolStats after = pool->stats();
  EXPECT_EQ(after.os_reservations, before.os_reservations);
  EXPECT_EQ(after.reserved_bytes, before.reserved_bytes);
  EXPECT_EQ(after.free_list_hits, before.free_list_hits + sizes.size());
  EXPECT_EQ(after.allocations, 2 * sizes.size());
}

TEST_F(PoolTest, SlightlyLargerRequestReusesFreedBlock) {
  // 2.8 GB then 2.9 GB, scaled down 100x.
  auto pool = make();
  auto first = pool->allocate(28'000'000);
  std::byte* address = first->data();
  first.reset();
  const PoolStats before = pool->stats();
  auto second = pool->allocate(29'000'000);
  EXPECT_EQ(second->data(), address);
  EXPECT_EQ(pool->stats().os_reservations, before.os_reservations);
  EXPECT_EQ(pool->stats().free_list_hits, before.free_list_hits + 1);
}

TEST_F(PoolTest, FreedLargeBlockServesRequestsAtMostOneQuarterSmaller) {
  auto pool = make();
  pool->allocate(30 * MiB).reset();
  const std::uint64_t reservations = pool->stats().os_reservations;
  auto close = pool->allocate(26 * MiB);  // 30 <= 1.25 * 26: reused
  EXPECT_EQ(close->capacity(), 30 * MiB);
  EXPECT_EQ(pool->stats().os_reservations, reservations);
  close.reset();
  auto far = pool->allocate(20 * MiB);  // 30 > 1.25 * 20: a reservation of its own
  EXPECT_EQ(far->capacity(), 20 * MiB);
  EXPECT_EQ(pool->stats().os_reservations, reservations + 1);
}

TEST_F(PoolTest, StatsTrackPeaks) {
  auto pool = make();
  auto a = pool->allocate(20 * MiB);
  auto b = pool->allocate(24 * MiB);
  a.reset();
  auto c = pool->allocate(8 * KiB);
  const PoolStats s = pool->stats();
  EXPECT_EQ(s.peak_in_use_bytes, 44 * MiB);
  EXPECT_EQ(s.in_use_bytes, 24 * MiB + 8 * KiB);
  EXPECT_EQ(s.reserved_bytes, 44 * MiB + pool->options().slab_bytes);
  EXPECT_EQ(s.peak_reserved_bytes, s.reserved_bytes);
  EXPECT_EQ(s.live_blocks, 2u);
  EXPECT_EQ(s.allocations, 3u);
  EXPECT_EQ(s.os_reservations, 3u);
  EXPECT_EQ(s.os_releases, 0u);
  EXPECT_EQ(s.capacity_bytes, 0u);
}

TEST_F(PoolTest, TrimReleasesIdleReservationsOnly) {
  auto pool = make();
  auto live = pool->allocate(20 * MiB);
  pool->allocate(24 * MiB).reset();
  pool->allocate(4 * KiB).reset();
  EXPECT_EQ(pool->stats().reserved_bytes, 44 * MiB + pool->options().slab_bytes);
  pool->trim();
  PoolStats s = pool->stats();
  EXPECT_EQ(s.reserved_bytes, 20 * MiB);
  EXPECT_EQ(s.os_releases, 2u);
  EXPECT_EQ(env_.mapped_bytes(), static_cast<std::int64_t>(20 * MiB));
  live.reset();
  pool->trim();
  s = pool->stats();
  EXPECT_EQ(s.reserved_bytes, 0u);
  EXPECT_EQ(s.os_releases, s.os_reservations);
  EXPECT_EQ(env_.mapped_bytes(), 0);
}

TEST_F(PoolTest, BlocksOutliveThePool) {
  auto pool = make();
  auto small = pool->allocate(1000);
  auto large = pool->allocate(20 * MiB);
  pool->allocate(24 * MiB).reset();  // idle: released with the Pool object
  stamp(*small, 1);
  stamp(*large, 2);
  pool.reset();
  EXPECT_EQ(env_.mapped_bytes(), static_cast<std::int64_t>(20 * MiB + PoolOptions{}.slab_bytes));
  EXPECT_TRUE(stamped(*small, 1));
  EXPECT_TRUE(stamped(*large, 2));
  small.reset();
  large.reset();
  EXPECT_EQ(env_.mapped_bytes(), 0);
}

TEST_F(PoolTest, LargeReservationsAreMultiplesOfTheBackendAlignment) {
  auto backend = std::make_unique<TestBackend>(&env_);
  TestBackend* raw = backend.get();
  const std::size_t align = backend->alignment();
  auto pool = Pool::create(std::move(backend), PoolOptions{.slab_bytes = 1 * MiB});
  auto a = pool->allocate(600 * KiB);  // above slab_bytes / 4: not from a shared slab
  auto b = pool->allocate(3 * MiB + 5);
  auto c = pool->allocate(4 * KiB);
  for (std::size_t n : raw->sizes()) EXPECT_EQ(n % align, 0u) << n;
  EXPECT_EQ(pool->stats().reserved_bytes % align, 0u);
}

// ---- memory locking and OS failures ----

TEST(PoolLockTest, RefusedLockFallsBackToPageableMemory) {
  FaultEnv env(Faults{.refuse_lock = true});
  auto pool = Pool::create(make_locked_memory_backend(&env));
  auto a = pool->allocate(1 * MiB);
  auto b = pool->allocate(20 * MiB);
  EXPECT_FALSE(a->locked());
  EXPECT_FALSE(b->locked());
  std::memset(b->data(), 0x11, b->size());
  EXPECT_EQ(b->data()[b->size() - 1], std::byte{0x11});
  EXPECT_EQ(pool->backend_name(), "locked-host");
}

// Whether this process may mlock `bytes` (RLIMIT_MEMLOCK, CAP_IPC_LOCK).
bool can_lock(std::size_t bytes) {
  int err = 0;
  void* p = default_env()->map_anonymous(bytes, 0, &err);
  if (p == nullptr) return false;
  const bool ok = default_env()->lock(p, bytes) == 0;
  default_env()->unmap(p, bytes);
  return ok;
}

TEST(PoolLockTest, LockedWhereTheLimitAllows) {
  if (!can_lock(PoolOptions{}.slab_bytes)) GTEST_SKIP() << "mlock of a slab is not permitted here";
  FaultEnv env;
  auto pool = Pool::create(make_locked_memory_backend(&env));
  EXPECT_TRUE(pool->allocate(4 * KiB)->locked());

  auto unlocked = Pool::create(make_locked_memory_backend(&env, LockedMemoryOptions{.lock = false}));
  EXPECT_FALSE(unlocked->allocate(4 * KiB)->locked());
}

TEST(PoolMapFailureTest, FailedMapIsOutOfMemoryAndLeavesNoTrace) {
  FaultEnv env(Faults{.fail_map_at = 1});
  auto pool = Pool::create(make_locked_memory_backend(&env));
  EXPECT_THROW(pool->allocate(1 * MiB), OutOfMemoryError);
  PoolStats s = pool->stats();
  EXPECT_EQ(s.reserved_bytes, 0u);
  EXPECT_EQ(s.in_use_bytes, 0u);
  EXPECT_EQ(s.live_blocks, 0u);
  EXPECT_EQ(s.os_reservations, 0u);
  auto ok = pool->allocate(1 * MiB);  // the second map succeeds
  EXPECT_EQ(pool->stats().os_reservations, 1u);
}

TEST(PoolMapFailureTest, ImpossibleRequestIsOutOfMemory) {
  FaultEnv env;
  auto pool = Pool::create(make_locked_memory_backend(&env));
  EXPECT_THROW(pool->allocate(std::numeric_limits<std::size_t>::max()), OutOfMemoryError);
  EXPECT_THROW(pool->allocate(std::size_t{1} << 62), OutOfMemoryError);
  EXPECT_EQ(pool->stats().reserved_bytes, 0u);
  EXPECT_EQ(env.mapped_bytes(), 0);
}

// ---- the budget ----

PoolOptions budget(std::size_t capacity, WhenFull when_full,
                   std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  PoolOptions o;
  o.capacity_bytes = capacity;
  o.when_full = when_full;
  o.wait_timeout = timeout;
  return o;
}

TEST_F(PoolTest, FullBudgetFailsAtOnce) {
  auto pool = make(budget(8 * MiB, WhenFull::kFail));
  auto held = pool->allocate(6 * MiB);
  const auto start = Clock::now();
  try {
    pool->allocate(4 * MiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("budget"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(1));
  EXPECT_EQ(pool->stats().reserved_bytes, 6 * MiB);
  EXPECT_EQ(pool->stats().in_use_bytes, 6 * MiB);
}

TEST_F(PoolTest, RequestAboveTheBudgetFailsEvenWhenWaiting) {
  auto pool = make(budget(8 * MiB, WhenFull::kWait));
  try {
    pool->allocate(9 * MiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("budget"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool->stats().budget_waits, 0u);
}

TEST_F(PoolTest, SmallRequestFitsABudgetSmallerThanASlab) {
  auto pool = make(budget(8 * MiB, WhenFull::kFail));  // slab_bytes: 64 MiB
  auto a = pool->allocate(64 * KiB);
  auto b = pool->allocate(4 * MiB);
  auto c = pool->allocate(100 * KiB);
  auto d = pool->allocate(64 * KiB);  // shares a's reservation
  EXPECT_EQ(pool->stats().os_reservations, 3u);
  EXPECT_LE(pool->stats().reserved_bytes, 8 * MiB);
}

TEST_F(PoolTest, IdleReservationsAreEvictedToMakeRoom) {
  auto pool = make(budget(8 * MiB, WhenFull::kFail));
  pool->allocate(6 * MiB).reset();  // idle, held for reuse
  EXPECT_EQ(pool->stats().reserved_bytes, 6 * MiB);
  auto b = pool->allocate(4 * MiB);  // 6 + 4 > 8: the idle 6 MiB goes back
  const PoolStats s = pool->stats();
  EXPECT_EQ(s.os_releases, 1u);
  EXPECT_EQ(s.reserved_bytes, 4 * MiB);
  EXPECT_EQ(env_.mapped_bytes(), static_cast<std::int64_t>(4 * MiB));
}

// blocks_available() is what a kFail pool hands out before it fails: free
// blocks of the class, and new reservations in the unreserved budget and in
// idle reservations of other classes.
TEST_F(PoolTest, BlocksAvailableIsWhatAFailingBudgetHandsOut) {
  EXPECT_EQ(make()->blocks_available(MiB), SIZE_MAX);  // no budget
  PoolOptions options = budget(12 * MiB, WhenFull::kFail);
  options.slab_bytes = 2 * MiB;  // 256 KiB blocks share slabs, eight to one
  auto pool = make(options);
  auto held = pool->allocate(3 * MiB);
  pool->allocate(4 * MiB).reset();  // idle, of another class
  std::vector<std::shared_ptr<Block>> small;
  for (int i = 0; i < 3; ++i) small.push_back(pool->allocate(256 * KiB));
  small.pop_back();  // one free block in a shared slab
  const std::size_t available = pool->blocks_available(256 * KiB);
  EXPECT_GT(available, 8u);
  std::size_t handed_out = 0;
  try {
    for (;;) {
      small.push_back(pool->allocate(256 * KiB));
      ++handed_out;
    }
  } catch (const OutOfMemoryError&) {
  }
  EXPECT_EQ(handed_out, available);
  EXPECT_EQ(pool->blocks_available(256 * KiB), 0u);
}

TEST_F(PoolTest, WaiterProceedsWhenAnotherThreadFrees) {
  auto pool = make(budget(8 * MiB, WhenFull::kWait));
  auto held = pool->allocate(6 * MiB);
  std::jthread freer([&] {
    while (pool->stats().budget_waits == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    held.reset();
  });
  auto block = pool->allocate(4 * MiB);
  freer.join();
  EXPECT_EQ(block->size(), 4 * MiB);
  const PoolStats s = pool->stats();
  EXPECT_EQ(s.budget_waits, 1u);
  EXPECT_EQ(s.live_blocks, 1u);
  EXPECT_LE(s.reserved_bytes, 8 * MiB);
}

TEST_F(PoolTest, WaitTimesOutWithOutOfMemory) {
  auto pool = make(budget(8 * MiB, WhenFull::kWait, std::chrono::milliseconds(200)));
  auto held = pool->allocate(6 * MiB);
  const auto start = Clock::now();
  try {
    pool->allocate(4 * MiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("budget"), std::string::npos) << e.what();
  }
  const auto waited = Clock::now() - start;
  EXPECT_GE(waited, std::chrono::milliseconds(190));
  EXPECT_LT(waited, std::chrono::seconds(5));
  EXPECT_EQ(pool->stats().budget_waits, 1u);
}

TEST_F(PoolTest, StopTokenEndsAWaitWithCancelled) {
  auto pool = make(budget(8 * MiB, WhenFull::kWait));
  auto held = pool->allocate(6 * MiB);
  std::stop_source stop;
  std::jthread canceller([&] {
    while (pool->stats().budget_waits == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    stop.request_stop();
  });
  const auto start = Clock::now();
  EXPECT_THROW(pool->allocate(4 * MiB, stop.get_token()), CancelledError);
  canceller.join();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(pool->stats().live_blocks, 1u);
}

TEST_F(PoolTest, WaiterWakesWhenAnotherReservationFails) {
  auto backend = std::make_unique<TestBackend>(&env_);
  TestBackend* gate = backend.get();
  auto pool = Pool::create(std::move(backend), budget(8 * MiB, WhenFull::kWait, std::chrono::seconds(10)));
  gate->arm_gate(/*fail=*/true);
  std::jthread doomed([&] { EXPECT_THROW(pool->allocate(6 * MiB), OutOfMemoryError); });
  if (!gate->wait_at_gate()) {  // 6 MiB of the budget is now spoken for
    gate->open_gate();
    doomed.join();
    FAIL() << "the first allocation never reached the backend";
  }
  std::jthread opener([&] {
    while (pool->stats().budget_waits == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    gate->open_gate();
  });
  const auto start = Clock::now();
  auto block = pool->allocate(4 * MiB);  // waits until the 6 MiB come back
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  doomed.join();
  opener.join();
  EXPECT_EQ(pool->stats().reserved_bytes, 4 * MiB);
}

// Under kFail too, a request that finds the budget taken by a reservation
// still in flight waits for it, and takes one of its spare blocks.
TEST_F(PoolTest, FailingBudgetWaitsForAReservationInFlight) {
  auto backend = std::make_unique<TestBackend>(&env_);
  TestBackend* gate = backend.get();
  PoolOptions options = budget(4 * MiB, WhenFull::kFail, std::chrono::seconds(10));
  options.slab_bytes = 4 * MiB;
  auto pool = Pool::create(std::move(backend), options);
  gate->arm_gate(/*fail=*/false);
  std::shared_ptr<Block> first;
  std::jthread reserving([&] { first = pool->allocate(256 * KiB); });  // reserves the one slab
  ASSERT_TRUE(gate->wait_at_gate());
  std::jthread opener([&] {
    while (pool->stats().budget_waits == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    gate->open_gate();
  });
  std::shared_ptr<Block> second = pool->allocate(256 * KiB);  // would have failed at once
  reserving.join();
  opener.join();
  EXPECT_EQ(pool->stats().reserved_bytes, 4 * MiB);
  EXPECT_EQ(pool->stats().os_reservations, 1u);
  EXPECT_NE(first->data(), second->data());
  // With nothing in flight a full budget still fails at once.
  std::vector<std::shared_ptr<Block>> rest;
  while (pool->stats().in_use_bytes + 256 * KiB <= 4 * MiB) rest.push_back(pool->allocate(256 * KiB));
  EXPECT_THROW(pool->allocate(256 * KiB), OutOfMemoryError);
}

// A waiter that starts while nothing is in use (the budget is held by a
// reservation in flight) must still wake when that block comes and goes.
TEST_F(PoolTest, WaiterWakesWhenABlockTakenAfterItStartedWaitingReturns) {
  auto backend = std::make_unique<TestBackend>(&env_);
  TestBackend* gate = backend.get();
  auto pool = Pool::create(std::move(backend), budget(8 * MiB, WhenFull::kWait, std::chrono::seconds(10)));
  gate->arm_gate(/*fail=*/false);
  std::jthread other([&] {
    auto block = pool->allocate(6 * MiB);  // held at the gate, then taken
    block.reset();                          // ... and returned: in use is 0 again
  });
  if (!gate->wait_at_gate()) {
    gate->open_gate();
    other.join();
    FAIL() << "the first allocation never reached the backend";
  }
  EXPECT_EQ(pool->stats().in_use_bytes, 0u);
  std::jthread opener([&] {
    while (pool->stats().budget_waits == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    gate->open_gate();
  });
  const auto start = Clock::now();
  auto block = pool->allocate(4 * MiB);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  other.join();
  opener.join();
  EXPECT_EQ(pool->stats().reserved_bytes, 4 * MiB);  // the idle 6 MiB was evicted
}

// ---- concurrency (run under TSan) ----

// `threads` threads allocate and free mixed sizes, holding at most `max_held`
// blocks while they allocate; stamps catch blocks handed out twice.
void hammer(Pool& pool, int threads, int iterations, std::size_t max_held) {
  static constexpr std::size_t kSizes[] = {1, 4 * KiB, 10'000, 64 * KiB, 65 * KiB, 300 * KiB, 1 * MiB + 3,
                                           3 * MiB};
  std::atomic<int> corrupted{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::vector<std::pair<std::shared_ptr<Block>, std::uint8_t>> held;
      for (int i = 0; i < iterations; ++i) {
        if (held.size() >= max_held || (!held.empty() && rng() % 2)) {
          const std::size_t k = rng() % held.size();
          if (!stamped(*held[k].first, held[k].second)) corrupted++;
          held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
        }
        auto block = pool.allocate(kSizes[rng() % std::size(kSizes)]);
        const auto seed = static_cast<std::uint8_t>(rng());
        stamp(*block, seed);
        held.emplace_back(std::move(block), seed);
      }
      for (auto& [block, seed] : held) {
        if (!stamped(*block, seed)) corrupted++;
      }
    });
  }
  for (auto& w : workers) w.join();
  EXPECT_EQ(corrupted, 0);
}

TEST_F(PoolTest, ConcurrentMixedSizesAreClean) {
  auto pool = make(PoolOptions{.slab_bytes = 4 * MiB});
  hammer(*pool, 8, 400, 3);
  const PoolStats s = pool->stats();
  EXPECT_EQ(s.allocations, 8u * 400u);
  EXPECT_EQ(s.in_use_bytes, 0u);
  EXPECT_EQ(s.live_blocks, 0u);
  pool->trim();
  EXPECT_EQ(env_.mapped_bytes(), 0);
}

TEST_F(PoolTest, ConcurrentUnderATightBudgetIsClean) {
  // One of each size needs 16 MiB of reservations, so idle ones are evicted
  // and threads wait. Waiters hold nothing, so every wait ends.
  PoolOptions o = budget(10 * MiB, WhenFull::kWait, std::chrono::seconds(15));
  o.slab_bytes = 2 * MiB;
  auto pool = make(o);
  hammer(*pool, 8, 200, 1);
  const PoolStats s = pool->stats();
  EXPECT_EQ(s.live_blocks, 0u);
  EXPECT_EQ(s.in_use_bytes, 0u);
  EXPECT_LE(s.peak_reserved_bytes, 10 * MiB);
  EXPECT_GT(s.os_releases, 0u);
}

}  // namespace
}  // namespace pinload
