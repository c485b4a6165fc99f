// A streaming host load (HandOut::kStream) within a pool budget smaller than
// the checkpoint: Note [Streaming within a budget] in io/stream_budget.h.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fault_env.h"
#include "io/read_session.h"
#include "io/stream_budget.h"
#include "pinload/checkpoint.h"
#include "pinload/error.h"
#include "pinload/host_memory.h"
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

// Plain memory whose next reserve() first runs a hook, then fails.
class RefusingOnceBackend final : public HostMemoryBackend {
 public:
  RefusingOnceBackend() : inner_(make_locked_memory_backend(default_env(), {HugePages::kOff, false, -1})) {}
  HostRange reserve(std::size_t bytes) override {
    if (std::function<void()> hook = std::exchange(before_refusal_, {})) {
      hook();
      throw OutOfMemoryError("test backend refused");
    }
    return inner_->reserve(bytes);
  }
  void release(const HostRange& range) noexcept override { inner_->release(range); }
  std::size_t alignment() const noexcept override { return inner_->alignment(); }
  std::string_view name() const noexcept override { return "refusing once"; }
  void refuse_next(std::function<void()> hook) { before_refusal_ = std::move(hook); }

 private:
  std::unique_ptr<HostMemoryBackend> inner_;
  std::function<void()> before_refusal_;
};

// The pool refuses a block the budget has room for, and meanwhile the
// load's last block comes back: the budget tries again. It used to call
// that a stall (nothing in progress, the consumer waiting) and fail.
TEST(StreamBudgetTest, ABlockReturnedWhileThePoolRefusesIsTakenNotCalledAStall) {
  auto owned = std::make_unique<RefusingOnceBackend>();
  RefusingOnceBackend& backend = *owned;
  PoolOptions pool_options;
  pool_options.slab_bytes = 1 * kMiB;  // each block below is a reservation of its own
  const std::shared_ptr<Pool> pool = Pool::create(std::move(owned), pool_options);
  detail::StreamBudget budget(pool, 12 * kMiB, [] { return true; });
  std::shared_ptr<Block> first = budget.allocate(4 * kMiB, "first", {});
  ASSERT_EQ(budget.held_bytes(), 4 * kMiB);
  backend.refuse_next([&] { first.reset(); });
  within_a_minute([&] {
    const std::shared_ptr<Block> second = budget.allocate(8 * kMiB, "second", {});
    ASSERT_NE(second, nullptr);
    EXPECT_EQ(second->size(), 8 * kMiB);
  });
  EXPECT_EQ(first, nullptr);
  EXPECT_EQ(budget.held_bytes(), 0u);
}

// Reads pread, and those of `path` at or past `offset` late.
class LateTailEnv final : public testing::PathTrackingEnv {
 public:
  LateTailEnv(std::string path, std::uint64_t offset)
      : PathTrackingEnv(default_env()), path_(std::move(path)), offset_(offset) {}
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    if (offset >= offset_ && path_of(fd) == path_) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return PathTrackingEnv::pread(fd, buffer, bytes, offset);
  }

 private:
  std::string path_;
  std::uint64_t offset_;
};

// A reader still holds a file's block after the file's last read (its own,
// earlier chunk's sink has not returned). The next file's block waits for it:
// the file is in progress until every reader has let go. It used to end when
// the last read was handed out, and the next file's wait called the reader's
// hold a stall of a consumer that holds nothing.
TEST(StreamBudgetTest, AFileIsInProgressUntilEveryReaderLetsGoOfItsBlock) {
  Shards shards;
  std::mt19937_64 rng(11);
  for (int f = 0; f < 2; ++f) {
    const FileImage image = testing::make_image({{"f" + std::to_string(f), "U8", {3 * kMiB / 2}}}, rng);
    shards.paths.push_back(shards.dir.file("f" + std::to_string(f) + ".safetensors"));
    testing::write_file(shards.paths.back(), image.bytes());
  }
  LoadOptions options = budget_options(0);
  options.cached_read = CachedRead::kPread;
  options.files_in_flight = 1;
  const Checkpoint checkpoint = open_checkpoint(default_env(), shards.paths);
  detail::ReadCounters counters;
  // The plan first, to find where file 0's first chunk ends.
  const ReadPlan plan =
      detail::ReadSession::open(default_env(), options.read_options(), checkpoint, nullptr, nullptr, &counters)->plan();
  std::vector<std::size_t> file0;
  for (std::size_t i = 0; i < plan.chunks.size(); ++i) {
    if (plan.chunks[i].file == 0) file0.push_back(i);
  }
  ASSERT_GE(file0.size(), 2u);
  std::size_t head = file0[0];
  for (std::size_t i : file0) {
    if (plan.chunks[i].index == 0) head = i;
  }
  LateTailEnv env(shards.paths[0], plan.chunks[head].offset + plan.chunks[head].length);
  std::unique_ptr<detail::ReadSession> session =
      detail::ReadSession::open(&env, options.read_options(), checkpoint, nullptr, nullptr, &counters);
  const std::shared_ptr<Pool> pool = Pool::create_default();
  const std::uint64_t cls0 = Pool::size_class(plan.files[0].block_bytes());
  const std::uint64_t cls1 = Pool::size_class(plan.files[1].block_bytes());
  session->set_budget(std::make_unique<detail::StreamBudget>(pool, cls0 + cls1 - 1, [] { return true; }));
  session->allocate_blocks(*pool, {});

  std::mutex mu;
  std::condition_variable cv;
  std::size_t file0_sunk = 0;  // file 0's sinks that returned
  std::atomic<bool> head_read_first{false};
  auto file_read = [&](std::size_t file) {
    for (std::size_t i = 0; i < plan.chunks.size(); ++i) {
      if (plan.chunks[i].file == file && !session->chunk_done(i)) return false;
    }
    return true;
  };
  auto sink = [&](std::size_t i, std::shared_ptr<Block> block, std::size_t) {
    const ReadChunk& c = plan.chunks[i];
    if (i == head) {
      head_read_first = !file_read(0);
      // Hold the block until the file's other chunks are handed out, and then a while.
      std::unique_lock lock(mu);
      cv.wait_for(lock, std::chrono::seconds(20), [&] { return file0_sunk == file0.size() - 1; });
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      return;
    }
    if (file_read(c.file)) session->release_block(c.file);
    if (c.file == 0) {
      block.reset();
      std::lock_guard lock(mu);
      ++file0_sunk;
      cv.notify_all();
    }
  };
  std::vector<std::size_t> todo(plan.chunks.size());
  for (std::size_t i = 0; i < todo.size(); ++i) todo[i] = i;
  within_a_minute([&] { session->execute(todo, 3, {}, &counters, {}, sink); });
  EXPECT_TRUE(head_read_first) << "the test's premise: file 0's first chunk was not its last read";
  for (std::size_t i = 0; i < plan.chunks.size(); ++i) EXPECT_TRUE(session->chunk_done(i)) << i;
}

}  // namespace
}  // namespace pinload
