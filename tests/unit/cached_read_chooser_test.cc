// Tests of the map-or-pread choice for files in the page cache
// (src/cached_read_chooser.h): plain data, no I/O.
#include "io/cached_read_chooser.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace pinload::detail {
namespace {

using Method = CachedReadChooser::Method;
constexpr std::uint64_t kChunk = 2u << 20;

// Runs `n` chunks where a chunk takes map_ns or pread_ns; returns how many took each.
std::pair<int, int> run(CachedReadChooser& c, int n, std::uint64_t map_ns, std::uint64_t pread_ns) {
  int maps = 0, preads = 0;
  for (int i = 0; i < n; ++i) {
    const Method m = c.next();
    c.record(m, kChunk, m == CachedReadChooser::kMap ? map_ns : pread_ns);
    (m == CachedReadChooser::kMap ? maps : preads)++;
  }
  return {maps, preads};
}

TEST(CachedReadChooserTest, WarmupAlternatesStartingWithMap) {
  CachedReadChooser c;
  for (std::uint64_t n = 0; n < CachedReadChooser::kWarmup; ++n) {
    EXPECT_EQ(c.choose(n), n % 2 == 0 ? CachedReadChooser::kMap : CachedReadChooser::kPread) << n;
  }
}

TEST(CachedReadChooserTest, WithoutMeasurementsOfBothItMaps) {
  CachedReadChooser c;
  EXPECT_EQ(c.faster(), CachedReadChooser::kMap);
  c.record(CachedReadChooser::kPread, kChunk, 1);
  EXPECT_EQ(c.faster(), CachedReadChooser::kMap);
}

TEST(CachedReadChooserTest, TakesTheFasterAndExploresTheOtherRarely) {
  for (const bool map_faster : {true, false}) {
    CachedReadChooser c;
    const auto [maps, preads] = run(c, 1000, map_faster ? 100 : 140, map_faster ? 140 : 100);
    const int slower = map_faster ? preads : maps;
    // Half the warm-up, then one in kExploreEvery.
    EXPECT_LE(slower, 4 + 1000 / 32 + 1) << (map_faster ? "map faster" : "pread faster");
    EXPECT_GE(slower, 4 + 1000 / 32 - 1);
    EXPECT_EQ(c.faster(), map_faster ? CachedReadChooser::kMap : CachedReadChooser::kPread);
  }
}

TEST(CachedReadChooserTest, ComparesTimePerByteNotTotals) {
  CachedReadChooser c;
  // Map has done 10x the bytes in 5x the time: faster per byte.
  c.record(CachedReadChooser::kMap, 10 * kChunk, 500);
  c.record(CachedReadChooser::kPread, kChunk, 100);
  EXPECT_EQ(c.faster(), CachedReadChooser::kMap);
  c.record(CachedReadChooser::kMap, 0, 10'000);
  EXPECT_EQ(c.faster(), CachedReadChooser::kPread);
}

TEST(CachedReadChooserTest, ExplorationNoticesAChange) {
  CachedReadChooser c;
  run(c, 200, 100, 140);  // map faster
  ASSERT_EQ(c.faster(), CachedReadChooser::kMap);
  run(c, 2000, 400, 140);  // now map is much slower
  EXPECT_EQ(c.faster(), CachedReadChooser::kPread);
}

TEST(CachedReadChooserTest, ConcurrentWorkersEachGetADistinctChunkNumber) {
  CachedReadChooser c;
  std::vector<std::thread> workers;
  for (int t = 0; t < 8; ++t) workers.emplace_back([&] { run(c, 500, 100, 140); });
  for (auto& w : workers) w.join();
  // 4000 chunks handed out: the next is number 4000, whose choice is known.
  EXPECT_EQ(c.next(), c.choose(4000));
  EXPECT_EQ(c.faster(), CachedReadChooser::kMap);
}

}  // namespace
}  // namespace pinload::detail
