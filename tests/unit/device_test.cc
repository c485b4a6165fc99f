// Tests of the device seam (pinload/device.h): the contract on every device
// ("sim" always; "cuda:0" where a GPU is, skipped with the reason elsewhere),
// then what only the CPU stand-in can show (held, slowed and failed copies).
#include "pinload/device.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "device_test_util.h"
#include "pinload/error.h"
#include "pinload/pool.h"

namespace pinload {
namespace {

using testing::Gate;
using testing::make_pattern;
using testing::OpenOnExit;
using testing::read_back;
using Clock = std::chrono::steady_clock;

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

// ---------------------------------------------------------------- factory

TEST(OpenDevice, SimIsTheStandIn) {
  auto device = open_device("sim");
  ASSERT_NE(device, nullptr);
  EXPECT_EQ(device->kind(), DeviceKind::kSim);
  EXPECT_EQ(device->name(), "sim");
  EXPECT_FALSE(device->description().empty());
}

// "cpu" is host memory: no Device, and never the stand-in in disguise.
TEST(OpenDevice, CpuIsTheHostNotADevice) {
  EXPECT_THROW(open_device("cpu"), InvalidArgumentError);
  EXPECT_THROW(open_device(DeviceSpec{}), InvalidArgumentError);
}

TEST(ParseDeviceSpec, EverySpellingAndItsCanonicalName) {
  using Kind = DeviceSpec::Kind;
  struct Case {
    const char* text;
    DeviceSpec spec;
    const char* name;
  };
  for (const Case& c : {Case{"cpu", {Kind::kHost, 0, false}, "cpu"}, Case{"sim", {Kind::kSim, 0, false}, "sim"},
                        Case{"cuda", {Kind::kCuda, 0, false}, "cuda:0"}, Case{"cuda:0", {Kind::kCuda, 0, true}, "cuda:0"},
                        Case{"cuda:7", {Kind::kCuda, 7, true}, "cuda:7"}}) {
    SCOPED_TRACE(c.text);
    const DeviceSpec spec = parse_device_spec(c.text);
    EXPECT_EQ(spec, c.spec);
    EXPECT_EQ(spec.name(), c.name);
    EXPECT_EQ(spec.is_host(), c.spec.kind == Kind::kHost);
  }
}

TEST(ParseDeviceSpec, MalformedSpecsNameTheOptionAndTheText) {
  for (const char* text : {"", "gpu", "cuda:", "cuda:abc", "cuda:-1", "cuda:+1", "cuda: 1", "CPU", "cpu:0", "sim:0"}) {
    try {
      parse_device_spec(text, "--device");
      ADD_FAILURE() << "'" << text << "' parsed";
    } catch (const InvalidArgumentError& e) {
      EXPECT_EQ(e.message(), "--device: unknown device '" + std::string(text) + "': expected cpu, sim, cuda or cuda:N");
    }
  }
}

TEST(OpenDevice, EachDeviceHasItsOwnId) {
  auto a = open_device("sim");
  auto b = open_device("sim");
  EXPECT_NE(a->id(), b->id());
}

TEST(OpenDevice, MalformedSpecsAreArgumentErrors) {
  for (const char* spec : {"", "gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:0x", "cuda:1.5", " sim", "CUDA:0"}) {
    EXPECT_THROW(open_device(spec), InvalidArgumentError) << "spec '" << spec << "'";
  }
}

TEST(OpenDevice, AbsentCudaDeviceIsADeviceErrorWithTheReason) {
  // Ordinal 4095 exists nowhere: with or without a GPU, a clean DeviceError.
  try {
    open_device("cuda:4095");
    FAIL() << "cuda:4095 opened";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:4095"), std::string::npos) << e.what();
  }
}

TEST(CudaAvailability, ReasonMatchesWhatOpenSays) {
  std::string why;
  const bool available = cuda_available(&why);
  if (available) {
    EXPECT_TRUE(built_with_cuda());
    EXPECT_TRUE(why.empty()) << why;
    auto device = open_device("cuda");
    EXPECT_EQ(device->name(), "cuda:0");
    EXPECT_EQ(device->kind(), DeviceKind::kCuda);
    return;
  }
  ASSERT_FALSE(why.empty());
  if (!built_with_cuda()) {
    EXPECT_EQ(why, "built without CUDA");
  }
  try {
    open_device("cuda:0");
    FAIL() << "cuda:0 opened although cuda_available() said: " << why;
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what() << " vs " << why;
  }
  EXPECT_EQ(cuda_available(nullptr), false);  // a null reason is fine too
}

// Note [CUDA at run time]: the runtime is opened with dlopen, once per process, so each case
// runs in a process of its own (a death test that re-executes this binary).
TEST(CudaRuntime, AMissingRuntimeIsATypedErrorNamingWhatWasTried) {
  if (!built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("PINLOAD_CUDART", "/nonexistent/libcudart.so.99", 1);
        std::string why;
        if (cuda_available(&why)) std::_Exit(2);
        if (why.find("/nonexistent/libcudart.so.99") == std::string::npos) std::_Exit(3);
        if (why.find("PINLOAD_CUDART") == std::string::npos) std::_Exit(4);
        try {
          open_device("cuda:0");
          std::_Exit(5);
        } catch (const DeviceError& e) {
          if (std::string(e.what()).find("could not be loaded") == std::string::npos) std::_Exit(6);
        }
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(CudaRuntime, TheToolkitsRuntimeOpensWithoutBeingLinked) {
  if (!built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  const char* toolkit = "/usr/local/cuda/lib64";
  if (!std::filesystem::exists(toolkit)) GTEST_SKIP() << "no CUDA toolkit at " << toolkit;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        unsetenv("PINLOAD_CUDART");
        std::string why;
        // Opened: available, or unavailable for the machine's reason (no driver, no GPU).
        if (!cuda_available(&why) && why.find("could not be loaded") != std::string::npos) {
          std::fprintf(stderr, "%s\n", why.c_str());
          std::_Exit(2);
        }
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

// ------------------------------------------------------- the contract, per device

class DeviceContract : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    std::string why;
    device_ = testing::open_or_skip_reason(GetParam(), &why);
    if (!device_) GTEST_SKIP() << why;
  }
  std::unique_ptr<Device> device_;
};

TEST_P(DeviceContract, CopyRoundTripsAtOddOffsetsAndSizes) {
  Device& d = *device_;
  const std::size_t size = 1 * MiB + 13;
  auto buffer = d.allocate(size);
  ASSERT_EQ(buffer->size(), size);
  ASSERT_EQ(buffer->device_id(), d.id());
  const auto source = make_pattern(size, 1);
  Stream stream = d.create_stream();
  // Three pieces, each at an odd offset, the last one ending at the very end.
  d.copy_to_device_async(*buffer, 0, source.data(), 7, stream);
  d.copy_to_device_async(*buffer, 7, source.data() + 7, 500 * KiB + 1, stream);
  d.copy_to_device_async(*buffer, 7 + 500 * KiB + 1, source.data() + 7 + 500 * KiB + 1, size - 7 - 500 * KiB - 1,
                         stream);
  stream.synchronize();
  EXPECT_TRUE(stream.query());
  EXPECT_EQ(read_back(d, *buffer, 0, size), source);
  // A read-back at an odd offset too.
  const auto middle = read_back(d, *buffer, 4097, 333);
  EXPECT_EQ(0, std::memcmp(middle.data(), source.data() + 4097, 333));
}

TEST_P(DeviceContract, ManyStreamsFillDisjointRanges) {
  Device& d = *device_;
  std::mt19937_64 rng(42);
  const std::size_t size = 3 * MiB + 1;
  auto buffer = d.allocate(size);
  const auto source = make_pattern(size, 2);
  std::vector<Stream> streams;
  for (int i = 0; i < 4; ++i) streams.push_back(d.create_stream());
  std::size_t offset = 0;
  int i = 0;
  while (offset < size) {
    const std::size_t n = std::min<std::size_t>(size - offset, 1 + rng() % (300 * KiB));
    d.copy_to_device_async(*buffer, offset, source.data() + offset, n, streams[i++ % streams.size()]);
    offset += n;
  }
  for (Stream& s : streams) s.synchronize();
  EXPECT_EQ(read_back(d, *buffer, 0, size), source);
}

TEST_P(DeviceContract, CopiesOnOneStreamRunInOrder) {
  Device& d = *device_;
  const std::size_t n = 256 * KiB;
  auto buffer = d.allocate(n);
  const auto first = make_pattern(n, 3);
  const auto second = make_pattern(n, 4);
  Stream stream = d.create_stream();
  for (int round = 0; round < 5; ++round) {
    d.copy_to_device_async(*buffer, 0, first.data(), n, stream);
    d.copy_to_device_async(*buffer, 0, second.data(), n, stream);
  }
  Event event = d.record(stream);
  event.synchronize();
  EXPECT_TRUE(event.query());
  EXPECT_EQ(read_back(d, *buffer, 0, n), second);
}

TEST_P(DeviceContract, AnEventCompletesOnlyAfterEarlierOnes) {
  Device& d = *device_;
  const std::size_t n = 4 * MiB;
  auto buffer = d.allocate(n);
  const auto source = make_pattern(n, 5);
  Stream stream = d.create_stream();
  std::vector<Event> events;
  for (int i = 0; i < 8; ++i) {
    d.copy_to_device_async(*buffer, 0, source.data(), n, stream);
    events.push_back(d.record(stream));
  }
  // Whenever an event has completed, every earlier one has too.
  for (int poll = 0; poll < 1000; ++poll) {
    bool later_done = false;
    for (std::size_t i = events.size(); i-- > 0;) {
      const bool done = events[i].query();
      if (later_done) {
        ASSERT_TRUE(done) << "event " << i << " pending after a later one completed";
      }
      later_done = later_done || done;
    }
    if (later_done && events.front().query() && events.back().query()) break;
  }
  events.back().synchronize();
  for (Event& e : events) EXPECT_TRUE(e.query());
}

TEST_P(DeviceContract, AnEventOnAnIdleStreamIsComplete) {
  Stream stream = device_->create_stream();
  Event event = device_->record(stream);
  event.synchronize();
  EXPECT_TRUE(event.query());
  EXPECT_TRUE(stream.query());
}

TEST_P(DeviceContract, RangesOutsideTheBufferAreErrorsNotCrashes) {
  Device& d = *device_;
  auto buffer = d.allocate(4096);
  const auto source = make_pattern(8192, 6);
  Stream stream = d.create_stream();
  EXPECT_THROW(d.copy_to_device_async(*buffer, 0, source.data(), 4097, stream), InvalidArgumentError);
  EXPECT_THROW(d.copy_to_device_async(*buffer, 1, source.data(), 4096, stream), InvalidArgumentError);
  EXPECT_THROW(d.copy_to_device_async(*buffer, 4097, source.data(), 0, stream), InvalidArgumentError);
  const std::size_t huge = std::numeric_limits<std::size_t>::max();
  EXPECT_THROW(d.copy_to_device_async(*buffer, huge, source.data(), 2, stream), InvalidArgumentError);
  EXPECT_THROW(d.copy_to_device_async(*buffer, 2, source.data(), huge, stream), InvalidArgumentError);
  EXPECT_THROW(d.copy_to_device_async(*buffer, 0, nullptr, 16, stream), InvalidArgumentError);
  std::vector<std::byte> out(8192);
  EXPECT_THROW(d.copy_to_host(out.data(), *buffer, 0, 4097), InvalidArgumentError);
  EXPECT_THROW(d.copy_to_host(out.data(), *buffer, huge, 1), InvalidArgumentError);
  // Every refused copy queued nothing; a zero-byte copy at the end is legal.
  d.copy_to_device_async(*buffer, 4096, source.data(), 0, stream);
  d.copy_to_device_async(*buffer, 0, source.data(), 4096, stream);
  stream.synchronize();
  EXPECT_EQ(read_back(d, *buffer, 0, 4096), std::vector<std::byte>(source.begin(), source.begin() + 4096));
}

TEST_P(DeviceContract, ObjectsOfAnotherDeviceOrEmptyHandlesAreRefused) {
  Device& d = *device_;
  auto other = make_sim_device();
  auto foreign_buffer = other->allocate(64);
  Stream foreign_stream = other->create_stream();
  auto buffer = d.allocate(64);
  Stream stream = d.create_stream();
  std::byte src[64] = {};
  EXPECT_THROW(d.copy_to_device_async(*foreign_buffer, 0, src, 64, stream), InvalidArgumentError);
  EXPECT_THROW(d.copy_to_device_async(*buffer, 0, src, 64, foreign_stream), InvalidArgumentError);
  EXPECT_THROW(d.record(foreign_stream), InvalidArgumentError);
  EXPECT_THROW(d.copy_to_host(src, *foreign_buffer, 0, 64), InvalidArgumentError);
  Stream empty;
  EXPECT_FALSE(empty.valid());
  EXPECT_THROW(d.copy_to_device_async(*buffer, 0, src, 64, empty), InvalidArgumentError);
  EXPECT_THROW(d.record(empty), InvalidArgumentError);
  EXPECT_THROW(empty.synchronize(), InvalidArgumentError);
  Event no_event;
  EXPECT_THROW(no_event.query(), InvalidArgumentError);
  EXPECT_THROW(d.allocate(0), InvalidArgumentError);
}

TEST_P(DeviceContract, PinnedBackendFeedsAPool) {
  Device& d = *device_;
  std::vector<PinnedMemoryOptions> variants(1);
  if (d.kind() == DeviceKind::kCuda) variants.push_back(PinnedMemoryOptions{PinMethod::kHostRegister});
  for (const PinnedMemoryOptions& options : variants) {
    auto pool = Pool::create(d.make_pinned_backend(options), PoolOptions{.slab_bytes = 4 * MiB});
    auto block = pool->allocate(3 * MiB + 5);
    ASSERT_EQ(reinterpret_cast<std::uintptr_t>(block->data()) % 4096, 0u);
    if (d.kind() == DeviceKind::kCuda) {
      EXPECT_TRUE(block->locked()) << pool->backend_name();
    }
    testing::fill_pattern(block->data(), block->size(), 7);
    auto buffer = d.allocate(block->size());
    Stream stream = d.create_stream();
    d.copy_to_device_async(*buffer, 0, block->data(), block->size(), stream);
    stream.synchronize();
    const auto back = read_back(d, *buffer, 0, block->size());
    EXPECT_EQ(0, std::memcmp(back.data(), block->data(), block->size())) << pool->backend_name();
  }
}

// Counts what passes through to the device's own allocator.
class CountingAllocator final : public DeviceAllocator {
 public:
  explicit CountingAllocator(std::shared_ptr<DeviceAllocator> inner) : inner_(std::move(inner)) {}
  void* allocate(std::size_t bytes) override {
    allocations++;
    bytes_live += bytes;
    return inner_->allocate(bytes);
  }
  void deallocate(void* data, std::size_t bytes) noexcept override {
    frees++;
    bytes_live -= bytes;
    inner_->deallocate(data, bytes);
  }
  std::string_view name() const noexcept override { return "counting"; }
  std::atomic<int> allocations{0}, frees{0};
  std::atomic<std::int64_t> bytes_live{0};

 private:
  std::shared_ptr<DeviceAllocator> inner_;
};

TEST_P(DeviceContract, ACallersAllocatorServesAllocate) {
  Device& d = *device_;
  auto counting = std::make_shared<CountingAllocator>(d.default_allocator());
  d.set_allocator(counting);
  EXPECT_EQ(d.allocator()->name(), "counting");
  {
    auto a = d.allocate(1000);
    auto b = d.allocate(5000);
    EXPECT_EQ(counting->allocations, 2);
    EXPECT_EQ(counting->bytes_live, 6000);
    // The buffer works like any other.
    const auto source = make_pattern(1000, 8);
    Stream stream = d.create_stream();
    d.copy_to_device_async(*a, 0, source.data(), 1000, stream);
    stream.synchronize();
    EXPECT_EQ(read_back(d, *a, 0, 1000), source);
    d.set_allocator(nullptr);  // buffers already made keep theirs
  }
  EXPECT_EQ(counting->frees, 2);
  EXPECT_EQ(counting->bytes_live, 0);
  auto c = d.allocate(10);
  EXPECT_EQ(counting->allocations, 2);
  EXPECT_NE(d.allocator()->name(), "counting");
}

TEST_P(DeviceContract, WrappedMemoryIsReleasedOnce) {
  Device& d = *device_;
  auto owner = d.allocate(4096);
  int releases = 0;
  {
    auto view = d.wrap(owner->data(), 4096, [&](void* p, std::size_t n) {
      EXPECT_EQ(p, owner->data());
      EXPECT_EQ(n, 4096u);
      releases++;
    });
    const auto source = make_pattern(4096, 9);
    Stream stream = d.create_stream();
    d.copy_to_device_async(*view, 0, source.data(), 4096, stream);
    stream.synchronize();
    EXPECT_EQ(read_back(d, *owner, 0, 4096), source);
  }
  EXPECT_EQ(releases, 1);
}

INSTANTIATE_TEST_SUITE_P(Devices, DeviceContract, ::testing::ValuesIn(testing::kDeviceSpecs),
                         testing::device_param_name);

// ----------------------------------------------------------- sim only

// Host memory mapped by other means (as a node-store entry is) and registered
// copies as any other; the registration may end once its copies completed.
TEST_P(DeviceContract, RegisteredHostMemoryCopies) {
  Device& d = *device_;
  const std::size_t size = 2 * MiB;
  void* mapped = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  const auto source = make_pattern(size, 3);
  std::memcpy(mapped, source.data(), size);
  {
    std::shared_ptr<void> registration = d.register_host(mapped, size);
    if (d.kind() == DeviceKind::kSim) {
      EXPECT_NE(registration, nullptr);
    }
    auto buffer = d.allocate(size);
    Stream stream = d.create_stream();
    d.copy_to_device_async(*buffer, 0, mapped, size, stream);
    stream.synchronize();
    registration.reset();
    EXPECT_EQ(read_back(d, *buffer, 0, size), source);
  }
  EXPECT_EQ(d.register_host(nullptr, size), nullptr);
  ::munmap(mapped, size);
}

// The stand-in holds register_host's contract: a copy from a registered range
// that runs after its handle went fails the stream, as CUDA would fault.
TEST(SimDevice, ACopyOutlivingItsRegistrationFailsTheStream) {
  Gate gate;
  SimDeviceOptions options;
  options.before_copy = gate.hook();
  std::atomic<std::int64_t> registered{0};
  options.on_register = [&](std::size_t bytes, bool on) { registered += on ? std::int64_t(bytes) : -std::int64_t(bytes); };
  auto d = make_sim_device(options);
  const auto source = make_pattern(4096, 13);
  auto buffer = d->allocate(4096);
  Stream stream = d->create_stream();
  OpenOnExit opener(gate);
  std::shared_ptr<void> registration = d->register_host(source.data(), source.size());
  EXPECT_EQ(registered.load(), 4096);
  d->copy_to_device_async(*buffer, 0, source.data() + 100, 200, stream);
  ASSERT_TRUE(gate.wait_waiting(1));
  registration.reset();  // too early: the copy is still queued
  EXPECT_EQ(registered.load(), 0);
  gate.open();
  try {
    stream.synchronize();
    FAIL() << "a copy ran after its registration ended";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("register_host"), std::string::npos) << e.what();
  }
  EXPECT_EQ(d->host_copy_counts().expired_copies, 1u);
  EXPECT_EQ(d->host_copy_counts().live_registrations, 0u);
}

// Note [Host copy counts]: a registered range is recorded while its handle
// lives, with its bytes; a handle gone takes its range out of the record.
TEST(SimDevice, RegistrationsAreRecordedWhileTheirHandlesLive) {
  auto d = make_sim_device();
  std::vector<std::byte> a(3 * 4096), b(5 * 4096);
  EXPECT_TRUE(d->registered_ranges().empty());
  std::shared_ptr<void> ra = d->register_host(a.data(), a.size());
  std::shared_ptr<void> rb = d->register_host(b.data(), b.size());
  ASSERT_NE(ra, nullptr);
  ASSERT_NE(rb, nullptr);
  EXPECT_EQ(d->registered_ranges(),
            (std::vector<RegisteredRange>{{a.data(), a.size()}, {b.data(), b.size()}}));
  HostCopyCounts c = d->host_copy_counts();
  EXPECT_EQ(c.registrations, 2u);
  EXPECT_EQ(c.registered_bytes, a.size() + b.size());
  EXPECT_EQ(c.live_registrations, 2u);
  ra.reset();
  EXPECT_EQ(d->registered_ranges(), (std::vector<RegisteredRange>{{b.data(), b.size()}}));
  c = d->host_copy_counts();
  EXPECT_EQ(c.registrations, 2u);
  EXPECT_EQ(c.live_registrations, 1u);
}

// A copy from pageable memory is staged (the driver's bounce buffer); one
// from a registration or from the device's pinned backend is direct; one
// that leaves its registration is staged again.
TEST(SimDevice, CopiesAreCountedStagedUnlessPinnedOrRegistered) {
  auto d = make_sim_device();
  auto buffer = d->allocate(64 * KiB);
  Stream stream = d->create_stream();
  const auto pageable = make_pattern(64 * KiB, 5);
  d->copy_to_device_async(*buffer, 0, pageable.data(), 1000, stream);
  HostCopyCounts c = d->host_copy_counts();
  EXPECT_EQ(c.staged_copies, 1u);
  EXPECT_EQ(c.staged_bytes, 1000u);
  EXPECT_EQ(c.direct_bytes, 0u);

  std::shared_ptr<void> registration = d->register_host(pageable.data(), 32 * KiB);
  d->copy_to_device_async(*buffer, 0, pageable.data() + 100, 2000, stream);
  d->copy_to_device_async(*buffer, 0, pageable.data() + 31 * KiB, 2 * KiB, stream);  // leaves it
  c = d->host_copy_counts();
  EXPECT_EQ(c.direct_copies, 1u);
  EXPECT_EQ(c.direct_bytes, 2000u);
  EXPECT_EQ(c.staged_copies, 2u);
  EXPECT_EQ(c.staged_bytes, 1000u + 2 * KiB);

  auto pool = Pool::create(d->make_pinned_backend(PinnedMemoryOptions{.huge_pages = HugePages::kOff}),
                           PoolOptions{.slab_bytes = 4 * MiB});
  std::shared_ptr<Block> block = pool->allocate(64 * KiB);
  d->copy_to_device_async(*buffer, 0, block->data(), 64 * KiB, stream);
  stream.synchronize();
  c = d->host_copy_counts();
  EXPECT_EQ(c.direct_copies, 2u);
  EXPECT_EQ(c.direct_bytes, 2000u + 64 * KiB);
  EXPECT_EQ(c.staged_copies, 2u);
  EXPECT_EQ(c.expired_copies, 0u);
  registration.reset();
}

// SimDeviceOptions::refuse_register stands in for a driver that refuses a
// range: null, counted, nothing recorded, and copies from it are staged.
TEST(SimDevice, ARefusedRegistrationIsCountedAndItsCopiesStaged) {
  SimDeviceOptions options;
  options.refuse_register = [](const void*, std::size_t) { return std::string("file-backed (test)"); };
  auto d = make_sim_device(options);
  const auto source = make_pattern(8 * KiB, 7);
  EXPECT_EQ(d->register_host(source.data(), source.size()), nullptr);
  EXPECT_TRUE(d->registered_ranges().empty());
  auto buffer = d->allocate(source.size());
  Stream stream = d->create_stream();
  d->copy_to_device_async(*buffer, 0, source.data(), source.size(), stream);
  stream.synchronize();
  const HostCopyCounts c = d->host_copy_counts();
  EXPECT_EQ(c.registrations, 0u);
  EXPECT_EQ(c.registrations_refused, 1u);
  EXPECT_EQ(c.staged_bytes, source.size());
  EXPECT_EQ(read_back(*d, *buffer, 0, source.size()), source);
}

// SimDeviceOptions::bus_bytes_per_second: streams share one bus, so two
// streams move no more bytes per second than one.
TEST(SimDevice, StreamsShareTheBus) {
  SimDeviceOptions options;
  options.bus_bytes_per_second = 100u << 20;  // 100 MiB/s: 4 MiB take 40 ms
  auto d = make_sim_device(options);
  const auto source = make_pattern(2 * MiB, 17);
  auto buffer = d->allocate(2 * MiB);
  Stream a = d->create_stream();
  Stream b = d->create_stream();
  const auto start = Clock::now();
  for (int i = 0; i < 2; ++i) {
    d->copy_to_device_async(*buffer, 0, source.data(), MiB, a);
    d->copy_to_device_async(*buffer, MiB, source.data() + MiB, MiB, b);
  }
  d->synchronize();
  const auto took = Clock::now() - start;
  EXPECT_GE(took, std::chrono::milliseconds(39)) << "two streams moved more than the bus carries";
  EXPECT_EQ(read_back(*d, *buffer, 0, 2 * MiB), source);
}

TEST(SimDevice, FreshMemoryIsPoisonedSoAMissedCopyShows) {
  auto d = make_sim_device();
  auto buffer = d->allocate(100);
  const auto back = read_back(*d, *buffer, 0, 100);
  for (std::byte b : back) ASSERT_EQ(b, std::byte{0xA5});
}

TEST(SimDevice, HeldCopiesCompleteEventsOneByOneInOrder) {
  Gate gate;
  SimDeviceOptions options;
  options.before_copy = gate.hook();
  auto d = make_sim_device(options);
  const std::size_t n = 64 * KiB;
  auto buffer = d->allocate(4 * n);
  const auto source = make_pattern(4 * n, 10);
  Stream stream = d->create_stream();
  OpenOnExit opener(gate);
  std::vector<Event> events;
  for (int i = 0; i < 4; ++i) {
    d->copy_to_device_async(*buffer, i * n, source.data() + i * n, n, stream);
    events.push_back(d->record(stream));
  }
  ASSERT_TRUE(gate.wait_waiting(1));
  for (Event& e : events) EXPECT_FALSE(e.query());
  EXPECT_FALSE(stream.query());
  for (int released = 1; released <= 4; ++released) {
    gate.allow(1);
    events[released - 1].synchronize();
    for (int i = 0; i < 4; ++i) EXPECT_EQ(events[i].query(), i < released) << "after " << released << ", event " << i;
  }
  EXPECT_TRUE(stream.query());
  EXPECT_EQ(read_back(*d, *buffer, 0, 4 * n), source);
}

TEST(SimDevice, StreamsRunIndependently) {
  // Copies of 111 bytes are held; those of 222 bytes pass.
  Gate gate;
  SimDeviceOptions options;
  options.before_copy = [&gate](std::size_t bytes) {
    if (bytes == 111) gate.pass(bytes);
  };
  auto d = make_sim_device(options);
  auto buffer = d->allocate(1000);
  const auto source = make_pattern(1000, 11);
  Stream held = d->create_stream();
  Stream free_stream = d->create_stream();
  OpenOnExit opener(gate);
  d->copy_to_device_async(*buffer, 0, source.data(), 111, held);
  Event held_event = d->record(held);
  d->copy_to_device_async(*buffer, 500, source.data() + 500, 222, free_stream);
  Event free_event = d->record(free_stream);
  free_event.synchronize();
  EXPECT_TRUE(free_event.query());
  EXPECT_FALSE(held_event.query());
  gate.open();
  held_event.synchronize();
  EXPECT_TRUE(held_event.query());
}

TEST(SimDevice, AFailedCopyFailsItsStreamLikeAStickyError) {
  // The copy of 333 bytes fails, once everything below is queued.
  Gate gate;
  SimDeviceOptions options;
  options.before_copy = [&gate](std::size_t bytes) {
    if (bytes != 333) return;
    gate.pass(bytes);
    throw DeviceError("injected copy failure");
  };
  auto d = make_sim_device(options);
  auto buffer = d->allocate(4096);
  const auto source = make_pattern(4096, 12);
  Stream bad = d->create_stream();
  Stream good = d->create_stream();
  OpenOnExit opener(gate);
  d->copy_to_device_async(*buffer, 0, source.data(), 100, bad);
  Event before = d->record(bad);
  d->copy_to_device_async(*buffer, 0, source.data(), 333, bad);
  d->copy_to_device_async(*buffer, 1000, source.data() + 1000, 100, bad);  // skipped
  Event after = d->record(bad);
  gate.open();
  before.synchronize();  // fine: reached before the failure
  EXPECT_TRUE(before.query());
  try {
    after.synchronize();
    FAIL() << "an event after a failed copy completed";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("injected copy failure"), std::string::npos) << e.what();
  }
  EXPECT_THROW(after.query(), DeviceError);
  EXPECT_THROW(bad.synchronize(), DeviceError);
  EXPECT_THROW(bad.query(), DeviceError);
  EXPECT_THROW(d->copy_to_device_async(*buffer, 0, source.data(), 10, bad), DeviceError);
  EXPECT_THROW(d->record(bad), DeviceError);
  // The skipped copy wrote nothing; another stream is unaffected.
  d->copy_to_device_async(*buffer, 2000, source.data() + 2000, 100, good);
  good.synchronize();
  std::vector<std::byte> back(4096);
  std::memcpy(back.data(), buffer->data(), 4096);  // sim memory is host memory; synchronize() would throw
  EXPECT_EQ(back[1000], std::byte{0xA5});
  EXPECT_EQ(0, std::memcmp(back.data() + 2000, source.data() + 2000, 100));
}

TEST(SimDevice, ThrottleSlowsCopiesDown) {
  SimDeviceOptions options;
  options.bytes_per_second = 10'000'000;  // 10 MB/s: 200 KB take >= 20 ms
  options.copy_delay = std::chrono::milliseconds(5);
  auto d = make_sim_device(options);
  auto buffer = d->allocate(200'000);
  const auto source = make_pattern(200'000, 13);
  Stream stream = d->create_stream();
  const auto start = Clock::now();
  d->copy_to_device_async(*buffer, 0, source.data(), 200'000, stream);
  EXPECT_FALSE(stream.query());  // 25 ms of work cannot be done yet
  stream.synchronize();
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(25));
  EXPECT_EQ(read_back(*d, *buffer, 0, 200'000), source);
}

TEST(SimDevice, MemoryLimitGivesOutOfMemoryAndFreesComeBack) {
  SimDeviceOptions options;
  options.memory_bytes = 1 * MiB;
  auto d = make_sim_device(options);
  auto a = d->allocate(600 * KiB);
  EXPECT_THROW(d->allocate(600 * KiB), OutOfMemoryError);
  a.reset();
  EXPECT_NO_THROW(d->allocate(1 * MiB));
}

TEST(SimDevice, DestroyingStreamsWithCopiesQueuedDrainsAndJoins) {
  const int baseline = testing::stable_thread_count();
  SimDeviceOptions options;
  options.copy_delay = std::chrono::milliseconds(2);
  const std::size_t n = 4 * KiB;
  const auto source = make_pattern(40 * n, 14);
  std::shared_ptr<DeviceBuffer> buffer;
  std::vector<Event> events;
  const auto start = Clock::now();
  {
    auto d = make_sim_device(options);
    buffer = d->allocate(40 * n);
    std::vector<Stream> streams;
    for (int i = 0; i < 4; ++i) streams.push_back(d->create_stream());
    EXPECT_EQ(testing::thread_count(), baseline + 4);
    for (int i = 0; i < 40; ++i) d->copy_to_device_async(*buffer, i * n, source.data() + i * n, n, streams[i % 4]);
    events.push_back(d->record(streams[0]));
    // streams, then the device, go here with copies queued
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(testing::settled_thread_count(baseline), baseline);
  // Every queued copy ran; the event outlives its stream and device.
  EXPECT_TRUE(events[0].query());
  EXPECT_EQ(0, std::memcmp(buffer->data(), source.data(), 40 * n));
}

TEST(SimDevice, ConcurrentCopiesFromManyThreads) {
  auto d = make_sim_device();
  const std::size_t per_thread = 64 * KiB;
  const int threads = 6;
  auto buffer = d->allocate(per_thread * threads);
  const auto source = make_pattern(per_thread * threads, 15);
  std::vector<Stream> streams;
  for (int i = 0; i < 2; ++i) streams.push_back(d->create_stream());
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      for (std::size_t off = 0; off < per_thread; off += 4096) {
        const std::size_t at = t * per_thread + off;
        d->copy_to_device_async(*buffer, at, source.data() + at, 4096, streams[(t + off / 4096) % 2]);
      }
    });
  }
  for (auto& w : workers) w.join();
  d->synchronize();
  EXPECT_EQ(read_back(*d, *buffer, 0, per_thread * threads), source);
}

}  // namespace
}  // namespace pinload
