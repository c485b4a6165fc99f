// Tests of the model cache (pinload/model_cache.h): LRU eviction under a
// budget, hits that read nothing (counted through the Env), bytes compared
// with the independent reader after many switches, invalidation when a file
// changes, device copies on the "sim" device, pool statistics, and concurrent
// gets (run under TSan too).
#include "pinload/model_cache.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <optional>
#include <random>
#include <thread>

#include "device_test_util.h"
#include "fault_env.h"
#include "file_check.h"
#include "pinload/error.h"
#include "test_files.h"

namespace pinload {
namespace {

namespace fs = std::filesystem;
using testing::FaultEnv;
using testing::Faults;
using testing::FileImage;
using testing::TempDir;
using testing::TensorSpec;

// One tensor layout for every model, so that every entry costs the same pool
// bytes; contents differ by seed. Odd sizes straddle the 4 KiB read blocks.
const std::vector<TensorSpec> kSpecs = {{"embed.weight", "BF16", {37, 129}},
                                        {"blocks.0.attn.weight", "F32", {61, 67}},
                                        {"blocks.0.norm", "F16", {4099}},
                                        {"blocks.1.attn.weight", "U8", {5, 3001}},
                                        {"empty", "F32", {0}},
                                        {"scalar", "I64", {}},
                                        {"head.weight", "BF16", {257, 31}}};

struct Model {
  std::string path;
  FileImage image;
};

Model write_model(const TempDir& dir, const std::string& name, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Model m{dir.file(name + ".safetensors"), testing::make_image(kSpecs, rng, 1)};
  testing::write_file(m.path, m.image.bytes());
  return m;
}

std::vector<Model> write_models(const TempDir& dir, int n) {
  std::vector<Model> out;
  for (int i = 0; i < n; ++i) out.push_back(write_model(dir, "m" + std::to_string(i), 100 + i));
  return out;
}

// Every tensor of the model, and nothing else, with the file's bytes.
void expect_model(const StateDict& sd, const Model& m) {
  ASSERT_EQ(sd.size(), kSpecs.size()) << m.path;
  testing::expect_matches_file(sd, m.path, m.image);
}

// Device tensors (read back from `device`) hold the file's bytes; no host copy.
void expect_model_on(Device& device, const StateDict& sd, const Model& m) {
  SCOPED_TRACE(m.path);
  ASSERT_EQ(sd.size(), kSpecs.size());
  const std::vector<char> file = testing::slurp(m.path);
  for (const testing::Layout& t : testing::layout_of(m.image)) {
    const Tensor& tensor = sd.at(t.name);
    EXPECT_FALSE(tensor.on_host()) << t.name;
    ASSERT_EQ(tensor.nbytes(), t.end - t.begin) << t.name;
    if (tensor.nbytes() == 0) continue;
    ASSERT_TRUE(tensor.on_device()) << t.name;
    const auto got = testing::read_back(device, *tensor.device_buffer(), tensor.device_offset(), tensor.nbytes());
    const std::uint64_t at = 8 + m.image.header_json.size() + t.begin;
    EXPECT_EQ(std::memcmp(got.data(), file.data() + at, got.size()), 0) << t.name;
  }
}

LoadOptions small_reads() {
  LoadOptions o;
  o.threads = 3;
  o.block_size = 4096;
  o.direct = DirectIo::kOff;
  o.cached_read = CachedRead::kPread;  // faults and counts are at the Env's pread
  return o;
}

std::shared_ptr<const Loader> loader_on(Env* env, std::shared_ptr<Pool> pool = nullptr) {
  return std::make_shared<const Loader>(small_reads(), std::move(pool), env);
}

// The pool bytes one model of kSpecs costs in the cache.
std::uint64_t entry_bytes(const Model& m) {
  ModelCache probe(UINT64_MAX);
  probe.get({m.path});
  return probe.stats().cached_bytes;
}

TEST(ModelCache, EvictsTheLeastRecentlyUsedModel) {
  TempDir dir;
  const auto ms = write_models(dir, 3);
  const std::uint64_t each = entry_bytes(ms[0]);
  ASSERT_GT(each, 0u);
  ModelCache cache(2 * each, loader_on(nullptr));
  cache.get({ms[0].path});
  cache.get({ms[1].path});
  cache.get({ms[0].path});  // 0 is now the most recent; 1 the least
  cache.get({ms[2].path});  // evicts 1
  EXPECT_TRUE(cache.contains({ms[0].path}));
  EXPECT_FALSE(cache.contains({ms[1].path}));
  EXPECT_TRUE(cache.contains({ms[2].path}));
  cache.get({ms[1].path});  // evicts 0
  EXPECT_FALSE(cache.contains({ms[0].path}));
  EXPECT_TRUE(cache.contains({ms[2].path}));
  const ModelCacheStats s = cache.stats();
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 4u);
  EXPECT_EQ(s.evictions, 2u);
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.cached_bytes, 2 * each);
  EXPECT_EQ(s.budget_bytes, 2 * each);
}

TEST(ModelCache, HitReadsNothingFromStorage) {
  TempDir dir;
  const auto ms = write_models(dir, 2);
  FaultEnv env;
  ModelCache cache(UINT64_MAX, loader_on(&env));
  expect_model(cache.get({ms[0].path}), ms[0]);
  cache.get({ms[1].path});
  const std::uint64_t reads = env.reads();
  ASSERT_GT(reads, 0u);
  for (int i = 0; i < 5; ++i) {
    expect_model(cache.get({ms[i % 2].path}), ms[i % 2]);
  }
  EXPECT_EQ(env.reads(), reads) << "a hit must not pread";
  EXPECT_EQ(env.open_fds(), 0);
  EXPECT_EQ(cache.stats().hits, 5u);
  EXPECT_EQ(cache.stats().misses, 2u);
}

// Switches among four models with room for two, in a random order, checking
// every result against the file and the hit/miss pattern against a reference
// LRU list kept by the test.
TEST(ModelCache, ManySwitchesKeepEveryByteRight) {
  TempDir dir;
  const auto ms = write_models(dir, 4);
  const std::uint64_t each = entry_bytes(ms[0]);
  FaultEnv env;
  ModelCache cache(2 * each, loader_on(&env));
  std::deque<int> reference;  // most recent first, at most 2
  std::uint64_t hits = 0, misses = 0;
  std::mt19937 rng(5);
  for (int i = 0; i < 60; ++i) {
    const int m = static_cast<int>(rng() % ms.size());
    const std::uint64_t reads = env.reads();
    const StateDict sd = cache.get({ms[m].path});
    expect_model(sd, ms[m]);
    auto at = std::find(reference.begin(), reference.end(), m);
    if (at != reference.end()) {
      ++hits;
      EXPECT_EQ(env.reads(), reads) << "switch " << i << " to model " << m << " should have been a hit";
      reference.erase(at);
    } else {
      ++misses;
      EXPECT_GT(env.reads(), reads) << "switch " << i;
      if (reference.size() == 2) reference.pop_back();
    }
    reference.push_front(m);
    if (HasFailure()) break;
  }
  const ModelCacheStats s = cache.stats();
  EXPECT_EQ(s.hits, hits);
  EXPECT_EQ(s.misses, misses);
  EXPECT_EQ(s.evictions, misses - 2);
  EXPECT_GT(hits, 10u);
  EXPECT_GT(misses, 10u);
}

TEST(ModelCache, SwitchingBetweenCachedModelsAllocatesNothing) {
  TempDir dir;
  const auto ms = write_models(dir, 3);
  auto pool = Pool::create_default();
  ModelCache cache(UINT64_MAX, loader_on(nullptr, pool));
  for (const Model& m : ms) cache.get({m.path});
  const PoolStats before = pool->stats();
  for (int i = 0; i < 30; ++i) expect_model(cache.get({ms[i % 3].path}), ms[i % 3]);
  const PoolStats after = pool->stats();
  EXPECT_EQ(after.os_reservations, before.os_reservations);
  EXPECT_EQ(after.allocations, before.allocations);
  EXPECT_EQ(after.in_use_bytes, before.in_use_bytes);
  EXPECT_EQ(after.in_use_bytes, cache.stats().cached_bytes);
}

// With room for one model and callers that drop their tensors, a miss evicts
// before it reads, so the new model lands in the evicted model's block.
TEST(ModelCache, AMissReusesTheBlocksOfTheModelItEvicts) {
  TempDir dir;
  const auto ms = write_models(dir, 2);
  auto pool = Pool::create_default();
  ModelCache cache(entry_bytes(ms[0]), loader_on(nullptr, pool));
  cache.get({ms[0].path});
  cache.get({ms[1].path});
  const PoolStats before = pool->stats();
  for (int i = 0; i < 10; ++i) expect_model(cache.get({ms[i % 2].path}), ms[i % 2]);
  const PoolStats after = pool->stats();
  EXPECT_EQ(cache.stats().misses, 12u);
  EXPECT_EQ(after.os_reservations, before.os_reservations);
  EXPECT_EQ(after.free_list_hits - before.free_list_hits, after.allocations - before.allocations);
  EXPECT_EQ(after.live_blocks, 1u);
}

TEST(ModelCache, ARewrittenFileIsAMiss) {
  TempDir dir;
  Model m = write_model(dir, "m", 1);
  FaultEnv env;
  ModelCache cache(UINT64_MAX, loader_on(&env));
  expect_model(cache.get({m.path}), m);
  const StateDict held = cache.get({m.path});  // a caller still holding the old model

  // Same size, new bytes and a new mtime.
  const auto mtime = fs::last_write_time(m.path);
  m = write_model(dir, "m", 2);
  fs::last_write_time(m.path, mtime + std::chrono::seconds(3));
  EXPECT_FALSE(cache.contains({m.path}));
  std::uint64_t reads = env.reads();
  expect_model(cache.get({m.path}), m);
  EXPECT_GT(env.reads(), reads);
  EXPECT_EQ(cache.stats().invalidations, 1u);
  EXPECT_EQ(cache.stats().entries, 1u);

  // A different size.
  std::mt19937_64 rng(3);
  std::vector<TensorSpec> bigger = kSpecs;
  bigger.push_back({"extra", "F32", {100}});
  m.image = testing::make_image(bigger, rng, 1);
  testing::write_file(m.path, m.image.bytes());
  reads = env.reads();
  const StateDict sd = cache.get({m.path});
  EXPECT_GT(env.reads(), reads);
  EXPECT_EQ(sd.size(), bigger.size());
  testing::expect_matches_file(sd, m.path, m.image);
  EXPECT_EQ(cache.stats().invalidations, 2u);
  EXPECT_EQ(cache.stats().misses, 3u);

  // The old state dict is untouched: it is a view of its own block.
  EXPECT_EQ(held.size(), kSpecs.size());
  EXPECT_EQ(cache.stats().entries, 1u);
}

TEST(ModelCache, ARemovedFileIsNotFound) {
  TempDir dir;
  const Model m = write_model(dir, "m", 1);
  ModelCache cache(UINT64_MAX, loader_on(nullptr));
  cache.get({m.path});
  fs::remove(m.path);
  EXPECT_FALSE(cache.contains({m.path}));
  EXPECT_THROW(cache.get({m.path}), NotFoundError);
  EXPECT_EQ(cache.stats().entries, 0u);
  EXPECT_EQ(cache.stats().cached_bytes, 0u);
}

// A folder and the file inside it are two spellings of one entry: the second
// reads the header, not the data.
TEST(ModelCache, AnotherSpellingOfTheSameFilesIsAHit) {
  TempDir dir;
  fs::create_directory(dir.path() / "folder");
  std::mt19937_64 rng(9);
  Model m{(dir.path() / "folder" / "model.safetensors").string(), testing::make_image(kSpecs, rng, 1)};
  testing::write_file(m.path, m.image.bytes());
  FaultEnv env;
  ModelCache cache(UINT64_MAX, loader_on(&env));
  cache.get({m.path});
  const std::uint64_t bytes = env.bytes_read();
  expect_model(cache.get({(dir.path() / "folder").string()}), m);
  EXPECT_LT(env.bytes_read() - bytes, m.image.data.size()) << "headers only";
  EXPECT_EQ(cache.stats().hits, 1u);
  EXPECT_EQ(cache.stats().entries, 1u);
  EXPECT_TRUE(cache.evict({(dir.path() / "folder").string()}));
  EXPECT_FALSE(cache.contains({m.path})) << "evicting the entry drops every spelling";
}

TEST(ModelCache, AModelLargerThanTheBudgetIsReturnedButNotCached) {
  TempDir dir;
  const auto ms = write_models(dir, 2);
  const std::uint64_t each = entry_bytes(ms[0]);
  // Two files are twice the budget: loaded, returned, not cached, nothing evicted for them.
  ModelCache small(each, loader_on(nullptr));
  small.get({ms[0].path});
  // A get that fails (two files with the same tensor names) leaves the cache as it was.
  EXPECT_THROW(small.get({ms[0].path, ms[1].path}), InvalidFileError);
  EXPECT_TRUE(small.contains({ms[0].path}));
  TempDir other;
  std::mt19937_64 rng(4);
  std::vector<TensorSpec> renamed;
  for (const TensorSpec& s : kSpecs) renamed.push_back({"other." + s.name, s.dtype, s.shape});
  const std::string second = other.file("b.safetensors");
  const FileImage image = testing::make_image(renamed, rng, 1);
  testing::write_file(second, image.bytes());
  const StateDict both = small.get({ms[0].path, second});
  EXPECT_EQ(both.size(), 2 * kSpecs.size());
  testing::expect_matches_file(both, ms[0].path, ms[0].image);
  testing::expect_matches_file(both, second, image);
  const ModelCacheStats s = small.stats();
  EXPECT_EQ(s.too_large, 1u);
  EXPECT_EQ(s.evictions, 0u);
  EXPECT_TRUE(small.contains({ms[0].path}));
  EXPECT_FALSE(small.contains({ms[0].path, second}));
}

TEST(ModelCache, EvictedBytesAreCountedUntilCallersLetGo) {
  TempDir dir;
  const auto ms = write_models(dir, 1);
  auto pool = Pool::create_default();
  ModelCache cache(UINT64_MAX, loader_on(nullptr, pool));
  std::optional<StateDict> held = cache.get({ms[0].path});
  const std::uint64_t bytes = cache.stats().cached_bytes;
  EXPECT_EQ(pool->stats().in_use_bytes, bytes);
  EXPECT_TRUE(cache.evict({ms[0].path}));
  EXPECT_FALSE(cache.evict({ms[0].path}));
  EXPECT_EQ(cache.stats().cached_bytes, 0u);
  EXPECT_EQ(cache.stats().evicted_live_bytes, bytes);
  EXPECT_EQ(pool->stats().in_use_bytes, bytes) << "the caller still holds the block";
  held.reset();
  EXPECT_EQ(cache.stats().evicted_live_bytes, 0u);
  EXPECT_EQ(pool->stats().in_use_bytes, 0u);
}

TEST(ModelCache, SetBudgetAndClearEvict) {
  TempDir dir;
  const auto ms = write_models(dir, 3);
  const std::uint64_t each = entry_bytes(ms[0]);
  ModelCache cache(3 * each, loader_on(nullptr));
  for (const Model& m : ms) cache.get({m.path});
  cache.get({ms[0].path});
  cache.set_budget(each);
  EXPECT_TRUE(cache.contains({ms[0].path}));
  EXPECT_EQ(cache.stats().entries, 1u);
  EXPECT_EQ(cache.stats().evictions, 2u);
  cache.clear();
  EXPECT_EQ(cache.stats().entries, 0u);
  EXPECT_EQ(cache.stats().cached_bytes, 0u);
  ModelCache none(0, loader_on(nullptr));
  expect_model(none.get({ms[1].path}), ms[1]);
  EXPECT_EQ(none.stats().too_large, 1u);
  EXPECT_EQ(none.stats().entries, 0u);
}

TEST(ModelCache, AFailedLoadCachesNothing) {
  TempDir dir;
  const auto ms = write_models(dir, 1);
  FaultEnv failing(Faults{.fail_read_at = 3});
  ModelCache cache(UINT64_MAX, loader_on(&failing));
  EXPECT_THROW(cache.get({ms[0].path}), IoError);
  EXPECT_EQ(cache.stats().entries, 0u);
  EXPECT_EQ(cache.stats().misses, 0u);
  expect_model(cache.get({ms[0].path}), ms[0]);  // no longer in flight: a fresh load
  EXPECT_EQ(cache.stats().misses, 1u);
}

TEST(ModelCache, RejectsALoaderWithADeviceTarget) {
  auto device = make_sim_device();
  LoadOptions options;
  options.target.device = device.get();
  EXPECT_THROW(ModelCache(1 << 20, std::make_shared<const Loader>(options)), InvalidArgumentError);
}

TEST(ModelCache, GetOnSimCopiesTheCachedModelWithoutReading) {
  auto device = make_sim_device();
  TempDir dir;
  const auto ms = write_models(dir, 2);
  FaultEnv env;
  auto pool = Pool::create(device->make_pinned_backend());
  ModelCache cache(UINT64_MAX, loader_on(&env, pool));
  const CopyOptions copy{2, 3000, 0};
  expect_model_on(*device, cache.get_on(*device, {ms[0].path}, copy), ms[0]);  // miss: read and copy pipelined
  expect_model(cache.get({ms[0].path}), ms[0]);                                // the host copy was cached
  expect_model_on(*device, cache.get_on(*device, {ms[1].path}, copy), ms[1]);
  const std::uint64_t reads = env.reads();
  const PoolStats before = pool->stats();
  for (int i = 0; i < 6; ++i) expect_model_on(*device, cache.get_on(*device, {ms[i % 2].path}, copy), ms[i % 2]);
  EXPECT_EQ(env.reads(), reads);
  EXPECT_EQ(pool->stats().allocations, before.allocations);
  EXPECT_EQ(cache.stats().hits, 7u);
  EXPECT_EQ(cache.stats().misses, 2u);
  // Device-only results hold no host block: evicting frees the pool memory.
  cache.clear();
  EXPECT_EQ(pool->stats().in_use_bytes, 0u);
}

// A switch back to a model cached in host memory that is not pinned (a host
// loader's pool) copies with no staging copy: the entry's blocks are
// registered with the device at its first switch and stay registered with
// the entry, so later switches register nothing (Note [Copies from mapped
// memory] in device_mapped.h; the counts: Note [Host copy counts]).
TEST(ModelCache, ASwitchBackCopiesWithNoStagingCopyAndRegistersOnce) {
  auto device = make_sim_device();
  TempDir dir;
  const auto ms = write_models(dir, 2);
  FaultEnv env;
  ModelCache cache(UINT64_MAX, loader_on(&env));
  for (const Model& m : ms) expect_model(cache.get({m.path}), m);  // cached on the host
  const CopyOptions copy{2, 3000, 0};
  expect_model_on(*device, cache.get_on(*device, {ms[0].path}, copy), ms[0]);
  expect_model_on(*device, cache.get_on(*device, {ms[1].path}, copy), ms[1]);
  const HostCopyCounts first = device->host_copy_counts();
  EXPECT_EQ(first.staged_bytes, 0u) << "a switch back staged bytes";
  EXPECT_GT(first.direct_bytes, 0u);
  EXPECT_GE(first.registrations, 2u);
  EXPECT_EQ(first.live_registrations, first.registrations);
  for (int i = 0; i < 4; ++i) expect_model_on(*device, cache.get_on(*device, {ms[i % 2].path}, copy), ms[i % 2]);
  const HostCopyCounts later = device->host_copy_counts();
  EXPECT_EQ(later.registrations, first.registrations) << "a later switch registered again";
  EXPECT_EQ(later.staged_bytes, 0u);
  EXPECT_EQ(later.direct_bytes, 3 * first.direct_bytes);
  cache.clear();  // the registrations go with the entries
  EXPECT_EQ(device->host_copy_counts().live_registrations, 0u);
  EXPECT_TRUE(device->registered_ranges().empty());
}

// Note [Registrations that last as long as the blocks]: a caller's tensors of
// an entry keep its registrations after the entry is evicted, so a copy from
// them never runs from a block whose registration went (on CUDA: unregistered
// under a DMA; on sim counted staged, or failed when queued registered).
TEST(ModelCache, RegistrationsLastAsLongAsACallersTensors) {
  auto device = make_sim_device();
  TempDir dir;
  const auto ms = write_models(dir, 1);
  FaultEnv env;
  ModelCache cache(UINT64_MAX, loader_on(&env));
  StateDict held = cache.get({ms[0].path});
  const CopyOptions copy{2, 3000, 0};
  expect_model_on(*device, cache.get_on(*device, {ms[0].path}, copy), ms[0]);
  const HostCopyCounts registered = device->host_copy_counts();
  ASSERT_GT(registered.live_registrations, 0u);
  cache.clear();  // the entry goes; `held` still holds its blocks
  EXPECT_EQ(device->host_copy_counts().live_registrations, registered.live_registrations);
  {
    const StateDict both = upload(held, *device, copy);  // its host tensors hold the blocks too
    std::vector<Tensor> on_device;
    for (const Tensor& t : both) on_device.emplace_back(t.name(), t.dtype(), t.shape(), t.device_buffer(), t.device_offset(), t.nbytes());
    expect_model_on(*device, StateDict(std::move(on_device), both.metadata()), ms[0]);
  }
  const HostCopyCounts after = device->host_copy_counts();
  EXPECT_EQ(after.staged_bytes, registered.staged_bytes) << "a copy from a held tensor lost its registration";
  EXPECT_EQ(after.expired_copies, 0u);
  held = StateDict();  // the last tensor goes: so do the registrations
  EXPECT_EQ(device->host_copy_counts().live_registrations, 0u);
  EXPECT_TRUE(device->registered_ranges().empty());
}

// A missing tensor names the model's file in every state dict the cache hands
// out: a miss, a hit, and the device copies of get_on (a miss that loads to
// the device, and a hit that uploads the host copy), which named none.
TEST(ModelCache, AMissingTensorNamesTheFile) {
  auto device = make_sim_device();
  TempDir dir;
  const auto ms = write_models(dir, 2);
  FaultEnv env;
  ModelCache cache(UINT64_MAX, loader_on(&env, Pool::create(device->make_pinned_backend())));
  auto message_of = [](const StateDict& sd) -> std::string {
    try {
      sd.at("no.such.tensor");
    } catch (const NotFoundError& e) {
      EXPECT_EQ(e.context().tensor, "no.such.tensor");
      return e.what();
    }
    ADD_FAILURE() << "no NotFoundError";
    return {};
  };
  const std::string in_0 = ms[0].path + ": tensor 'no.such.tensor': no such tensor in the file";
  const std::string in_1 = ms[1].path + ": tensor 'no.such.tensor': no such tensor in the file";
  EXPECT_EQ(message_of(cache.get({ms[0].path})), in_0);                        // miss
  EXPECT_EQ(message_of(cache.get({ms[0].path})), in_0);                        // hit
  EXPECT_EQ(message_of(cache.get_on(*device, {ms[0].path}, {})), in_0);        // hit, uploaded
  EXPECT_EQ(message_of(cache.get_on(*device, {ms[1].path}, {})), in_1);        // miss, loaded to the device
  EXPECT_EQ(message_of(cache.get({ms[1].path})), in_1);                        // its host copy
  EXPECT_EQ(cache.stats().misses, 2u);
}

// Several gets of one missing model at once: one load, shared.
TEST(ModelCacheConcurrency, OneMissingModelIsReadOnce) {
  TempDir dir;
  const auto ms = write_models(dir, 1);
  FaultEnv single;
  ModelCache(UINT64_MAX, loader_on(&single)).get({ms[0].path});
  FaultEnv env(Faults{.read_delay_us = 2000});
  ModelCache cache(UINT64_MAX, loader_on(&env));
  constexpr int kThreads = 4;
  std::vector<std::jthread> threads;
  std::vector<StateDict> results(kThreads);
  std::atomic<int> ready{0};
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      ready++;
      while (ready.load() < kThreads) std::this_thread::yield();
      results[i] = cache.get({ms[0].path});
    });
  }
  threads.clear();
  for (const StateDict& sd : results) expect_model(sd, ms[0]);
  const ModelCacheStats s = cache.stats();
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.hits + s.waits, kThreads - 1u);
  EXPECT_EQ(env.reads(), single.reads()) << "the model was read more than once";
  EXPECT_EQ(results[0][0].data(), results[kThreads - 1][0].data()) << "one block, shared";
}

TEST(ModelCacheConcurrency, ConcurrentSwitchesKeepEveryByteRight) {
  TempDir dir;
  const auto ms = write_models(dir, 3);
  auto device = make_sim_device();
  auto pool = Pool::create(device->make_pinned_backend());
  ModelCache cache(2 * entry_bytes(ms[0]), loader_on(nullptr, pool));
  std::vector<std::jthread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int i = 0; i < 15; ++i) {
        const Model& m = ms[rng() % ms.size()];
        if ((i + t) % 3 == 0) {
          expect_model_on(*device, cache.get_on(*device, {m.path}), m);
        } else {
          expect_model(cache.get({m.path}), m);
        }
        if (i % 7 == 6) cache.evict({m.path});
        (void)cache.stats();
      }
    });
  }
  threads.clear();
  const ModelCacheStats s = cache.stats();
  EXPECT_EQ(s.hits + s.misses + s.waits, 60u);
  EXPECT_LE(s.cached_bytes, s.budget_bytes);
  EXPECT_LE(s.entries, 2u);
  cache.clear();
  EXPECT_EQ(pool->stats().in_use_bytes, 0u);
}

}  // namespace
}  // namespace pinload
