// Prefetch and adoption (pinload/prefetch.h): every byte is read once across
// a prefetch and the load that adopts it (counted at the OS seam), blocks are
// handed over, cancel stops promptly and leaves nothing running, races of
// cancel and adopt stay correct (run under TSan), and a prefetch under a
// budget smaller than the model never holds more than the budget.
#include "pinload/prefetch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <tuple>

#include "device_test_util.h"
#include "fault_env.h"
#include "file_check.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::FaultEnv;
using testing::Faults;
using testing::FileImage;
using testing::TempDir;
using testing::expect_matches_file;

constexpr std::size_t KiB = 1024;

// Counts every pread that returned bytes, as (path, offset, bytes).
class CountingEnv : public testing::PathTrackingEnv {
 public:
  using Read = std::tuple<std::string, std::uint64_t, std::uint64_t>;
  explicit CountingEnv(Env* target) : PathTrackingEnv(target) {}
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    {
      std::unique_lock lock(gate_mu_);
      if (!gate_open_ && started_++ >= gate_after_) {
        ++gated_;
        gate_cv_.notify_all();
        gate_cv_.wait_for(lock, kGateTimeout, [&] { return gate_open_; });
      }
    }
    const std::int64_t n = PathTrackingEnv::pread(fd, buffer, bytes, offset);
    if (n > 0) {
      const std::string path = path_of(fd);
      std::lock_guard lock(mu_);
      reads_.emplace_back(path, offset, static_cast<std::uint64_t>(n));
    }
    return n;
  }
  std::vector<Read> sorted_reads() const {
    std::lock_guard lock(mu_);
    std::vector<Read> r = reads_;
    std::sort(r.begin(), r.end());
    return r;
  }
  std::size_t count() const {
    std::lock_guard lock(mu_);
    return reads_.size();
  }

  // Reads after the first `n` wait at a gate until open_gate(), or for
  // kGateTimeout each. A prefetch stopped meanwhile finishes the reads it has
  // in flight and starts no more, so it stays partial however the threads
  // are scheduled.
  void close_gate_after(std::uint64_t n) {
    std::lock_guard lock(gate_mu_);
    gate_after_ = n;
    gate_open_ = false;
  }
  void open_gate() {
    std::lock_guard lock(gate_mu_);
    gate_open_ = true;
    gate_cv_.notify_all();
  }
  // Waits until a read has reached the closed gate; false after 10 s.
  bool wait_gated() {
    std::unique_lock lock(gate_mu_);
    return gate_cv_.wait_for(lock, std::chrono::seconds(10), [&] { return gated_ > 0; });
  }

 private:
  static constexpr std::chrono::milliseconds kGateTimeout{20};
  std::mutex gate_mu_;
  std::condition_variable gate_cv_;
  bool gate_open_ = true;
  std::uint64_t gate_after_ = 0;
  std::uint64_t started_ = 0;
  std::uint64_t gated_ = 0;
  mutable std::mutex mu_;
  std::vector<Read> reads_;
};

// Every byte of [data_offset, size) of each file was read exactly once.
void expect_data_read_once(const std::vector<CountingEnv::Read>& reads, const std::string& path,
                           std::uint64_t data_offset, std::uint64_t size) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (const auto& [p, offset, n] : reads) {
    if (p != path) continue;
    const std::uint64_t b = std::max(offset, data_offset), e = std::min(offset + n, size);
    if (e > b) spans.emplace_back(b, e);
  }
  std::sort(spans.begin(), spans.end());
  std::uint64_t at = data_offset;
  for (const auto& [b, e] : spans) {
    ASSERT_EQ(b, at) << path << ": bytes from " << std::min(b, at) << " read " << (b < at ? "twice" : "never");
    at = e;
  }
  EXPECT_EQ(at, size) << path << ": the end was never read";
}

struct Model {
  std::string path;
  FileImage image;
  std::uint64_t data_offset() const { return 8 + image.header_json.size(); }
  std::uint64_t size() const { return data_offset() + image.data.size(); }
};

// Two files of about 600 KiB and 300 KiB.
struct Models {
  TempDir dir;
  std::vector<Model> files;
  Models() {
    std::mt19937_64 rng(3);
    for (auto [name, count] : {std::pair{"a", 40}, std::pair{"b", 20}}) {
      Model m{dir.file(std::string(name) + ".safetensors"), {}};
      m.image = testing::write_random_checkpoint(m.path, rng, count, 8000, std::string(name) + ".");
      files.push_back(std::move(m));
    }
  }
  std::vector<std::string> paths() const { return {files[0].path, files[1].path}; }
  void expect_matches(const StateDict& sd) const {
    for (const Model& m : files) expect_matches_file(sd, m.path, m.image);
  }
  void expect_read_once(const CountingEnv& env) const {
    const auto reads = env.sorted_reads();
    for (const Model& m : files) expect_data_read_once(reads, m.path, m.data_offset(), m.size());
  }
};

const Models& models() {
  static const Models m;
  return m;
}

LoadOptions options(unsigned threads = 3) {
  LoadOptions o;
  o.threads = threads;
  o.block_size = 8 * KiB;
  o.direct = DirectIo::kOff;
  o.cached_read = CachedRead::kPread;  // reads are counted at the Env's pread
  o.files_in_flight = 1;
  o.zero_copy = ZeroCopy::kOff;  // read, never handed out as a mapping
  return o;
}

// A counting env over a fault env (delays, fd tracking), a pool and a loader.
struct Rig {
  explicit Rig(Faults f = {}, LoadOptions o = options(), PoolOptions pool_options = {})
      : faults(f), env(&faults), pool(Pool::create(make_locked_memory_backend(&env), pool_options)),
        loader(o, pool, &env) {}
  FaultEnv faults;
  CountingEnv env;
  std::shared_ptr<Pool> pool;
  Loader loader;
};

class PrefetchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::thread([] {}).join();  // sanitizers start a helper thread on the first one
    baseline_threads_ = testing::stable_thread_count();
  }
  void expect_threads_at_baseline() {
    EXPECT_EQ(testing::settled_thread_count(baseline_threads_), baseline_threads_);
  }
  static void wait_for_bytes(const Prefetch& p, std::uint64_t bytes) {
    for (int i = 0; i < 5000 && p.progress().bytes_done < bytes && !p.done(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  int baseline_threads_ = 0;
};

// A plain load's reads, as the reference multiset.
std::vector<CountingEnv::Read> plain_load_reads() {
  Rig rig;
  models().expect_matches(rig.loader.load(models().paths()));
  return rig.env.sorted_reads();
}

TEST_F(PrefetchTest, FullPrefetchThenLoadReadsNothingAndHandsBlocksOver) {
  Rig rig;
  Prefetch p = prefetch(rig.loader, models().paths());
  p.wait();
  EXPECT_TRUE(p.done());
  EXPECT_EQ(p.progress().bytes_done, p.progress().bytes_total);
  const std::size_t reads = rig.env.count();
  const PoolStats before = rig.pool->stats();
  const StateDict sd = rig.loader.load(models().paths(), LoadRequest{{}, &p});
  EXPECT_EQ(rig.env.count(), reads) << "the load read again what the prefetch had read";
  EXPECT_EQ(rig.pool->stats().allocations, before.allocations) << "blocks must be handed over, not copied";
  EXPECT_TRUE(p.adopted());
  models().expect_matches(sd);
  models().expect_read_once(rig.env);
  EXPECT_EQ(rig.env.sorted_reads(), plain_load_reads());
}

// Two header reads per file come first.
constexpr std::uint64_t kHeaderReads = 4;

TEST_F(PrefetchTest, AdoptAfterAPartialPrefetchReadsEachByteOnce) {
  Rig rig;
  rig.env.close_gate_after(kHeaderReads + 10);
  Prefetch p = prefetch(rig.loader, models().paths());
  ASSERT_TRUE(rig.env.wait_gated());
  std::jthread opener([&] {  // once the load has taken the prefetch over
    while (!p.adopted()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    rig.env.open_gate();
  });
  const StateDict sd = rig.loader.load(p);
  EXPECT_GT(p.progress().bytes_done, 0u);
  EXPECT_LT(p.progress().bytes_done, p.progress().bytes_total) << "the prefetch should have been partial";
  models().expect_matches(sd);
  models().expect_read_once(rig.env);
  EXPECT_EQ(rig.env.sorted_reads(), plain_load_reads()) << "prefetch + load must read exactly what a load reads";
}

TEST_F(PrefetchTest, AdoptAfterCancel) {
  Rig rig;
  rig.env.close_gate_after(kHeaderReads + 10);
  Prefetch p = prefetch(rig.loader, models().paths());
  ASSERT_TRUE(rig.env.wait_gated());
  p.cancel();
  rig.env.open_gate();
  EXPECT_TRUE(p.done());
  EXPECT_GT(p.progress().bytes_done, 0u);
  EXPECT_LT(p.progress().bytes_done, p.progress().bytes_total);
  expect_threads_at_baseline();
  const std::uint64_t read_before = p.progress().bytes_done;
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(p.progress().bytes_done, read_before) << "nothing may be read after cancel() returns";
  const StateDict sd = rig.loader.load(p);
  models().expect_matches(sd);
  models().expect_read_once(rig.env);
}

TEST_F(PrefetchTest, AsynchronousLoadOwnsAndAdoptsThePrefetch) {
  Rig rig(Faults{.read_delay_us = 200});
  Prefetch p = prefetch(rig.loader, models().paths());
  wait_for_bytes(p, 32 * KiB);
  LoadHandle handle = rig.loader.load_async(std::move(p));
  // Tensors are handed out as they arrive, the adopted ones included.
  std::size_t handed_out = 0;
  for (std::vector<Tensor> ready; !(ready = handle.next_ready()).empty();) handed_out += ready.size();
  const StateDict sd = handle.wait();
  EXPECT_EQ(handed_out, sd.size());
  EXPECT_EQ(handle.progress().bytes_done, handle.progress().bytes_total);
  models().expect_matches(sd);
  models().expect_read_once(rig.env);
}

TEST_F(PrefetchTest, CancelReleasesBlocksNothingWasReadIntoAndDestroyReleasesAll) {
  Rig rig;
  rig.env.close_gate_after(kHeaderReads + 1);
  {
    Prefetch p = prefetch(rig.loader, models().paths());
    ASSERT_TRUE(rig.env.wait_gated());
    p.cancel();
    rig.env.open_gate();
    expect_threads_at_baseline();
    ASSERT_LT(p.progress().bytes_done, models().files[0].size()) << "cancelled inside the first file";
    EXPECT_EQ(rig.pool->stats().live_blocks, 1u) << "the second file's block holds nothing and must go";
  }
  EXPECT_EQ(rig.pool->stats().in_use_bytes, 0u);
  EXPECT_EQ(rig.pool->stats().live_blocks, 0u);
  EXPECT_EQ(rig.faults.open_fds(), 0);
  expect_threads_at_baseline();
}

TEST_F(PrefetchTest, DestroyingARunningPrefetchStopsItAndReleasesEverything) {
  Rig rig(Faults{.read_delay_us = 1000});
  {
    Prefetch p = prefetch(rig.loader, models().paths());
    wait_for_bytes(p, 1);
  }
  EXPECT_EQ(rig.pool->stats().live_blocks, 0u);
  EXPECT_EQ(rig.faults.open_fds(), 0);
  expect_threads_at_baseline();
}

TEST_F(PrefetchTest, LoadOfOtherPathsDropsThePrefetch) {
  Rig rig;
  Prefetch p = prefetch(rig.loader, {models().files[1].path});
  p.wait();
  const StateDict sd = rig.loader.load({models().files[0].path}, LoadRequest{{}, &p});
  expect_matches_file(sd, models().files[0].path, models().files[0].image);
  EXPECT_EQ(rig.pool->stats().live_blocks, 1u) << "the dropped prefetch's block must be released";
}

TEST_F(PrefetchTest, EmptyPrefetchAndFailedPrefetch) {
  Rig rig;
  Prefetch empty;
  EXPECT_TRUE(empty.done());
  EXPECT_THROW(rig.loader.load(empty), InvalidArgumentError);
  // A prefetch that fails leaves nothing; the load reports its own error.
  Prefetch missing = prefetch(rig.loader, {models().dir.file("missing.safetensors")});
  missing.wait();
  EXPECT_THROW(rig.loader.load(missing), NotFoundError);
  // A read that failed in the prefetch (once) is read again by the load.
  Rig failing(Faults{.fail_read_at = 6});
  Prefetch p = prefetch(failing.loader, models().paths());
  p.wait();
  EXPECT_LT(p.progress().bytes_done, p.progress().bytes_total);
  models().expect_matches(failing.loader.load(p));
  models().expect_read_once(failing.env);
}

TEST_F(PrefetchTest, LoadStoppedWhileAdoptingIsCancelled) {
  Rig rig(Faults{.read_delay_us = 1000});
  Prefetch p = prefetch(rig.loader, models().paths());
  wait_for_bytes(p, 1);
  std::stop_source stop;
  stop.request_stop();
  EXPECT_THROW(rig.loader.load(p, LoadRequest{stop.get_token()}), CancelledError);
  EXPECT_EQ(rig.pool->stats().live_blocks, 0u);
  expect_threads_at_baseline();
}

// Cancel and adopt from two threads at random moments: the load is always
// byte-exact and reads every byte once, whoever wins. Meant for TSan.
TEST_F(PrefetchTest, CancelAdoptRaces) {
  std::mt19937 rng(42);
  for (int round = 0; round < 40; ++round) {
    SCOPED_TRACE(round);
    Rig rig(Faults{.read_delay_us = static_cast<std::uint32_t>(rng() % 200)}, options(1 + rng() % 4));
    Prefetch p = prefetch(rig.loader, models().paths());
    const auto delay = std::chrono::microseconds(rng() % 3000);
    const auto cancel_delay = std::chrono::microseconds(rng() % 3000);
    std::jthread canceller([&] {
      std::this_thread::sleep_for(cancel_delay);
      p.cancel();
      (void)p.progress();
      (void)p.done();
    });
    std::this_thread::sleep_for(delay);
    const StateDict sd = rig.loader.load(p);
    canceller.join();
    models().expect_matches(sd);
    models().expect_read_once(rig.env);
    if (::testing::Test::HasFailure()) break;
  }
  expect_threads_at_baseline();
}

// ---- memory budget with burn-after-reading ----

// A prefetch for a streaming device load with a budget of half the model:
// it reads up to the budget and waits; the load then streams the rest, and
// host memory never exceeds the budget plus one block.
TEST_F(PrefetchTest, PrefetchUnderHalfTheModelBudgetStaysWithinIt) {
  auto device = make_sim_device();
  const Model& m = models().files[0];
  const std::uint64_t model_bytes = m.size();
  const std::size_t block = 16 * KiB;
  const std::uint64_t budget = model_bytes / 2 / block * block;
  LoadOptions o = options(3);
  o.block_size = block;
  o.target = {device.get(), DeviceMode::kStreaming, CopyOptions{2, 8 * KiB, 0}, budget};
  FaultEnv faults;
  CountingEnv env(&faults);
  Loader loader(o, nullptr, &env);
  Prefetch p = prefetch(loader, {m.path});
  // The prefetch fills the budget, then waits for memory only the load frees.
  for (int i = 0; i < 5000 && loader.staging_pool()->stats().budget_waits == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_GT(loader.staging_pool()->stats().budget_waits, 0u) << "the prefetch should wait at the budget";
  EXPECT_FALSE(p.done());
  EXPECT_LE(p.progress().bytes_done, budget);
  const StateDict sd = loader.load(p);
  const PoolStats staging = loader.staging_pool()->stats();
  EXPECT_LE(staging.peak_in_use_bytes, budget + block);
  EXPECT_LE(staging.peak_reserved_bytes, budget + block);
  EXPECT_EQ(staging.live_blocks, 0u) << "every staging block is released after its copy";
  EXPECT_EQ(loader.pool()->stats().peak_reserved_bytes, 0u) << "streaming must not use whole-file blocks";
  // Device bytes equal the file's.
  const std::vector<char> file = testing::slurp(m.path);
  for (const testing::Layout& l : testing::layout_of(m.image)) {
    const Tensor& t = sd.at(l.name);
    ASSERT_TRUE(t.on_device() && !t.on_host()) << l.name;
    if (t.nbytes() == 0) continue;
    const std::vector<std::byte> got = testing::read_back(*device, *t.device_buffer(), t.device_offset(), t.nbytes());
    ASSERT_EQ(std::memcmp(got.data(), file.data() + m.data_offset() + l.begin, got.size()), 0) << l.name;
  }
  expect_data_read_once(env.sorted_reads(), m.path, m.data_offset(), m.size());
}

TEST_F(PrefetchTest, CachedDeviceLoadAdoptsAHostPrefetch) {
  auto device = make_sim_device();
  LoadOptions o = options();
  o.target.device = device.get();
  FaultEnv faults;
  CountingEnv env(&faults);
  Loader loader(o, nullptr, &env);
  Prefetch p = prefetch(loader, models().paths());
  p.wait();
  const std::size_t reads = env.count();
  const StateDict sd = loader.load(p);
  EXPECT_EQ(env.count(), reads);
  models().expect_matches(sd);
  const Model& m = models().files[1];
  const std::vector<char> file = testing::slurp(m.path);
  for (const testing::Layout& l : testing::layout_of(m.image)) {
    const Tensor& t = sd.at(l.name);
    if (t.nbytes() == 0) continue;
    const auto got = testing::read_back(*device, *t.device_buffer(), t.device_offset(), t.nbytes());
    ASSERT_EQ(std::memcmp(got.data(), file.data() + m.data_offset() + l.begin, got.size()), 0) << l.name;
  }
}

TEST_F(PrefetchTest, RecordedTemplateIncludesThePrefetchedReads) {
  Rig rig(Faults{.read_delay_us = 200});
  Prefetch p = prefetch(rig.loader, models().paths());
  wait_for_bytes(p, 64 * KiB);
  IoTemplate t;
  LoadRequest request;
  request.record = &t;
  models().expect_matches(rig.loader.load(p, request));
  const TemplateReads* host = t.find(kHostDestination);
  ASSERT_NE(host, nullptr);
  std::uint64_t bytes = 0;
  for (const TemplateRead& r : host->reads) bytes += r.length;
  EXPECT_GE(bytes, models().files[0].image.data.size() + models().files[1].image.data.size());
  EXPECT_LE(bytes, models().files[0].size() + models().files[1].size() + 2 * 4096);
}

}  // namespace
}  // namespace pinload
