// Loads to a device (the CPU stand-in "sim", or CUDA where present): device
// bytes equal the file's, staging blocks are never recycled before their
// copies complete, streaming stays within its host budget, and faults or
// cancellation in the middle of a load release everything.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <random>

#include "device_test_util.h"
#include "fault_env.h"
#include "file_check.h"
#include "io/leased_mapping.h"
#include "load/device_mapped.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::FaultEnv;
using testing::Faults;
using testing::TensorSpec;

struct Model {
  std::vector<TensorSpec> specs;
  testing::FileImage image;
  std::vector<std::uint64_t> offsets;  // each tensor's start in image.data
};

// Odd sizes so that tensors straddle read blocks and copy chunks.
Model write_model(const std::string& path, std::uint64_t seed, int count = 24) {
  std::mt19937_64 rng(seed);
  Model m;
  for (int i = 0; i < count; ++i) {
    m.specs.push_back({"blocks." + std::to_string(i) + ".weight", i % 3 == 0 ? "BF16" : (i % 3 == 1 ? "U8" : "F32"),
                       {static_cast<std::uint64_t>(1 + rng() % 300), static_cast<std::uint64_t>(1 + rng() % 700)}});
  }
  m.specs.push_back({"empty", "F16", {0}});
  m.specs.push_back({"scalar", "I64", {}});
  m.image = testing::make_image(m.specs, rng, 1);
  std::uint64_t at = 0;
  for (const TensorSpec& s : m.specs) {
    m.offsets.push_back(at);
    std::uint64_t n = 1;
    for (auto d : s.shape) n *= d;
    at += n * testing::spec_bits(s.dtype) / 8;
  }
  testing::write_file(path, m.image.bytes());
  return m;
}

// Reads every tensor back from the device and compares with the file image.
void expect_device_matches(Device& device, const StateDict& sd, const Model& m) {
  ASSERT_EQ(sd.size(), m.specs.size());
  for (std::size_t i = 0; i < m.specs.size(); ++i) {
    const Tensor& t = sd.at(m.specs[i].name);
    ASSERT_TRUE(t.on_device()) << t.name();
    std::vector<std::uint8_t> got(t.nbytes());
    if (!got.empty()) device.copy_to_host(got.data(), *t.device_buffer(), t.device_offset(), got.size());
    const auto begin = m.image.data.begin() + static_cast<std::ptrdiff_t>(m.offsets[i]);
    ASSERT_TRUE(std::equal(got.begin(), got.end(), begin)) << t.name() << " differs on " << device.name();
  }
}

struct Case {
  const char* device;
  DeviceMode mode;
  std::size_t block_size;
  std::size_t chunk_bytes;
  std::size_t streams;
};

class DeviceLoadTest : public ::testing::TestWithParam<Case> {};

TEST_P(DeviceLoadTest, DeviceBytesEqualTheFile) {
  const Case c = GetParam();
  std::unique_ptr<Device> device;
  if (std::string(c.device) == "cuda") {
    std::string why;
    if (!cuda_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
    device = open_device("cuda:0");
  } else {
    device = make_sim_device();
  }
  testing::TempDir dir;
  const Model m = write_model(dir.file("m.safetensors"), 7);
  // The file is in the page cache: copied from its mapping (kAuto), or read
  // into pinned blocks first (kOff).
  for (const ZeroCopy zero_copy : {ZeroCopy::kAuto, ZeroCopy::kOff}) {
    SCOPED_TRACE(zero_copy_name(zero_copy));
    LoadOptions options;
    options.threads = 4;
    options.block_size = c.block_size;
    options.zero_copy = zero_copy;
    options.target.device = device.get();
    options.target.mode = c.mode;
    options.target.copy.chunk_bytes = c.chunk_bytes;
    options.target.copy.streams = c.streams;
    options.target.staging_bytes = 4 * Pool::size_class(c.block_size);
    Loader loader(options);
    const StateDict sd = loader.load({dir.file("m.safetensors")});
    expect_device_matches(*device, sd, m);
    for (const Tensor& t : sd) EXPECT_EQ(t.on_host(), c.mode == DeviceMode::kCached) << t.name();

    // Handed out one by one (Note [Ready tensors]): only once their copies are done.
    LoadHandle handle = loader.load_async({dir.file("m.safetensors")});
    std::vector<Tensor> ready;
    for (std::vector<Tensor> more = handle.next_ready(); !more.empty(); more = handle.next_ready()) {
      for (Tensor& t : more) ready.push_back(std::move(t));
    }
    expect_device_matches(*device, StateDict(std::move(ready)), m);
    EXPECT_EQ(handle.progress().files_zero_copy, zero_copy == ZeroCopy::kAuto ? 1u : 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, DeviceLoadTest,
                         ::testing::Values(Case{"sim", DeviceMode::kCached, 4096, 3000, 1},
                                           Case{"sim", DeviceMode::kCached, 64 << 10, 1 << 20, 2},
                                           Case{"sim", DeviceMode::kStreaming, 4096, 1000, 3},
                                           Case{"sim", DeviceMode::kStreaming, 12 << 10, 8 << 20, 2},
                                           Case{"cuda", DeviceMode::kCached, 2 << 20, 8 << 20, 2},
                                           Case{"cuda", DeviceMode::kStreaming, 64 << 10, 8 << 20, 2}),
                         [](const auto& param_info) {
                           return std::string(param_info.param.device) +
                                  (param_info.param.mode == DeviceMode::kCached ? "_cached_" : "_streaming_") +
                                  std::to_string(param_info.index);
                         });

// Adversarial: copies are slow, staging is two blocks. If a staging block
// went back to the pool before its copy completed, the next read would
// overwrite it and the device would receive the wrong bytes.
TEST(DeviceLoadAdversarial, SlowCopiesNeverSeeRecycledBlocks) {
  SimDeviceOptions slow;
  slow.copy_delay = std::chrono::microseconds(300);
  auto device = make_sim_device(slow);
  testing::TempDir dir;
  const Model m = write_model(dir.file("m.safetensors"), 11, 40);
  LoadOptions options;
  options.threads = 4;
  options.block_size = 4096;
  options.target = {device.get(), DeviceMode::kStreaming, CopyOptions{2, 1024, 0}, 2 * 4096};
  options.zero_copy = ZeroCopy::kOff;  // the staged read path, not a copy from the file's mapping
  Loader loader(options);
  const StateDict sd = loader.load({dir.file("m.safetensors")});
  expect_device_matches(*device, sd, m);
  const PoolStats staging = loader.staging_pool()->stats();
  EXPECT_GT(staging.budget_waits, 0u) << "the test should have made readers wait for copies";
  EXPECT_EQ(staging.live_blocks, 0u);
}

TEST(DeviceLoadBudget, StreamingPeakHostMemoryStaysWithinTheBudget) {
  auto device = make_sim_device();
  testing::TempDir dir;
  const Model m = write_model(dir.file("m.safetensors"), 3, 60);
  ASSERT_GT(m.image.data.size(), 600u << 10) << "the model must be much larger than the budget";
  const std::uint64_t budget = 64 << 10;
  LoadOptions options;
  options.block_size = 16 << 10;
  options.target = {device.get(), DeviceMode::kStreaming, CopyOptions{2, 8 << 10, 0}, budget};
  options.zero_copy = ZeroCopy::kOff;  // the staged read path, not a copy from the file's mapping
  Loader loader(options);
  const StateDict sd = loader.load({dir.file("m.safetensors")});
  expect_device_matches(*device, sd, m);
  EXPECT_LE(loader.staging_pool()->stats().peak_reserved_bytes, budget);
  EXPECT_EQ(loader.pool()->stats().peak_reserved_bytes, 0u) << "streaming must not use whole-file blocks";
}

TEST(DeviceLoadBudget, BudgetSmallerThanOneBlockIsAClearError) {
  auto device = make_sim_device();
  LoadOptions options;
  options.block_size = 2 << 20;
  options.target = {device.get(), DeviceMode::kStreaming, {}, 1 << 20};
  EXPECT_THROW(Loader loader(options), InvalidArgumentError);
}

// Loaders given one staging pool (make_staging_pool) reuse its pinned blocks:
// after the first load, loads of other models make no new OS reservation.
TEST(DeviceLoadBudget, LoadersSharingAStagingPoolPinItOnce) {
  auto device = make_sim_device();
  testing::TempDir dir;
  const Model big = write_model(dir.file("big.safetensors"), 5, 60);
  const Model small = write_model(dir.file("small.safetensors"), 6, 6);
  LoadOptions options;
  options.block_size = 16 << 10;
  options.target = {device.get(), DeviceMode::kStreaming, CopyOptions{2, 8 << 10, 0}, 128 << 10};
  options.zero_copy = ZeroCopy::kOff;  // the staged read path, not a copy from the file's mapping
  const std::shared_ptr<Pool> staging = make_staging_pool(options);
  expect_device_matches(*device, Loader(options, nullptr, nullptr, staging).load({dir.file("big.safetensors")}), big);
  const PoolStats first = staging->stats();
  EXPECT_GT(first.os_reservations, 0u);
  for (int i = 0; i < 3; ++i) {
    Loader loader(options, nullptr, nullptr, staging);
    EXPECT_EQ(loader.staging_pool(), staging);
    expect_device_matches(*device, loader.load({dir.file(i % 2 ? "big.safetensors" : "small.safetensors")}),
                          i % 2 ? big : small);
  }
  const PoolStats after = staging->stats();
  EXPECT_EQ(after.os_reservations, first.os_reservations);
  EXPECT_GT(after.free_list_hits, first.free_list_hits);
  EXPECT_EQ(after.live_blocks, 0u);
  EXPECT_LE(after.peak_reserved_bytes, 128u << 10);
  // A shared pool too small for this loader's blocks is refused up front.
  LoadOptions larger = options;
  larger.block_size = 256 << 10;
  EXPECT_THROW(Loader(larger, nullptr, nullptr, staging), InvalidArgumentError);
}

// ---- Note [Copies from mapped memory] (device_mapped.h), by the counts of
// Note [Host copy counts] (device.h)

// A warm device load copies from the file's mapping of the page cache: no
// staging copy, no pool block; the registration lasts as long as the host
// tensors, so a second load of the file registers nothing.
TEST(DeviceLoadFromMappings, AWarmDeviceLoadCopiesFromThePageCacheWithNoStagingCopy) {
  auto device = make_sim_device();
  testing::TempDir dir;
  const Model m = write_model(dir.file("m.safetensors"), 31, 40);
  const std::uint64_t data_bytes = m.image.data.size();
  LoadOptions options;
  options.threads = 2;
  options.target.device = device.get();
  Loader loader(options);
  {
    LoadHandle h = loader.load_async({dir.file("m.safetensors")});
    const StateDict sd = h.wait();
    expect_device_matches(*device, sd, m);
    testing::expect_matches_file(sd, dir.file("m.safetensors"), m.image);  // the host copy is the mapping
    EXPECT_EQ(h.progress().files_zero_copy, 1u);
    EXPECT_EQ(loader.pool()->stats().peak_reserved_bytes, 0u) << "read into pool blocks";
    const HostCopyCounts first = device->host_copy_counts();
    EXPECT_EQ(first.staged_bytes, 0u);
    EXPECT_EQ(first.direct_bytes, data_bytes);
    EXPECT_GE(first.registrations, 1u);
    EXPECT_EQ(first.live_registrations, first.registrations);

    const StateDict again = loader.load({dir.file("m.safetensors")});
    expect_device_matches(*device, again, m);
    const HostCopyCounts second = device->host_copy_counts();
    EXPECT_EQ(second.registrations, first.registrations) << "the second load registered again";
    EXPECT_EQ(second.staged_bytes, 0u);
    EXPECT_EQ(second.direct_bytes, 2 * data_bytes);
  }
  EXPECT_EQ(device->host_copy_counts().live_registrations, 0u) << "the registrations outlived the tensors";

  // Streaming: the same copies, and the mapping goes with the load.
  options.target.mode = DeviceMode::kStreaming;
  Loader streaming(options);
  expect_device_matches(*device, streaming.load({dir.file("m.safetensors")}), m);
  const HostCopyCounts c = device->host_copy_counts();
  EXPECT_EQ(c.staged_bytes, 0u);
  EXPECT_EQ(c.direct_bytes, 3 * data_bytes);
  EXPECT_EQ(c.live_registrations, 0u);
  EXPECT_EQ(streaming.staging_pool()->stats().peak_reserved_bytes, 0u) << "staged";
}

// A mapping moved out of its file (a writer broke the lease: Note [Leased
// mappings]) no longer holds the registered file pages: a later load of the
// file maps and registers afresh instead of copying from it.
TEST(DeviceLoadFromMappings, AMappingMovedOutOfItsFileIsNotReused) {
  auto device = make_sim_device();
  testing::TempDir dir;
  const std::string path = dir.file("m.safetensors");
  const Model m = write_model(path, 41, 12);
  LoadOptions options;
  options.target.device = device.get();
  Loader loader(options);
  const StateDict first = loader.load({path});
  const std::uint64_t registrations = device->host_copy_counts().registrations;
  ASSERT_GE(registrations, 1u);
  {
    const int fd = ::open(path.c_str(), O_WRONLY);  // breaks the lease; returns once the bytes moved out
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  const StateDict second = loader.load({path});
  expect_device_matches(*device, second, m);
  EXPECT_GT(device->host_copy_counts().registrations, registrations) << "copied from the moved mapping";
  testing::expect_matches_file(first, path, m.image);
}

// The mapping is registered chunk by chunk just before each chunk's copy is
// queued, so the registration of chunk i+1 runs while chunk i copies (here:
// all of them while the first copy is held); no copy leaves its chunk.
TEST(DeviceLoadFromMappings, RegistrationsOverlapTheCopiesChunkByChunk) {
  testing::Gate gate;
  SimDeviceOptions sim;
  sim.before_copy = gate.hook();
  auto device = make_sim_device(sim);
  testing::TempDir dir;
  const std::string path = dir.file("f.bin");
  std::vector<std::uint8_t> bytes(10 * 4096 + 123);
  std::mt19937_64 rng(3);
  for (auto& b : bytes) b = static_cast<std::uint8_t>(rng());
  testing::write_file(path, bytes);
  FileStat st;
  {
    Env* env = default_env();
    const int fd = env->open_read(path, 0);
    ASSERT_GE(fd, 0);
    const ScopedFd owned(env, fd);
    ASSERT_EQ(env->stat(fd, &st), 0);
  }
  std::string why;
  std::shared_ptr<detail::LeasedMapping> lease = detail::LeasedMapping::open(default_env(), path, FileIdentity::of(st), &why);
  ASSERT_NE(lease, nullptr) << why;
  const std::size_t chunk = 3 * 4096;
  auto mapping = detail::RegisteredMapping::make(lease->block(), lease->data(), lease->size(), true, true, chunk);
  lease.reset();
  auto dst = device->allocate(bytes.size());
  {
    testing::OpenOnExit opener(gate);
    CopyEngine engine(*device, CopyOptions{1, 4096, 0});
    ASSERT_TRUE(mapping->copy(engine, 100, bytes.size() - 100, dst, 100));
    ASSERT_TRUE(gate.wait_waiting(1));
    // Every chunk registered, and the first copy still held.
    EXPECT_EQ(device->registered_ranges().size(), 4u);
    EXPECT_EQ(engine.stats().bytes_completed, 0u);
    gate.open();
    engine.wait_all();
  }
  const auto back = testing::read_back(*device, *dst, 100, bytes.size() - 100);
  EXPECT_TRUE(std::equal(back.begin(), back.end(), reinterpret_cast<const std::byte*>(bytes.data()) + 100));
  const std::vector<RegisteredRange> ranges = device->registered_ranges();
  ASSERT_EQ(ranges.size(), 4u);
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    EXPECT_EQ(ranges[k].data, mapping->data() + k * chunk);
    EXPECT_EQ(ranges[k].bytes, k < 3 ? chunk : 2 * 4096);  // the last: the file's whole pages
  }
  const HostCopyCounts c = device->host_copy_counts();
  EXPECT_EQ(c.staged_bytes, 0u);
  EXPECT_EQ(c.direct_bytes, bytes.size() - 100);
  mapping.reset();
  EXPECT_TRUE(device->registered_ranges().empty());
}

// Note [Registration chunks]: from the cost model, in whole 2 MiB, bounded.
TEST(DeviceLoadFromMappings, TheChunkComesFromTheRegistrationCost) {
  const std::size_t modelled = detail::registration_chunk_bytes();
  EXPECT_EQ(modelled % (2u << 20), 0u);
  EXPECT_GE(modelled, 8u << 20);
  EXPECT_LE(modelled, 256u << 20);
  // 50 us a call at 0.19 s/GB: 5.2 MB would make the call 5% of the chunk.
  EXPECT_EQ(detail::registration_chunk_bytes({50e-6, 1.0 / 5.2}), 8u << 20);
  EXPECT_EQ(detail::registration_chunk_bytes({1e-3, 1.0 / 5.2}), 50 * (2u << 20));  // 104 MB: 50 grains of 2 MiB
  EXPECT_EQ(detail::registration_chunk_bytes({1.0, 1.0}), 256u << 20);
}

// Where the driver refuses to register a file mapping, the load reads the
// file into pinned blocks (the staged path), and so does every later load
// of the process, which asks the driver no more.
TEST(DeviceLoadFromMappings, ARefusedFileRegistrationFallsBackToTheStagedPathOnce) {
  SimDeviceOptions sim;
  sim.refuse_register = [](const void*, std::size_t) { return std::string("file-backed memory (test)"); };
  auto device = make_sim_device(sim);
  testing::TempDir dir;
  const Model m = write_model(dir.file("m.safetensors"), 37, 20);
  LoadOptions options;
  options.target.device = device.get();
  for (int i = 0; i < 2; ++i) {
    Loader loader(options);
    LoadHandle h = loader.load_async({dir.file("m.safetensors")});
    const StateDict sd = h.wait();
    expect_device_matches(*device, sd, m);
    EXPECT_EQ(h.progress().files_zero_copy, 0u);
    EXPECT_EQ(h.progress().files_buffered + h.progress().files_direct, 1u) << "not read";
    EXPECT_GT(loader.pool()->stats().peak_reserved_bytes, 0u) << "not read into pool blocks";
    EXPECT_EQ(device->host_copy_counts().registrations_refused, 1u);
    EXPECT_EQ(device->host_copy_counts().registrations, 0u);
  }
  EXPECT_TRUE(detail::file_registration_refused());
  detail::forget_file_registration_refusal();
}

class DeviceLoadFaultTest : public ::testing::TestWithParam<DeviceMode> {};

TEST_P(DeviceLoadFaultTest, ReadErrorMidLoadReleasesEverything) {
  SimDeviceOptions slow;
  slow.copy_delay = std::chrono::microseconds(100);
  auto device = make_sim_device(slow);
  testing::TempDir dir;
  write_model(dir.file("m.safetensors"), 5, 40);
  Faults faults;
  faults.fail_read_at = 20;
  FaultEnv env(faults);
  const int threads_before = testing::stable_thread_count();
  LoadOptions options;
  options.threads = 4;
  options.block_size = 4096;
  options.direct = DirectIo::kOff;
  options.cached_read = CachedRead::kPread;  // the fault is on the 20th pread
  options.target = {device.get(), GetParam(), CopyOptions{2, 2048, 0}, 4 * 4096};
  options.zero_copy = ZeroCopy::kOff;  // the staged read path, not a copy from the file's mapping
  Loader loader(options, nullptr, &env);
  try {
    loader.load({dir.file("m.safetensors")});
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.context().file, dir.file("m.safetensors"));
    EXPECT_TRUE(e.context().begin.has_value());
  }
  EXPECT_EQ(env.open_fds(), 0);
  EXPECT_EQ(loader.pool()->stats().live_blocks, 0u);
  if (loader.staging_pool()) {
    EXPECT_EQ(loader.staging_pool()->stats().live_blocks, 0u);
  }
  EXPECT_EQ(testing::settled_thread_count(threads_before), threads_before);
}

TEST_P(DeviceLoadFaultTest, CancelMidLoadReleasesEverything) {
  SimDeviceOptions slow;
  slow.copy_delay = std::chrono::microseconds(200);
  auto device = make_sim_device(slow);
  testing::TempDir dir;
  write_model(dir.file("m.safetensors"), 9, 60);
  Faults faults;
  faults.read_delay_us = 500;
  FaultEnv env(faults);
  const int threads_before = testing::stable_thread_count();
  LoadOptions options;
  options.threads = 2;
  options.block_size = 4096;
  options.direct = DirectIo::kOff;
  options.target = {device.get(), GetParam(), CopyOptions{2, 2048, 0}, 4 * 4096};
  options.zero_copy = ZeroCopy::kOff;  // the staged read path, not a copy from the file's mapping
  Loader loader(options, nullptr, &env);
  LoadHandle handle = loader.load_async({dir.file("m.safetensors")});
  while (handle.progress().bytes_done == 0 && !handle.done()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  handle.cancel();
  EXPECT_THROW(handle.wait(), CancelledError);
  EXPECT_EQ(env.open_fds(), 0);
  EXPECT_EQ(loader.pool()->stats().live_blocks, 0u);
  if (loader.staging_pool()) {
    EXPECT_EQ(loader.staging_pool()->stats().live_blocks, 0u);
  }
  EXPECT_EQ(testing::settled_thread_count(threads_before), threads_before);
}

INSTANTIATE_TEST_SUITE_P(Modes, DeviceLoadFaultTest, ::testing::Values(DeviceMode::kCached, DeviceMode::kStreaming),
                         [](const auto& param_info) { return param_info.param == DeviceMode::kCached ? "cached" : "streaming"; });

TEST(Upload, CachedHostModelGoesBackToTheDeviceWithoutReading) {
  auto device = make_sim_device();
  testing::TempDir dir;
  const Model m = write_model(dir.file("m.safetensors"), 13);
  FaultEnv env;
  Loader loader(LoadOptions{}, nullptr, &env);
  const StateDict host = loader.load({dir.file("m.safetensors")});
  const std::uint64_t reads = env.reads();
  const StateDict on_device = upload(host, *device);
  EXPECT_EQ(env.reads(), reads) << "upload must not touch storage";
  expect_device_matches(*device, on_device, m);
  for (const Tensor& t : on_device) EXPECT_TRUE(t.on_host());
}

TEST(Upload, RejectsDeviceOnlyTensors) {
  auto device = make_sim_device();
  testing::TempDir dir;
  write_model(dir.file("m.safetensors"), 17, 4);
  LoadOptions options;
  options.target = {device.get(), DeviceMode::kStreaming, {}, 8 << 20};
  Loader loader(options);
  const StateDict sd = loader.load({dir.file("m.safetensors")});
  EXPECT_THROW(upload(sd, *device), InvalidArgumentError);
}

}  // namespace
}  // namespace pinload
