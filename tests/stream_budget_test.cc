// A streaming host load (HandOut::kStream) within a pool budget smaller than
// the checkpoint: Note [Streaming within a budget] in io/stream_budget.h.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pinload/error.h"
#include "pinload/loader.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::FileImage;
using testing::TempDir;
using testing::TensorSpec;

constexpr std::uint64_t kMiB = 1u << 20;

struct Shards {
  TempDir dir;
  std::vector<std::string> paths;
  std::map<std::string, std::vector<std::uint8_t>> bytes;  // name -> the file's bytes of it
  std::uint64_t total = 0;
};

// `count` shards of 4 tensors of `tensor_bytes` each; contents kept for comparison.
void write_shards(Shards* out, int count, std::uint64_t tensor_bytes) {
  std::mt19937_64 rng(7);
  for (int s = 0; s < count; ++s) {
    std::vector<TensorSpec> specs;
    for (int t = 0; t < 4; ++t) specs.push_back({"s" + std::to_string(s) + ".t" + std::to_string(t), "U8", {tensor_bytes}});
    FileImage image = testing::make_image(specs, rng);
    const std::string path = out->dir.file("shard" + std::to_string(s) + ".safetensors");
    testing::write_file(path, image.bytes());
    out->paths.push_back(path);
    for (int t = 0; t < 4; ++t) {
      const auto begin = image.data.begin() + static_cast<std::ptrdiff_t>(t * tensor_bytes);
      out->bytes[specs[t].name].assign(begin, begin + static_cast<std::ptrdiff_t>(tensor_bytes));
    }
    out->total += image.bytes().size();
  }
}

LoadOptions budget_options(std::uint64_t pool_bytes) {
  LoadOptions o;
  o.pool_bytes = pool_bytes;
  o.threads = 4;
  o.block_size = 1 * kMiB;
  o.direct = DirectIo::kOff;
  return o;
}

// Runs `body` on a thread of its own; fails (rather than hangs) after 60 s.
template <typename F>
void within_a_minute(F body) {
  auto done = std::async(std::launch::async, body);
  ASSERT_EQ(done.wait_for(std::chrono::seconds(60)), std::future_status::ready) << "hung";
  done.get();
}

TEST(StreamBudgetTest, StreamsACheckpointLargerThanTheBudgetWhileTheConsumerDrops) {
  Shards shards;
  write_shards(&shards, 8, 1 * kMiB);  // 8 shards of 4 MiB
  const std::uint64_t budget = 10 * kMiB;
  ASSERT_GT(shards.total, 2 * budget);
  Loader loader(budget_options(budget));
  // The whole checkpoint at once cannot fit: a kWhole load is refused.
  EXPECT_THROW(loader.load(shards.paths), OutOfMemoryError);
  within_a_minute([&] {
    LoadHandle handle = loader.load_async(shards.paths, HandOut::kStream);
    std::size_t seen = 0;
    for (;;) {
      const std::vector<Tensor> ready = handle.next_ready();
      if (ready.empty()) break;
      for (const Tensor& t : ready) {
        const std::vector<std::uint8_t>& want = shards.bytes.at(t.name());
        ASSERT_EQ(t.nbytes(), want.size()) << t.name();
        EXPECT_EQ(std::memcmp(t.data(), want.data(), want.size()), 0) << t.name();
        ++seen;
      }
    }  // each batch dropped before the next is asked for
    EXPECT_EQ(seen, shards.bytes.size());
    EXPECT_TRUE(handle.wait().empty());
  });
  const PoolStats stats = loader.pool()->stats();
  EXPECT_LE(stats.peak_in_use_bytes, budget);
  EXPECT_LE(stats.peak_reserved_bytes, budget);
  EXPECT_GT(stats.budget_waits + stats.os_releases + stats.free_list_hits, 0u);  // blocks came back and were reused
  EXPECT_EQ(stats.in_use_bytes, 0u);
}

TEST(StreamBudgetTest, AConsumerThatKeepsEveryTensorGetsAnErrorNotAHang) {
  Shards shards;
  write_shards(&shards, 8, 1 * kMiB);
  Loader loader(budget_options(10 * kMiB));
  within_a_minute([&] {
    LoadHandle handle = loader.load_async(shards.paths, HandOut::kStream);
    std::vector<Tensor> kept;
    try {
      for (std::vector<Tensor> ready = handle.next_ready(); !ready.empty(); ready = handle.next_ready()) {
        kept.insert(kept.end(), ready.begin(), ready.end());
      }
      FAIL() << "every tensor was handed out within the budget";
    } catch (const OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what()).find("stalled"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(".safetensors"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(kept.empty());
    EXPECT_LT(kept.size(), shards.bytes.size());
  });
  EXPECT_LE(loader.pool()->stats().peak_in_use_bytes, 10 * kMiB);
}

TEST(StreamBudgetTest, AFileLargerThanTheBudgetFailsBeforeReading) {
  Shards shards;
  write_shards(&shards, 1, 4 * kMiB);  // one 16 MiB file
  Loader loader(budget_options(10 * kMiB));
  within_a_minute([&] {
    LoadHandle handle = loader.load_async(shards.paths, HandOut::kStream);
    try {
      handle.next_ready();
      FAIL() << "no error";
    } catch (const OutOfMemoryError& e) {
      EXPECT_EQ(e.context().file, shards.paths[0]);
      EXPECT_NE(std::string(e.what()).find("streaming budget"), std::string::npos) << e.what();
    }
    EXPECT_EQ(handle.progress().bytes_done, 0u);
  });
  EXPECT_EQ(loader.pool()->stats().peak_in_use_bytes, 0u);
}

TEST(StreamBudgetTest, AWaitForTheConsumerIsCancellable) {
  Shards shards;
  write_shards(&shards, 8, 1 * kMiB);
  Loader loader(budget_options(10 * kMiB));
  within_a_minute([&] {
    LoadHandle handle = loader.load_async(shards.paths, HandOut::kStream);
    std::vector<Tensor> kept = handle.next_ready();
    // Not asking for more: the reader waits for the consumer (not a stall).
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_FALSE(handle.done());
    handle.cancel();
    EXPECT_THROW(handle.wait(), CancelledError);
  });
  EXPECT_EQ(loader.pool()->stats().in_use_bytes, 0u);
}

}  // namespace
}  // namespace pinload
