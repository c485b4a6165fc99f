// Tests of read planning (pinload/read_plan.h): pure data, no I/O.
#include "pinload/read_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <tuple>

namespace pinload {
namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

FileRead file(std::uint64_t data_offset, std::uint64_t file_size, std::uint32_t alignment = 1) {
  FileRead f;
  f.path = "f" + std::to_string(file_size);
  f.data_offset = data_offset;
  f.file_size = file_size;
  f.alignment = alignment;
  f.direct = alignment > 1;
  return f;
}

PlanOptions options(std::size_t block_size, std::size_t files_in_flight = 1) {
  return PlanOptions{block_size, files_in_flight};
}

// The chunks of file `i`, in claim order.
std::vector<ReadChunk> chunks_of(const ReadPlan& plan, std::uint32_t i) {
  std::vector<ReadChunk> out;
  for (const ReadChunk& c : plan.chunks) {
    if (c.file == i) out.push_back(c);
  }
  return out;
}

// Every rule of a plan, checked on its own: ranges aligned, chunks aligned,
// sequential and covering [read_begin, file_size), last one clipped.
void expect_valid_plan(const ReadPlan& plan, std::size_t block_size) {
  std::uint64_t total = 0;
  for (std::uint32_t i = 0; i < plan.files.size(); ++i) {
    const FileRead& f = plan.files[i];
    const std::uint64_t a = std::max<std::uint32_t>(f.alignment, 1);
    SCOPED_TRACE("file " + std::to_string(i) + " align " + std::to_string(a));
    EXPECT_EQ(f.read_begin % a, 0u);
    EXPECT_LE(f.read_begin, f.data_offset);
    EXPECT_LT(f.data_offset - f.read_begin, a);
    EXPECT_EQ(f.read_end % a, 0u);
    EXPECT_GE(f.read_end, f.file_size);
    EXPECT_LT(f.read_end - f.file_size, a);
    EXPECT_EQ(f.block_bytes(), f.read_end - f.read_begin);
    EXPECT_EQ(f.data_in_block(), f.data_offset - f.read_begin);

    std::uint64_t at = f.read_begin;
    const auto chunks = chunks_of(plan, i);
    for (std::size_t k = 0; k < chunks.size(); ++k) {
      const ReadChunk& c = chunks[k];
      EXPECT_EQ(c.offset, at);
      EXPECT_EQ(c.offset % a, 0u);
      EXPECT_EQ(c.length % a, 0u);
      EXPECT_GT(c.length, 0u);
      EXPECT_LE(c.length, std::max<std::uint64_t>(a, block_size));
      EXPECT_LE(c.offset + c.length, f.read_end);  // fits the file's block
      EXPECT_EQ(c.valid, std::min(c.length, f.file_size - c.offset));
      if (k + 1 < chunks.size()) {
        EXPECT_EQ(c.valid, c.length);
      }
      at += c.length;
      total += c.valid;
    }
    EXPECT_GE(at, f.file_size);
  }
  EXPECT_EQ(plan.total_bytes, total);
}

TEST(ReadPlanTest, BufferedChunksStartAtTheDataSection) {
  const ReadPlan plan = make_read_plan({file(101, 101 + 10'000)}, options(4 * KiB));
  ASSERT_EQ(plan.files.size(), 1u);
  EXPECT_EQ(plan.files[0].read_begin, 101u);
  EXPECT_EQ(plan.files[0].read_end, 10'101u);
  EXPECT_EQ(plan.files[0].data_in_block(), 0u);
  ASSERT_EQ(plan.chunks.size(), 3u);
  EXPECT_EQ(plan.chunks[0].offset, 101u);
  EXPECT_EQ(plan.chunks[1].offset, 101u + 4096);
  EXPECT_EQ(plan.chunks[2].offset, 101u + 8192);
  EXPECT_EQ(plan.chunks[2].length, 10'000u - 8192);
  EXPECT_EQ(plan.chunks[2].valid, 10'000u - 8192);
  EXPECT_EQ(plan.total_bytes, 10'000u);
  expect_valid_plan(plan, 4 * KiB);
}

TEST(ReadPlanTest, DirectChunksAreAlignedAndTheLastIsClipped) {
  const ReadPlan plan = make_read_plan({file(101, 10'100, 4096)}, options(4 * KiB));
  const FileRead& f = plan.files[0];
  EXPECT_EQ(f.read_begin, 0u);
  EXPECT_EQ(f.read_end, 12'288u);
  EXPECT_EQ(f.block_bytes(), 12'288u);
  EXPECT_EQ(f.data_in_block(), 101u);
  ASSERT_EQ(plan.chunks.size(), 3u);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(plan.chunks[k].offset, 4096u * k);
    EXPECT_EQ(plan.chunks[k].length, 4096u);
  }
  EXPECT_EQ(plan.chunks[0].valid, 4096u);
  EXPECT_EQ(plan.chunks[2].valid, 10'100u - 8192);  // a partial last block
  EXPECT_EQ(plan.total_bytes, 10'100u);             // header bytes in the first block count
  expect_valid_plan(plan, 4 * KiB);
}

TEST(ReadPlanTest, DataOffsetPastTheFirstAlignmentUnit) {
  const ReadPlan plan = make_read_plan({file(5'000, 20'000, 4096)}, options(8 * KiB));
  const FileRead& f = plan.files[0];
  EXPECT_EQ(f.read_begin, 4096u);
  EXPECT_EQ(f.read_end, 20'480u);
  EXPECT_EQ(f.data_in_block(), 5'000u - 4096);
  ASSERT_EQ(plan.chunks.size(), 2u);
  EXPECT_EQ(plan.chunks[0].offset, 4096u);
  EXPECT_EQ(plan.chunks[1].offset, 4096u + 8192);
  EXPECT_EQ(plan.chunks[1].length, 8192u);
  EXPECT_EQ(plan.chunks[1].valid, 20'000u - 4096 - 8192);
  expect_valid_plan(plan, 8 * KiB);
}

TEST(ReadPlanTest, ExactlyAlignedFileHasNoSlack) {
  const ReadPlan plan = make_read_plan({file(4096, 3 * 4096, 4096)}, options(4 * KiB));
  EXPECT_EQ(plan.files[0].read_begin, 4096u);
  EXPECT_EQ(plan.files[0].read_end, 3u * 4096);
  ASSERT_EQ(plan.chunks.size(), 2u);
  EXPECT_EQ(plan.chunks[1].valid, 4096u);
  EXPECT_EQ(plan.total_bytes, 2u * 4096);
}

TEST(ReadPlanTest, BlockSizeIsRoundedDownToTheAlignmentButNeverBelowIt) {
  // 12 KiB (not a power of two) stays; 6000 becomes 4 KiB; 1000 becomes 4 KiB.
  for (const auto& [block, step] : {std::pair<std::size_t, std::uint64_t>{12 * KiB, 12 * KiB},
                                    {6'000, 4 * KiB},
                                    {1'000, 4 * KiB}}) {
    const ReadPlan plan = make_read_plan({file(0, 100'000, 4096)}, options(block));
    ASSERT_FALSE(plan.chunks.empty());
    EXPECT_EQ(plan.chunks[0].length, step) << block;
    expect_valid_plan(plan, std::max<std::size_t>(block, 4 * KiB));
  }
  // Buffered reads take the block size as given.
  const ReadPlan buffered = make_read_plan({file(7, 100'000)}, options(12'345));
  EXPECT_EQ(buffered.chunks[0].length, 12'345u);
  expect_valid_plan(buffered, 12'345);
}

TEST(ReadPlanTest, EmptyDataSection) {
  const ReadPlan buffered = make_read_plan({file(88, 88)}, options(4 * KiB));
  EXPECT_TRUE(buffered.chunks.empty());
  EXPECT_EQ(buffered.total_bytes, 0u);
  EXPECT_EQ(buffered.files[0].block_bytes(), 0u);

  // A direct read still covers the header bytes of the aligned range.
  const ReadPlan direct = make_read_plan({file(88, 88, 4096)}, options(4 * KiB));
  ASSERT_EQ(direct.chunks.size(), 1u);
  EXPECT_EQ(direct.chunks[0].valid, 88u);
  EXPECT_EQ(direct.files[0].block_bytes(), 4096u);
}

TEST(ReadPlanTest, OneFileInFlightReadsFilesInTurn) {
  const ReadPlan plan = make_read_plan({file(8, 8 + 3 * MiB), file(8, 8 + 1), file(16, 16 + 2 * MiB + 5)},
                                       options(1 * MiB, 1));
  std::vector<std::uint32_t> order;
  for (const ReadChunk& c : plan.chunks) order.push_back(c.file);
  EXPECT_EQ(order, (std::vector<std::uint32_t>{0, 0, 0, 1, 2, 2, 2}));
  EXPECT_EQ(plan.total_bytes, 3 * MiB + 1 + 2 * MiB + 5);
  expect_valid_plan(plan, 1 * MiB);
}

TEST(ReadPlanTest, FilesInFlightAreInterleavedRoundRobin) {
  std::vector<FileRead> files;
  for (int i = 0; i < 3; ++i) files.push_back(file(8, 8 + 4 * 4096));
  const ReadPlan plan = make_read_plan(files, options(4 * KiB, 3));
  std::vector<std::uint32_t> order;
  for (const ReadChunk& c : plan.chunks) order.push_back(c.file);
  EXPECT_EQ(order, (std::vector<std::uint32_t>{0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2}));
  expect_valid_plan(plan, 4 * KiB);
}

TEST(ReadPlanTest, ZeroFilesInFlightMeansOne) {
  const ReadPlan plan = make_read_plan({file(8, 8 + 8192), file(8, 8 + 8192)}, options(4 * KiB, 0));
  std::vector<std::uint32_t> order;
  for (const ReadChunk& c : plan.chunks) order.push_back(c.file);
  EXPECT_EQ(order, (std::vector<std::uint32_t>{0, 0, 1, 1}));
}

// Note [Tapered tail]: the last taper_bytes in chunks of taper_block_size,
// the 2 x taper_bytes before them in chunks twice that, and so on up to the
// block size; the file still tiled in order, each chunk's index its rank.
TEST(ReadPlanTest, ALargePlanEndsInChunksThatHalve) {
  PlanOptions o = options(8 * MiB);
  o.taper_bytes = 32 * MiB;
  o.taper_block_size = 1 * MiB;
  const ReadPlan plan = make_read_plan({file(8, 400 * MiB + 100, 4096)}, o);
  expect_valid_plan(plan, 8 * MiB);
  ASSERT_EQ(plan.files[0].chunk_count, plan.chunks.size());
  std::vector<std::uint64_t> lengths;
  for (std::size_t k = 0; k < plan.chunks.size(); ++k) {
    EXPECT_EQ(plan.chunks[k].index, k);
    lengths.push_back(plan.chunks[k].length);
  }
  // From the end: the short last chunk (100 bytes in one 4 KiB block), 32 of
  // 1 MiB, 32 of 2 MiB, 32 of 4 MiB, and 8 MiB chunks before them.
  std::vector<std::uint64_t> expected_tail;
  for (int i = 0; i < 32; ++i) expected_tail.push_back(4 * MiB);
  for (int i = 0; i < 32; ++i) expected_tail.push_back(2 * MiB);
  for (int i = 0; i < 32; ++i) expected_tail.push_back(1 * MiB);
  expected_tail.push_back(4096);
  ASSERT_GT(lengths.size(), expected_tail.size());
  const std::vector<std::uint64_t> tail(lengths.end() - static_cast<std::ptrdiff_t>(expected_tail.size()), lengths.end());
  EXPECT_EQ(tail, expected_tail);
  for (std::size_t k = 0; k + expected_tail.size() < lengths.size(); ++k) EXPECT_EQ(lengths[k], 8 * MiB) << k;
}

TEST(ReadPlanTest, SmallPlansAndUntaperedOptionsKeepTheirChunks) {
  PlanOptions tapered = options(8 * MiB);
  tapered.taper_bytes = 32 * MiB;
  tapered.taper_block_size = 1 * MiB;
  for (const std::uint64_t size : {std::uint64_t{1300 * KiB}, std::uint64_t{128 * MiB}}) {
    const ReadPlan a = make_read_plan({file(8, size, 4096)}, tapered);
    const ReadPlan b = make_read_plan({file(8, size, 4096)}, options(8 * MiB));
    ASSERT_EQ(a.chunks.size(), b.chunks.size()) << size;
    for (std::size_t k = 0; k < a.chunks.size(); ++k) EXPECT_EQ(a.chunks[k].length, b.chunks[k].length);
  }
}

TEST(ReadPlanTest, TaperedInterleavedFilesStayInOrder) {
  PlanOptions o = options(8 * MiB, 2);
  o.taper_bytes = 16 * MiB;
  o.taper_block_size = 1 * MiB;
  const ReadPlan plan = make_read_plan({file(8, 100 * MiB + 7, 4096), file(16, 90 * MiB + 3, 4096)}, o);
  expect_valid_plan(plan, 8 * MiB);  // each file tiled from read_begin, in order
  std::uint64_t total = 0;
  for (std::uint32_t f = 0; f < 2; ++f) {
    const auto chunks = chunks_of(plan, f);
    EXPECT_EQ(plan.files[f].chunk_count, chunks.size());
    for (std::size_t k = 0; k < chunks.size(); ++k) {
      EXPECT_EQ(chunks[k].index, k);
      total += chunks[k].valid;
    }
  }
  EXPECT_EQ(total, (100 * MiB + 7) + (90 * MiB + 3));  // both read from their aligned start, 0
  EXPECT_EQ(plan.chunks.back().length, 4096u);  // the last one is small
  EXPECT_LT(plan.chunks[plan.chunks.size() - 2].length, 8 * MiB);
}

// Random plans: every rule holds, each file is swept in order, files start in
// order and no more than files_in_flight are ever open at once.
TEST(ReadPlanTest, RandomPlansKeepEveryRule) {
  std::mt19937_64 rng(42);
  for (int round = 0; round < 300; ++round) {
    const std::size_t n = 1 + rng() % 7;
    const std::size_t in_flight = 1 + rng() % 4;
    const std::size_t block = std::size_t{512} << (rng() % 10);
    std::vector<FileRead> files;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t data_offset = 9 + rng() % 9000;
      const std::uint32_t align = rng() % 2 ? 1 : (512u << (rng() % 4));
      files.push_back(file(data_offset, data_offset + rng() % (300 * KiB), align));
    }
    const ReadPlan plan = make_read_plan(files, options(block, in_flight));
    SCOPED_TRACE("round " + std::to_string(round));
    ASSERT_EQ(plan.files.size(), n);
    expect_valid_plan(plan, block);

    std::vector<std::size_t> remaining(n, 0);
    for (const ReadChunk& c : plan.chunks) remaining[c.file]++;
    std::set<std::uint32_t> open;
    std::uint32_t next_start = 0;
    for (const ReadChunk& c : plan.chunks) {
      if (!open.count(c.file)) {
        // Files with no chunks are skipped over; others start in order.
        while (next_start < c.file) {
          ASSERT_EQ(remaining[next_start++], 0u);
        }
        ASSERT_EQ(c.file, next_start++);
        open.insert(c.file);
      }
      ASSERT_LE(open.size(), in_flight);
      if (--remaining[c.file] == 0) open.erase(c.file);
    }
  }
}

// Random tapered plans: every rule holds and each chunk's index is its rank in
// its file, with odd block sizes, buffered alignments and files in flight.
TEST(ReadPlanTest, RandomTaperedPlansKeepEveryRule) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    const std::size_t n = 1 + rng() % 4;
    PlanOptions o = options(4096 + rng() % (3 * MiB), 1 + rng() % 3);
    o.taper_bytes = 64 * KiB + rng() % (2 * MiB);
    o.taper_block_size = 512 + rng() % (300 * KiB);
    std::vector<FileRead> files;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t data_offset = 9 + rng() % 9000;
      const std::uint32_t align = rng() % 2 ? 1 : (512u << (rng() % 4));
      files.push_back(file(data_offset, data_offset + rng() % (12 * MiB), align));
    }
    const ReadPlan plan = make_read_plan(files, o);
    SCOPED_TRACE("round " + std::to_string(round));
    expect_valid_plan(plan, o.block_size);
    for (std::uint32_t f = 0; f < n; ++f) {
      const auto chunks = chunks_of(plan, f);
      ASSERT_EQ(plan.files[f].chunk_count, chunks.size());
      for (std::size_t k = 0; k < chunks.size(); ++k) ASSERT_EQ(chunks[k].index, k);
    }
  }
}

}  // namespace
}  // namespace pinload

// ---- replay_plan: a recorded template's reads, trusted only when they tile ----

namespace pinload {
namespace {

std::vector<TemplateRead> reads_of(const ReadPlan& plan) {
  std::vector<TemplateRead> out;
  for (const ReadChunk& c : plan.chunks) out.push_back(TemplateRead{c.file, c.offset, c.length});
  return out;
}

TEST(ReplayPlanTest, ItsOwnReadsInAnyOrderReplayWithIndicesInSweepOrder) {
  const ReadPlan plan = make_read_plan({file(100, 10 * KiB + 5, 4096), file(8, 3 * KiB, 512)}, options(4 * KiB, 2));
  std::vector<TemplateRead> reads = reads_of(plan);
  std::reverse(reads.begin(), reads.end());
  const std::optional<ReadPlan> replayed = replay_plan(plan, reads);
  ASSERT_TRUE(replayed.has_value());
  ASSERT_EQ(replayed->chunks.size(), reads.size());
  for (std::size_t k = 0; k < reads.size(); ++k) {  // the recorded order
    EXPECT_EQ(replayed->chunks[k].file, reads[k].file);
    EXPECT_EQ(replayed->chunks[k].offset, reads[k].offset);
  }
  ReadPlan in_sweep_order = *replayed;  // the rules of a plan hold, file by file
  std::sort(in_sweep_order.chunks.begin(), in_sweep_order.chunks.end(), [](const ReadChunk& a, const ReadChunk& b) {
    return std::tie(a.file, a.offset) < std::tie(b.file, b.offset);
  });
  expect_valid_plan(in_sweep_order, 4 * KiB);
  EXPECT_EQ(replayed->total_bytes, plan.total_bytes);
  for (std::uint32_t f = 0; f < 2; ++f) {
    EXPECT_EQ(replayed->files[f].chunk_count, plan.files[f].chunk_count);
    for (const ReadChunk& c : replayed->chunks) {
      if (c.file != f) continue;
      // index is the rank of the offset in the file: the same as the made plan's
      const auto made = chunks_of(plan, f);
      EXPECT_EQ(made[c.index].offset, c.offset);
      EXPECT_EQ(made[c.index].valid, c.valid);
    }
  }
}

TEST(ReplayPlanTest, OtherChunkSizesThatTileAreTaken) {
  const ReadPlan plan = make_read_plan({file(0, 16 * KiB, 4096)}, options(4 * KiB));
  const std::vector<TemplateRead> reads = {{0, 8 * KiB, 8 * KiB}, {0, 0, 8 * KiB}};
  const std::optional<ReadPlan> replayed = replay_plan(plan, reads);
  ASSERT_TRUE(replayed.has_value());
  EXPECT_EQ(replayed->files[0].chunk_count, 2u);
  EXPECT_EQ(replayed->chunks[0].index, 1u);
  EXPECT_EQ(replayed->chunks[1].index, 0u);
  EXPECT_EQ(replayed->total_bytes, 16 * KiB);
}

TEST(ReplayPlanTest, ReadsThatDoNotTileAreRefused) {
  const ReadPlan plan = make_read_plan({file(0, 16 * KiB, 4096), file(0, 4 * KiB, 4096)}, options(4 * KiB));
  auto refused = [&](std::vector<TemplateRead> reads) { return !replay_plan(plan, reads).has_value(); };
  std::vector<TemplateRead> good = reads_of(plan);
  ASSERT_FALSE(refused(good));
  EXPECT_TRUE(refused({}));                                    // nothing read
  auto missing = good;
  missing.pop_back();
  EXPECT_TRUE(refused(missing));                               // a gap
  auto twice = good;
  twice.push_back(good.front());
  EXPECT_TRUE(refused(twice));                                 // a byte read twice
  auto other_file = good;
  other_file.push_back({2, 0, 4096});
  EXPECT_TRUE(refused(other_file));                            // no such file
  auto unaligned = good;
  unaligned[0] = {unaligned[0].file, unaligned[0].offset + 1, unaligned[0].length};
  EXPECT_TRUE(refused(unaligned));
  auto past_end = good;
  past_end.back().length += 4096;
  EXPECT_TRUE(refused(past_end));                              // beyond read_end
  auto empty = good;
  empty.push_back({0, 0, 0});
  EXPECT_TRUE(refused(empty));                                 // a zero-length read
}

}  // namespace
}  // namespace pinload
