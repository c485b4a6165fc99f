// Tests of the chunked, many-stream copy engine (pinload/copy_engine.h): the
// plan as plain data, the contract on every device ("sim", and "cuda:0" where
// a GPU is), then the adversarial part on the sim device: held and slowed
// copies must keep their pool blocks out of the free list until their events
// complete, so a new load written into a recycled block never reaches a copy
// still in flight. Last, CudaMeasure: bandwidth on a real GPU (skipped here).
#include "pinload/copy_engine.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <random>
#include <thread>
#include <vector>

#include "device_test_util.h"
#include "io/leased_mapping.h"
#include "load/device_mapped.h"
#include "test_files.h"
#include "pinload/error.h"

namespace pinload {
namespace {

using testing::Gate;
using testing::make_pattern;
using testing::OpenOnExit;
using testing::read_back;
using Clock = std::chrono::steady_clock;

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

bool equals(const std::vector<std::byte>& got, const std::byte* want, std::size_t bytes) {
  return got.size() == bytes && std::memcmp(got.data(), want, bytes) == 0;
}

// ------------------------------------------------------------------ plan

TEST(PlanCopy, CutsIntoChunksRoundRobin) {
  const std::vector<CopyChunk> want = {
      {100, 7, 8, 2},
      {108, 15, 8, 0},
      {116, 23, 4, 1},
  };
  EXPECT_EQ(plan_copy(100, 7, 20, 8, 3, 2), want);
}

TEST(PlanCopy, ExactMultipleSingleChunkAndEmpty) {
  auto plan = plan_copy(0, 0, 24, 8, 2);
  ASSERT_EQ(plan.size(), 3u);
  for (std::size_t i = 0; i < plan.size(); ++i) {
    EXPECT_EQ(plan[i].bytes, 8u);
    EXPECT_EQ(plan[i].host_offset, i * 8);
    EXPECT_EQ(plan[i].stream, i % 2);
  }
  EXPECT_EQ(plan_copy(5, 6, 3, 8, 4, 3), (std::vector<CopyChunk>{{5, 6, 3, 3}}));
  EXPECT_TRUE(plan_copy(0, 0, 0, 8, 2).empty());
}

TEST(PlanCopy, CoversEveryByteOnce) {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t bytes = rng() % 100000;
    const std::size_t chunk = 1 + rng() % 5000;
    const std::size_t streams = 1 + rng() % 5;
    const auto plan = plan_copy(3, 9, bytes, chunk, streams, rng() % 7);
    std::size_t next = 0;
    for (const CopyChunk& c : plan) {
      ASSERT_EQ(c.host_offset, 3 + next);
      ASSERT_EQ(c.device_offset, 9 + next);
      ASSERT_GT(c.bytes, 0u);
      ASSERT_LE(c.bytes, chunk);
      ASSERT_LT(c.stream, streams);
      next += c.bytes;
    }
    ASSERT_EQ(next, bytes);
  }
}

TEST(PlanCopy, ZeroChunkOrStreamsIsAnArgumentError) {
  EXPECT_THROW(plan_copy(0, 0, 10, 0, 2), InvalidArgumentError);
  EXPECT_THROW(plan_copy(0, 0, 10, 8, 0), InvalidArgumentError);
  auto d = make_sim_device();
  EXPECT_THROW(CopyEngine(*d, CopyOptions{.streams = 0}), InvalidArgumentError);
  EXPECT_THROW(CopyEngine(*d, CopyOptions{.chunk_bytes = 0}), InvalidArgumentError);
}

TEST(CopyOptionsDefaults, AreTheDocumentedOnes) {
  CopyOptions options;
  EXPECT_EQ(options.streams, 2u);
  EXPECT_EQ(options.chunk_bytes, 8 * MiB);
  EXPECT_EQ(options.max_in_flight_bytes, 0u);
}

// ------------------------------------------------------- the contract, per device

class CopyContract : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    std::string why;
    device_ = testing::open_or_skip_reason(GetParam(), &why);
    if (!device_) GTEST_SKIP() << why;
    pool_ = Pool::create(device_->make_pinned_backend(), PoolOptions{.slab_bytes = 8 * MiB});
  }
  std::unique_ptr<Device> device_;
  std::shared_ptr<Pool> pool_;
};

TEST_P(CopyContract, OddOffsetsSizesAndChunksArriveIntact) {
  Device& d = *device_;
  for (std::size_t streams : {1u, 2u, 3u, 4u}) {
    for (std::size_t chunk : {std::size_t{1} * KiB + 1, std::size_t{4099}, std::size_t{64} * KiB, std::size_t{8} * MiB}) {
      CopyEngine engine(d, CopyOptions{.streams = streams, .chunk_bytes = chunk});
      const std::size_t bytes = 777 * KiB + 5;
      auto block = pool_->allocate(bytes + 3);
      testing::fill_pattern(block->data(), block->size(), streams * 100 + chunk);
      auto dst = d.allocate(bytes + 11);
      CopyTicket ticket = engine.submit(block, 3, dst, 11, bytes);
      EXPECT_EQ(ticket.bytes(), bytes);
      EXPECT_EQ(ticket.chunks(), (bytes + chunk - 1) / chunk);
      ticket.wait();
      EXPECT_TRUE(ticket.done());
      ASSERT_TRUE(equals(read_back(d, *dst, 11, bytes), block->data() + 3, bytes))
          << streams << " streams, chunk " << chunk;
      const CopyStats stats = engine.stats();
      EXPECT_EQ(stats.chunks, ticket.chunks());
      EXPECT_EQ(stats.events, std::min(streams, ticket.chunks()));
      EXPECT_EQ(stats.bytes_submitted, bytes);
    }
  }
}

TEST_P(CopyContract, ManyTicketsIntoOneBuffer) {
  Device& d = *device_;
  CopyEngine engine(d, CopyOptions{.streams = 3, .chunk_bytes = 20 * KiB + 3});
  std::mt19937_64 rng(7);
  const std::size_t total = 4 * MiB + 17;
  auto dst = d.allocate(total);
  std::vector<std::byte> want(total);
  std::vector<CopyTicket> tickets;
  std::size_t offset = 0;
  std::uint64_t seed = 0;
  while (offset < total) {
    const std::size_t n = std::min<std::size_t>(total - offset, 1 + rng() % (200 * KiB));
    auto block = pool_->allocate(n);
    testing::fill_pattern(block->data(), n, ++seed);
    std::memcpy(want.data() + offset, block->data(), n);
    tickets.push_back(engine.submit(std::move(block), 0, dst, offset, n));
    offset += n;
  }
  engine.wait_all();
  for (const CopyTicket& t : tickets) EXPECT_TRUE(t.done());
  EXPECT_EQ(read_back(d, *dst, 0, total), want);
  const CopyStats stats = engine.stats();
  EXPECT_EQ(stats.tickets_submitted, tickets.size());
  EXPECT_EQ(stats.tickets_completed, tickets.size());
  EXPECT_EQ(stats.tickets_failed, 0u);
  EXPECT_EQ(stats.bytes_submitted, total);
  EXPECT_EQ(stats.bytes_completed, total);
  EXPECT_EQ(stats.in_flight_bytes, 0u);
  EXPECT_EQ(pool_->stats().live_blocks, 0u);  // every block went back after its copy
}

TEST_P(CopyContract, SubmitsFromManyThreads) {
  Device& d = *device_;
  CopyEngine engine(d, CopyOptions{.streams = 2, .chunk_bytes = 16 * KiB});
  const int threads = 4;
  const std::size_t per = 300 * KiB + 1;
  auto dst = d.allocate(per * threads);
  std::vector<std::byte> want(per * threads);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    testing::fill_pattern(want.data() + t * per, per, 1000 + t);
    workers.emplace_back([&, t] {
      for (std::size_t off = 0; off < per; off += 50 * KiB) {
        const std::size_t n = std::min<std::size_t>(50 * KiB, per - off);
        auto block = pool_->allocate(n);
        std::memcpy(block->data(), want.data() + t * per + off, n);
        engine.submit(std::move(block), 0, dst, t * per + off, n);
      }
    });
  }
  for (auto& w : workers) w.join();
  engine.wait_all();
  EXPECT_EQ(read_back(d, *dst, 0, per * threads), want);
}

TEST_P(CopyContract, RangeErrorsQueueNothing) {
  Device& d = *device_;
  CopyEngine engine(d);
  auto block = pool_->allocate(4096);
  auto dst = d.allocate(4096);
  EXPECT_THROW(engine.submit(block, 1, dst, 0, 4096), InvalidArgumentError);
  EXPECT_THROW(engine.submit(block, 0, dst, 1, 4096), InvalidArgumentError);
  EXPECT_THROW(engine.submit(block, 0, dst, 0, 4097), InvalidArgumentError);
  EXPECT_THROW(engine.submit(block, SIZE_MAX, dst, 0, 2), InvalidArgumentError);
  EXPECT_THROW(engine.submit(block, 0, dst, 2, SIZE_MAX), InvalidArgumentError);
  EXPECT_THROW(engine.submit(nullptr, 0, dst, 0, 1), InvalidArgumentError);
  EXPECT_THROW(engine.submit(block, 0, nullptr, 0, 1), InvalidArgumentError);
  auto other = make_sim_device();
  auto foreign = other->allocate(4096);
  EXPECT_THROW(engine.submit(block, 0, foreign, 0, 1), InvalidArgumentError);
  EXPECT_EQ(engine.stats().tickets_submitted, 0u);
  EXPECT_EQ(block.use_count(), 1);  // no refused submit kept a reference
  CopyTicket empty = engine.submit(block, 4096, dst, 4096, 0);
  EXPECT_TRUE(empty.done());
  EXPECT_NO_THROW(empty.wait());
  EXPECT_TRUE(CopyTicket().done());
}

INSTANTIATE_TEST_SUITE_P(Devices, CopyContract, ::testing::ValuesIn(testing::kDeviceSpecs),
                         testing::device_param_name);

// ------------------------------------------------- adversarial, on the sim device

TEST(CopyEngineSim, AHeldCopyKeepsItsBlockOutOfThePool) {
  Gate gate;
  SimDeviceOptions options;
  options.before_copy = gate.hook();
  auto d = make_sim_device(options);
  auto pool = Pool::create(d->make_pinned_backend(), PoolOptions{.slab_bytes = 4 * MiB});
  CopyEngine engine(*d, CopyOptions{.streams = 2, .chunk_bytes = 64 * KiB});
  OpenOnExit opener(gate);

  const std::size_t bytes = 256 * KiB;
  auto dst = d->allocate(bytes);
  auto a = pool->allocate(bytes);
  testing::fill_pattern(a->data(), bytes, 1);
  const auto want = make_pattern(bytes, 1);
  std::byte* const a_address = a->data();
  CopyTicket ticket = engine.submit(a, 0, dst, 0, bytes);
  ASSERT_TRUE(gate.wait_waiting(2));  // one chunk held on each stream
  EXPECT_GE(a.use_count(), 2);        // ours and the ticket's
  a.reset();                          // the loader lets go...
  EXPECT_FALSE(ticket.done());
  EXPECT_EQ(pool->stats().live_blocks, 1u);  // ...but the block is not back in the pool
  EXPECT_GT(pool->stats().in_use_bytes, 0u);

  // A new load of the same size must get other memory; it writes another
  // pattern there while the first copy is still held.
  auto b = pool->allocate(bytes);
  EXPECT_NE(b->data(), a_address);
  std::memset(b->data(), 0x5C, bytes);
  EXPECT_EQ(pool->stats().live_blocks, 2u);

  gate.open();
  ticket.wait();
  EXPECT_TRUE(ticket.done());
  EXPECT_EQ(pool->stats().live_blocks, 1u);  // done() implies the block is back
  EXPECT_EQ(read_back(*d, *dst, 0, bytes), want);
  // And now its memory is reused.
  auto c = pool->allocate(bytes);
  EXPECT_EQ(c->data(), a_address);
}

// A loader-shaped loop: a pool with room for two blocks, refilled as fast as
// it hands them back, with slow copies. If a block came back before its copy
// had completed, the next fill would overwrite bytes still to be copied.
TEST(CopyEngineSim, RecycledBlocksNeverCorruptInFlightCopies) {
  SimDeviceOptions options;
  // Copies far slower than a fill, also under a sanitizer on a loaded machine:
  // the fills must wait for blocks to come back.
  options.copy_delay = std::chrono::milliseconds(2);
  auto d = make_sim_device(options);
  const std::size_t bytes = 128 * KiB;
  auto pool = Pool::create(d->make_pinned_backend(PinnedMemoryOptions{.huge_pages = HugePages::kOff}),
                           PoolOptions{.capacity_bytes = 2 * bytes,
                                       .when_full = WhenFull::kWait,
                                       .wait_timeout = std::chrono::seconds(30),
                                       .slab_bytes = 2 * bytes});
  CopyEngine engine(*d, CopyOptions{.streams = 3, .chunk_bytes = 16 * KiB});
  const int loads = 40;
  auto dst = d->allocate(bytes * loads);
  std::set<std::byte*> addresses;
  for (int i = 0; i < loads; ++i) {
    auto block = pool->allocate(bytes);  // waits for a block to come back
    addresses.insert(block->data());
    testing::fill_pattern(block->data(), bytes, 100 + i);
    engine.submit(std::move(block), 0, dst, i * bytes, bytes);
  }
  engine.wait_all();
  EXPECT_LE(addresses.size(), 2u);  // the two blocks really were recycled
  EXPECT_GT(pool->stats().budget_waits, 0u);
  for (int i = 0; i < loads; ++i) {
    ASSERT_EQ(read_back(*d, *dst, i * bytes, bytes), make_pattern(bytes, 100 + i)) << "load " << i;
  }
}

TEST(CopyEngineSim, TicketsCompleteWhileNobodyPolls) {
  Gate gate;
  SimDeviceOptions options;
  options.before_copy = gate.hook();
  auto d = make_sim_device(options);
  auto pool = Pool::create(d->make_pinned_backend(), PoolOptions{.slab_bytes = 4 * MiB});
  CopyEngine engine(*d, CopyOptions{.streams = 2, .chunk_bytes = 4 * KiB});
  OpenOnExit opener(gate);
  auto dst = d->allocate(64 * KiB);
  std::weak_ptr<Block> watch;
  {
    auto block = pool->allocate(64 * KiB);
    watch = block;
    engine.submit(std::move(block), 0, dst, 0, 64 * KiB);  // ticket dropped at once
  }
  ASSERT_TRUE(gate.wait_waiting(1));
  EXPECT_FALSE(watch.expired());
  gate.open();
  // The reaper lets go by itself.
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!watch.expired() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(watch.expired());
  EXPECT_EQ(pool->stats().live_blocks, 0u);
}

TEST(CopyEngineSim, InFlightLimitStallsSubmit) {
  Gate gate;
  SimDeviceOptions options;
  options.before_copy = gate.hook();
  auto d = make_sim_device(options);
  auto pool = Pool::create(d->make_pinned_backend(), PoolOptions{.slab_bytes = 4 * MiB});
  CopyEngine engine(*d, CopyOptions{.streams = 2, .chunk_bytes = 64 * KiB, .max_in_flight_bytes = 100 * KiB});
  OpenOnExit opener(gate);
  auto dst = d->allocate(200 * KiB);
  auto first = pool->allocate(100 * KiB);
  auto second = pool->allocate(100 * KiB);
  testing::fill_pattern(first->data(), 100 * KiB, 1);
  testing::fill_pattern(second->data(), 100 * KiB, 2);
  CopyTicket t1 = engine.submit(first, 0, dst, 0, 100 * KiB);
  auto later = std::async(std::launch::async, [&] { return engine.submit(second, 0, dst, 100 * KiB, 100 * KiB); });
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (engine.stats().stalls == 0 && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(engine.stats().stalls, 1u);
  EXPECT_EQ(engine.stats().tickets_submitted, 1u);  // the second is still waiting
  EXPECT_EQ(later.wait_for(std::chrono::milliseconds(20)), std::future_status::timeout);
  gate.open();
  CopyTicket t2 = later.get();
  engine.wait_all();
  EXPECT_TRUE(t1.done());
  EXPECT_TRUE(t2.done());
  EXPECT_EQ(engine.stats().peak_in_flight_bytes, 100 * KiB);
  EXPECT_TRUE(equals(read_back(*d, *dst, 0, 100 * KiB), first->data(), 100 * KiB));
  EXPECT_TRUE(equals(read_back(*d, *dst, 100 * KiB, 100 * KiB), second->data(), 100 * KiB));
}

TEST(CopyEngineSim, ADeviceErrorFailsTheTicketAndStillReleasesTheBlock) {
  // The copy of 3000 bytes fails, once submit() has returned (so that its
  // event is recorded before the stream fails).
  Gate gate;
  SimDeviceOptions options;
  options.before_copy = [&gate](std::size_t bytes) {
    if (bytes != 3000) return;
    gate.pass(bytes);
    throw DeviceError("injected DMA fault");
  };
  auto d = make_sim_device(options);
  auto pool = Pool::create(d->make_pinned_backend(), PoolOptions{.slab_bytes = 4 * MiB});
  CopyEngine engine(*d, CopyOptions{.streams = 1, .chunk_bytes = 4096});
  OpenOnExit opener(gate);
  auto dst = d->allocate(64 * KiB);
  auto ok_block = pool->allocate(4096);
  CopyTicket ok = engine.submit(std::move(ok_block), 0, dst, 0, 4096);
  ok.wait();
  auto bad_block = pool->allocate(3000);
  CopyTicket bad = engine.submit(std::move(bad_block), 0, dst, 0, 3000);
  gate.open();
  try {
    bad.wait();
    FAIL() << "a failed copy's ticket succeeded";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("injected DMA fault"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(bad.done());
  // The stream's error is sticky: the next submit fails at once, and its
  // block is still given back.
  auto next_block = pool->allocate(4096);
  EXPECT_THROW(engine.submit(std::move(next_block), 0, dst, 0, 4096), DeviceError);
  EXPECT_THROW(engine.wait_all(), DeviceError);
  const CopyStats stats = engine.stats();
  EXPECT_EQ(stats.tickets_failed, 2u);
  EXPECT_EQ(stats.tickets_completed, 3u);
  EXPECT_EQ(stats.in_flight_bytes, 0u);
  EXPECT_EQ(pool->stats().live_blocks, 0u);
}

TEST(CopyEngineSim, DestroyingWithCopiesInFlightWaitsJoinsAndReleases) {
  const int baseline = testing::stable_thread_count();
  SimDeviceOptions options;
  options.copy_delay = std::chrono::milliseconds(2);
  auto d = make_sim_device(options);
  auto pool = Pool::create(d->make_pinned_backend(), PoolOptions{.slab_bytes = 4 * MiB});
  auto dst = d->allocate(1 * MiB);
  const auto start = Clock::now();
  std::vector<CopyTicket> tickets;
  {
    CopyEngine engine(*d, CopyOptions{.streams = 4, .chunk_bytes = 16 * KiB});
    EXPECT_EQ(testing::thread_count(), baseline + 5);  // 4 streams + the reaper
    for (int i = 0; i < 4; ++i) {
      auto block = pool->allocate(256 * KiB);
      testing::fill_pattern(block->data(), 256 * KiB, 50 + i);
      tickets.push_back(engine.submit(std::move(block), 0, dst, i * 256 * KiB, 256 * KiB));
    }
    EXPECT_FALSE(tickets.back().done());  // 64 copies of >= 2 ms on 4 streams
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(testing::settled_thread_count(baseline), baseline);
  for (const CopyTicket& t : tickets) EXPECT_TRUE(t.done());
  EXPECT_EQ(pool->stats().live_blocks, 0u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(read_back(*d, *dst, i * 256 * KiB, 256 * KiB), make_pattern(256 * KiB, 50 + i));
  }
}

TEST(CopyEngineSim, RoundRobinContinuesAcrossSubmits) {
  // Which stream thread copied what, told apart by size: with 2 streams and
  // 4 KiB chunks, submits of 1000, 2000, 10000 (4096 + 4096 + 1808) and 3000
  // bytes go to streams 0 | 1 | 0, 1, 0 | 1.
  std::mutex mu;
  std::map<std::size_t, std::thread::id> copied_by;
  SimDeviceOptions options;
  options.before_copy = [&](std::size_t bytes) {
    std::lock_guard lock(mu);
    copied_by[bytes] = std::this_thread::get_id();
  };
  auto d = make_sim_device(options);
  auto pool = Pool::create(d->make_pinned_backend(), PoolOptions{.slab_bytes = 4 * MiB});
  CopyEngine engine(*d, CopyOptions{.streams = 2, .chunk_bytes = 4096});
  auto dst = d->allocate(64 * KiB);
  std::size_t offset = 0;
  for (std::size_t n : {1000, 2000, 10000, 3000}) {
    engine.submit(pool->allocate(n), 0, dst, offset, n);
    offset += n;
  }
  engine.wait_all();
  EXPECT_EQ(engine.stats().chunks, 6u);
  EXPECT_EQ(engine.stats().events, 5u);  // one per stream used per submit
  std::lock_guard lock(mu);
  ASSERT_EQ(copied_by.size(), 5u);  // 1000, 2000, 4096, 1808, 3000
  EXPECT_NE(copied_by[1000], copied_by[2000]);
  EXPECT_EQ(copied_by[1808], copied_by[1000]);
  EXPECT_EQ(copied_by[3000], copied_by[2000]);
}

TEST(CopyEngineSim, TicketsAreReleasedInSubmissionOrder) {
  // A later ticket whose copies are done still waits for an earlier one
  // (the reaper goes in order): documented, and checked here.
  Gate gate;
  SimDeviceOptions options;
  options.before_copy = [&gate](std::size_t bytes) {
    if (bytes == 1000) gate.pass(bytes);
  };
  auto d = make_sim_device(options);
  auto pool = Pool::create(d->make_pinned_backend(), PoolOptions{.slab_bytes = 4 * MiB});
  CopyEngine engine(*d, CopyOptions{.streams = 2, .chunk_bytes = 4096});
  OpenOnExit opener(gate);
  auto dst = d->allocate(8192);
  CopyTicket first = engine.submit(pool->allocate(1000), 0, dst, 0, 1000);   // stream 0, held
  CopyTicket second = engine.submit(pool->allocate(2000), 0, dst, 4096, 2000);  // stream 1
  ASSERT_TRUE(gate.wait_waiting(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(first.done());
  EXPECT_FALSE(second.done());
  gate.open();
  second.wait();
  EXPECT_TRUE(first.done());
}

// ------------------------------------------------- measurements on a real GPU

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void record(const std::string& key, double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%.4f", value);
  ::testing::Test::RecordProperty(key, text);
  std::printf("measure: %s = %s\n", key.c_str(), text);
}

// Pinned host-to-device bandwidth (the physical limit pinload aims at), the
// engine's throughput per stream count and chunk size, pageable copies for
// contrast, and what pinning costs with each PinMethod. Size from
// PINLOAD_MEASURE_MIB (default 1024). Writes the numbers as test properties
// (--gtest_output=json) and to stdout.
TEST(CudaMeasure, HostToDeviceBandwidth) {
  std::string why;
  if (!cuda_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  auto d = open_device("cuda:0");
  std::printf("measure: device = %s\n", d->description().c_str());
  const char* env = std::getenv("PINLOAD_MEASURE_MIB");
  const std::size_t bytes = static_cast<std::size_t>(env ? std::atoll(env) : 1024) * MiB;
  ASSERT_GT(bytes, 0u);
  const double gb = static_cast<double>(bytes) / 1e9;
  record("bytes", static_cast<double>(bytes));

  // What pinning costs: reserve + release of `bytes` per method.
  for (auto [method, key] : {std::pair{PinMethod::kHostAlloc, "pin_host_alloc"},
                             std::pair{PinMethod::kHostRegister, "pin_host_register"}}) {
    auto backend = d->make_pinned_backend(PinnedMemoryOptions{.method = method});
    auto start = Clock::now();
    HostRange range = backend->reserve(bytes);
    const double reserve_s = seconds_since(start);
    std::memset(range.data, 1, bytes);  // first touch, for the register path
    start = Clock::now();
    backend->release(range);
    const double release_s = seconds_since(start);
    record(std::string(key) + "_reserve_s", reserve_s);
    record(std::string(key) + "_release_s", release_s);
    record(std::string(key) + "_gbps", gb / reserve_s);
  }

  auto pool = Pool::create(d->make_pinned_backend(), PoolOptions{});
  auto block = pool->allocate(bytes);
  testing::fill_pattern(block->data(), std::min<std::size_t>(bytes, 64 * MiB), 77);
  auto dst = d->allocate(bytes);

  auto best_of = [&](int reps, auto&& once) {
    double best = 1e30;
    once();  // warm-up
    for (int i = 0; i < reps; ++i) {
      const auto start = Clock::now();
      once();
      best = std::min(best, seconds_since(start));
    }
    return gb / best;
  };

  Stream stream = d->create_stream();
  record("h2d_pinned_one_copy_gbps", best_of(3, [&] {
           d->copy_to_device_async(*dst, 0, block->data(), bytes, stream);
           stream.synchronize();
         }));
  double engine_2 = 0;
  for (std::size_t streams : {1u, 2u, 4u}) {
    CopyEngine engine(*d, CopyOptions{.streams = streams});
    const double gbps = best_of(3, [&] { engine.submit(block, 0, dst, 0, bytes).wait(); });
    record("h2d_engine_" + std::to_string(streams) + "_streams_gbps", gbps);
    if (streams == 2) engine_2 = gbps;
  }
  for (std::size_t chunk : {std::size_t{2} * MiB, std::size_t{32} * MiB}) {
    CopyEngine engine(*d, CopyOptions{.streams = 2, .chunk_bytes = chunk});
    record("h2d_engine_2_streams_chunk_" + std::to_string(chunk / MiB) + "mib_gbps",
           best_of(3, [&] { engine.submit(block, 0, dst, 0, bytes).wait(); }));
  }
  {
    const std::size_t pageable_bytes = std::min<std::size_t>(bytes, 256 * MiB);
    std::vector<std::byte> pageable(pageable_bytes, std::byte{3});
    const double pgb = static_cast<double>(pageable_bytes) / 1e9;
    double best = 1e30;
    for (int i = 0; i < 3; ++i) {
      const auto start = Clock::now();
      d->copy_to_device_async(*dst, 0, pageable.data(), pageable_bytes, stream);
      stream.synchronize();
      best = std::min(best, seconds_since(start));
    }
    record("h2d_pageable_one_copy_gbps", pgb / best);
  }
  // The bytes arrived (the last copy was the pageable one: copy the block again).
  CopyEngine engine(*d);
  engine.submit(block, 0, dst, 0, bytes).wait();
  for (std::size_t at : {std::size_t{0}, bytes / 2 - 4096, bytes - 4096}) {
    ASSERT_TRUE(equals(read_back(*d, *dst, at, 4096), block->data() + at, 4096)) << "at " << at;
  }
  EXPECT_GT(engine_2, 1.0) << "pinned copies below 1 GB/s: not DMA from pinned memory?";
}

// Note [Registration chunks] (src/load/device_mapped.h): what registering a
// mapping of a file in the page cache costs (cudaHostRegister, read-only),
// per call and per GB, fitted from registrations in 8 and 128 MiB chunks;
// the chunk size that cost gives; and copies from the mapping, registered
// chunk by chunk as a warm device load does (first) and with the
// registrations kept (again), beside pinned copies. A driver that refuses
// file-backed registration records register_file_refused = 1.
TEST(CudaMeasure, RegistrationCost) {
  std::string why;
  if (!cuda_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  auto d = open_device("cuda:0");
  const char* env = std::getenv("PINLOAD_MEASURE_MIB");
  const std::size_t bytes = std::min<std::size_t>(static_cast<std::size_t>(env ? std::atoll(env) : 1024), 1024) * MiB;
  ASSERT_GT(bytes, 0u);
  const double gb = static_cast<double>(bytes) / 1e9;
  testing::TempDir dir;
  const std::string path = dir.file("weights.bin");
  {
    std::vector<std::uint8_t> data(bytes);
    testing::fill_pattern(reinterpret_cast<std::byte*>(data.data()), bytes, 91);
    testing::write_file(path, data);  // in the page cache now
  }
  FileStat st;
  {
    const int fd = default_env()->open_read(path, 0);
    ASSERT_GE(fd, 0);
    const ScopedFd owned(default_env(), fd);
    ASSERT_EQ(default_env()->stat(fd, &st), 0);
  }
  auto lease = [&] {
    std::string reason;
    std::shared_ptr<detail::LeasedMapping> m = detail::LeasedMapping::open(default_env(), path, FileIdentity::of(st), &reason);
    EXPECT_NE(m, nullptr) << reason;
    if (m) ::madvise(const_cast<std::byte*>(m->data()), bytes, MADV_POPULATE_READ);
    return m;
  };
  // Registration alone, fresh mappings each time.
  double seconds[2] = {0, 0};
  const std::size_t chunks[2] = {8 * MiB, 128 * MiB};
  for (int k = 0; k < 2; ++k) {
    std::shared_ptr<detail::LeasedMapping> m = lease();
    ASSERT_NE(m, nullptr);
    std::vector<std::shared_ptr<void>> held;
    const auto start = Clock::now();
    for (std::size_t at = 0; at < bytes; at += chunks[k]) {
      std::string reason;
      held.push_back(d->register_host(m->data() + at, std::min(chunks[k], bytes - at), &reason));
      if (!held.back()) {
        std::printf("measure: cudaHostRegister of a file mapping refused: %s\n", reason.c_str());
        record("register_file_refused", 1);
        return;
      }
    }
    seconds[k] = seconds_since(start);
  }
  const double calls[2] = {static_cast<double>(bytes / chunks[0]), static_cast<double>(bytes / chunks[1])};
  const double per_call = std::max((seconds[0] - seconds[1]) / (calls[0] - calls[1]), 0.0);
  const double per_gb = std::max(seconds[1] - per_call * calls[1], 1e-9) / gb;
  record("register_file_refused", 0);
  record("register_file_8mib_chunks_gbps", gb / seconds[0]);
  record("register_file_128mib_chunks_gbps", gb / seconds[1]);
  record("register_file_s_per_call_us", per_call * 1e6);
  record("register_file_s_per_gb", per_gb);
  record("register_chunk_from_cost_mib",
         static_cast<double>(detail::registration_chunk_bytes({per_call, per_gb})) / static_cast<double>(MiB));
  record("register_chunk_modelled_mib", static_cast<double>(detail::registration_chunk_bytes()) / static_cast<double>(MiB));

  // Copies from the mapping as a warm device load makes them, beside one pinned copy.
  auto dst = d->allocate(bytes);
  auto pool = Pool::create(d->make_pinned_backend(), PoolOptions{});
  auto block = pool->allocate(bytes);
  Stream stream = d->create_stream();
  double pinned = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto start = Clock::now();
    d->copy_to_device_async(*dst, 0, block->data(), bytes, stream);
    stream.synchronize();
    pinned = std::min(pinned, seconds_since(start));
  }
  record("h2d_pinned_one_copy_gbps_beside_mapped", gb / pinned);
  std::shared_ptr<detail::LeasedMapping> m = lease();
  ASSERT_NE(m, nullptr);
  auto mapping = detail::RegisteredMapping::make(m->block(), m->data(), m->size(), true);
  m.reset();
  CopyEngine engine(*d);
  auto start = Clock::now();
  ASSERT_TRUE(mapping->copy(engine, 0, bytes, dst, 0));
  engine.wait_all();
  const double first = seconds_since(start);
  double again = 1e30;
  for (int i = 0; i < 3; ++i) {
    start = Clock::now();
    ASSERT_TRUE(mapping->copy(engine, 0, bytes, dst, 0));
    engine.wait_all();
    again = std::min(again, seconds_since(start));
  }
  record("h2d_mapped_first_gbps", gb / first);
  record("h2d_mapped_kept_gbps", gb / again);
  record("h2d_mapped_first_over_pinned", pinned / first);
  record("h2d_mapped_kept_over_pinned", pinned / again);
  std::vector<std::uint8_t> expect(bytes);
  testing::fill_pattern(reinterpret_cast<std::byte*>(expect.data()), bytes, 91);
  for (std::size_t at : {std::size_t{0}, bytes / 2 - 4096, bytes - 4096}) {
    ASSERT_TRUE(equals(read_back(*d, *dst, at, 4096), reinterpret_cast<const std::byte*>(expect.data()) + at, 4096))
        << "at " << at;
  }
}

}  // namespace
}  // namespace pinload
