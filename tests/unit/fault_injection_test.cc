// Faults injected through FaultEnv: each gives its typed error (or is
// recovered from, byte-exact), and a failed or cancelled load leaves nothing
// behind: no pool block in use, no open descriptor, no extra thread.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string_view>
#include <thread>
#include <tuple>

#include "fault_env.h"
#include "io/leased_mapping.h"
#include "os/read_full.h"
#include "pinload/checkpoint.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "file_check.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::FaultEnv;
using testing::Faults;
using testing::FileImage;
using testing::direct_io_works;
using testing::expect_matches_file;
using testing::TempDir;
using testing::TensorSpec;
using Clock = std::chrono::steady_clock;

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

// ---- fixtures ----

// About 1 MiB of tensors of odd sizes after an odd-length header.
FileImage write_model(const std::string& path) {
  const std::vector<TensorSpec> specs = {{"w0", "U8", {100'003}}, {"w1", "F32", {50'001}}, {"w2", "BF16", {123'457}},
                                         {"w3", "U8", {7}},       {"w4", "U8", {400'000}}};
  std::mt19937_64 rng(1);
  FileImage image = testing::make_image(specs, rng, 1, "{\"k\":\"v\"}");
  testing::write_file(path, image.bytes());
  return image;
}

// One checkpoint for the whole binary (random bytes are slow to make under
// sanitizers); removed at exit. Tests must not modify it.
struct SharedModel {
  TempDir dir;
  std::string path = dir.file("model.safetensors");
  FileImage image = write_model(path);
};
const SharedModel& shared_model() {
  static const SharedModel model;
  return model;
}

// A file of one U8 tensor `name` of `bytes` bytes, all 0x5a: for tests that
// do not compare contents.
void write_blob(const std::string& path, const std::string& name, std::uint64_t bytes) {
  const std::string n = std::to_string(bytes);
  testing::write_file(path, testing::raw_file("{\"" + name + "\":{\"dtype\":\"U8\",\"shape\":[" + n +
                                                  "],\"data_offsets\":[0," + n + "]}}",
                                              std::vector<std::uint8_t>(bytes, 0x5a)));
}

enum class Mode { kOn, kOff, kAutoCold };  // kAutoCold: kAuto that tries O_DIRECT on cached files

const char* mode_name(Mode m) { return m == Mode::kOn ? "On" : m == Mode::kOff ? "Off" : "AutoCold"; }

LoadOptions load_options(Mode mode, unsigned threads = 4, std::size_t block_size = 64 * KiB,
                         std::size_t files_in_flight = 2) {
  LoadOptions o;
  o.threads = threads;
  o.block_size = block_size;
  o.files_in_flight = files_in_flight;
  o.direct = mode == Mode::kOn ? DirectIo::kOn : mode == Mode::kOff ? DirectIo::kOff : DirectIo::kAuto;
  o.resident_threshold = 2.0;
  // The reads' faults: the file is read, never handed out as a mapping (the
  // zero-copy tests below turn it on).
  o.zero_copy = ZeroCopy::kOff;
  return o;
}

// A FaultEnv, a pool on it, and a loader on both (destroyed in reverse).
struct Rig {
  Rig(Faults faults, LoadOptions options, PoolOptions pool_options = {})
      : env(faults), pool(Pool::create(make_locked_memory_backend(&env), pool_options)), loader(options, pool, &env) {}
  FaultEnv env;
  std::shared_ptr<Pool> pool;
  Loader loader;
};

class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::thread([] {}).join();  // sanitizers start a helper thread on the first one
    baseline_threads_ = testing::stable_thread_count();
    direct_ok_ = direct_io_works(path_);
  }

  std::uint64_t file_size() const { return 8 + image_.header_json.size() + image_.data.size(); }
  std::uint64_t data_offset() const { return 8 + image_.header_json.size(); }

  // Nothing of a failed load remains.
  void expect_released(const Rig& rig) {
    const PoolStats s = rig.pool->stats();
    EXPECT_EQ(s.in_use_bytes, 0u);
    EXPECT_EQ(s.live_blocks, 0u);
    EXPECT_EQ(rig.env.open_fds(), 0);
    EXPECT_EQ(testing::settled_thread_count(baseline_threads_), baseline_threads_);
  }

  // The error names `path`, in its context and its message.
  void expect_names_file(const Error& e, const std::string& path) {
    EXPECT_EQ(e.context().file, path) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }

  TempDir dir_;  // for files of the test's own
  const std::string& path_ = shared_model().path;
  const FileImage& image_ = shared_model().image;
  bool direct_ok_ = false;
  int baseline_threads_ = 0;
};

// ---- read errors ----

class EioTest : public FaultTest, public ::testing::WithParamInterface<std::tuple<int, Mode>> {};

TEST_P(EioTest, NthReadFailsWithIoErrorNamingFileAndRange) {
  const auto [n, mode] = GetParam();
  if (mode == Mode::kOn && !direct_ok_) GTEST_SKIP() << "no O_DIRECT here";
  Rig rig(Faults{.fail_read_at = static_cast<std::uint64_t>(n)}, load_options(mode));
  try {
    rig.loader.load({path_});
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    expect_names_file(e, path_);
    EXPECT_NE(std::string(e.what()).find(std::strerror(EIO)), std::string::npos) << e.what();
    ASSERT_TRUE(e.context().begin.has_value() && e.context().end.has_value()) << e.what();
    EXPECT_LT(*e.context().begin, *e.context().end);
    EXPECT_LE(*e.context().end, file_size());
    if (n > 2) {  // past the two header reads: a data read
      EXPECT_GE(*e.context().end, data_offset());
    }
  }
  expect_released(rig);

  // The pool is whole: the next load succeeds, reusing the freed block.
  const PoolStats before = rig.pool->stats();
  expect_matches_file(rig.loader.load({path_}), path_, image_);
  if (n > 2) {
    EXPECT_EQ(rig.pool->stats().os_reservations, before.os_reservations);
  }
}

INSTANTIATE_TEST_SUITE_P(All, EioTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 9, 17),
                                            ::testing::Values(Mode::kOff, Mode::kOn, Mode::kAutoCold)),
                         [](const ::testing::TestParamInfo<std::tuple<int, Mode>>& p) {
                           return "read" + std::to_string(std::get<0>(p.param)) + "_" +
                                  mode_name(std::get<1>(p.param));
                         });

TEST_F(FaultTest, EioInOneOfSeveralShardsReleasesEveryBlock) {
  std::vector<std::string> paths;
  for (int i = 0; i < 3; ++i) {
    paths.push_back(dir_.file("shard" + std::to_string(i) + ".safetensors"));
    write_blob(paths.back(), "s" + std::to_string(i), 300 * KiB);  // 5 reads of 64 KiB
  }
  for (std::uint64_t n : {8u, 14u, 20u}) {  // 6 header reads come first
    Rig rig(Faults{.fail_read_at = n}, load_options(Mode::kOff, 8, 64 * KiB, 3));
    EXPECT_THROW(rig.loader.load(paths), IoError) << n;
    expect_released(rig);
  }
}

// ---- faults that are recovered from ----

using RecoverParam = std::tuple<std::uint64_t, Mode>;
class ShortReadTest : public FaultTest, public ::testing::WithParamInterface<RecoverParam> {};

TEST_P(ShortReadTest, ShortReadsStillLoadByteExact) {
  const auto [limit, mode] = GetParam();
  if (mode != Mode::kOff && !direct_ok_) GTEST_SKIP() << "no O_DIRECT here";
  if (mode == Mode::kOn) {  // the kernel must accept `limit` as a direct read length
    ScopedFd fd = open_or_throw(default_env(), path_);
    const FileStat st = stat_or_throw(default_env(), fd.get(), path_);
    if (st.dio_offset_align == 0 || limit % st.dio_offset_align != 0) {
      GTEST_SKIP() << "direct reads here need multiples of " << st.dio_offset_align;
    }
  }
  Rig rig(Faults{.short_read_bytes = limit}, load_options(mode));
  expect_matches_file(rig.loader.load({path_}), path_, image_);
  EXPECT_GE(rig.env.reads(), image_.data.size() / limit);
  expect_released(rig);
}

// 4096: aligned short direct reads; 4608: a short direct read leaves an
// unaligned position; 1000 under O_DIRECT: the kernel refuses the length.
INSTANTIATE_TEST_SUITE_P(All, ShortReadTest,
                         ::testing::Values(RecoverParam{1000, Mode::kOff}, RecoverParam{4096, Mode::kOn},
                                           RecoverParam{4608, Mode::kOn}, RecoverParam{1000, Mode::kAutoCold}),
                         [](const ::testing::TestParamInfo<RecoverParam>& p) {
                           return std::to_string(std::get<0>(p.param)) + "_" + mode_name(std::get<1>(p.param));
                         });

TEST_F(FaultTest, EintrIsRetried) {
  for (Mode mode : {Mode::kOff, Mode::kOn, Mode::kAutoCold}) {
    if (mode != Mode::kOff && !direct_ok_) continue;
    SCOPED_TRACE(mode_name(mode));
    Rig rig(Faults{.eintr_every_other = true}, load_options(mode, 8, 16 * KiB));
    expect_matches_file(rig.loader.load({path_}), path_, image_);
    expect_released(rig);
  }
}

// read_full (src/os/read_full.h), the one retry loop around Env::pread.
class ReadFullTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.file("bytes");
    bytes_.resize(10000);
    for (std::size_t i = 0; i < bytes_.size(); ++i) bytes_[i] = static_cast<char>(i * 7);
    std::ofstream(path_, std::ios::binary).write(bytes_.data(), static_cast<std::streamsize>(bytes_.size()));
  }
  TempDir dir_;
  std::string path_;
  std::string bytes_;
};

TEST_F(ReadFullTest, RetriesEintrAndShortReads) {
  FaultEnv env(Faults{.short_read_bytes = 333, .eintr_every_other = true});
  ScopedFd fd = open_or_throw(&env, path_);
  std::string out(6000, '\0');
  const ReadResult r = read_full(&env, fd.get(), out.data(), out.size(), 1000);
  EXPECT_EQ(r.bytes, 6000u);
  EXPECT_EQ(r.error, 0);
  EXPECT_FALSE(r.ended);
  EXPECT_EQ(out, bytes_.substr(1000, 6000));
}

TEST_F(ReadFullTest, ReportsTheEndOfTheFileAndWhatArrived) {
  FaultEnv env(Faults{.short_read_bytes = 4096});
  ScopedFd fd = open_or_throw(&env, path_);
  std::string out(4000, '\0');
  const ReadResult r = read_full(&env, fd.get(), out.data(), out.size(), 8000);
  EXPECT_EQ(r.bytes, 2000u);
  EXPECT_EQ(r.error, 0);
  EXPECT_TRUE(r.ended);
  EXPECT_EQ(out.substr(0, 2000), bytes_.substr(8000));
}

TEST_F(ReadFullTest, ReportsTheErrnoOfTheFailingReadAndStops) {
  FaultEnv env(Faults{.fail_read_at = 3, .short_read_bytes = 1000});
  ScopedFd fd = open_or_throw(&env, path_);
  std::string out(5000, '\0');
  const ReadResult r = read_full(&env, fd.get(), out.data(), out.size(), 0);
  EXPECT_EQ(r.bytes, 2000u);
  EXPECT_EQ(r.error, EIO);
  EXPECT_FALSE(r.ended);
  EXPECT_EQ(env.reads(), 3u);
}

TEST_F(ReadFullTest, AsksForUpToAskAndStopsOffTheAlignment) {
  FaultEnv env(Faults{.short_read_bytes = 1000});
  ScopedFd fd = open_or_throw(&env, path_);
  std::string out(8192, '\0');
  // 1000 bytes arrive, off a 512-byte alignment: back to the caller at once.
  ReadResult r = read_full(&env, fd.get(), out.data(), 4000, 0, 8192, 512);
  EXPECT_EQ(r.bytes, 1000u);
  EXPECT_EQ(r.error, 0);
  EXPECT_FALSE(r.ended);
  // Aligned short reads go on.
  FaultEnv aligned(Faults{.short_read_bytes = 1024});
  r = read_full(&aligned, fd.get(), out.data(), 4000, 0, 8192, 512);
  EXPECT_EQ(r.bytes, 4096u);
  EXPECT_EQ(aligned.reads(), 4u);
  EXPECT_EQ(out.substr(0, 4096), bytes_.substr(0, 4096));
}

TEST_F(FaultTest, DirectRefusedAtOpenFallsBackUnderAuto) {
  Rig rig(Faults{.refuse_direct_open = true}, load_options(Mode::kAutoCold));
  LoadHandle handle = rig.loader.load_async({path_});
  expect_matches_file(handle.wait(), path_, image_);
  EXPECT_EQ(rig.env.direct_opens(), 0u);
  EXPECT_EQ(handle.progress().files_direct, 0u);
  EXPECT_EQ(handle.progress().files_buffered, 1u);
}

TEST_F(FaultTest, DirectRefusedAtOpenIsAnErrorUnderOn) {
  Rig rig(Faults{.refuse_direct_open = true}, load_options(Mode::kOn));
  try {
    rig.loader.load({path_});
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    expect_names_file(e, path_);
  }
  expect_released(rig);
}

TEST_F(FaultTest, DirectRefusedAtFirstReadFallsBackUnderAuto) {
  if (!direct_ok_) GTEST_SKIP() << "no O_DIRECT here";
  Rig rig(Faults{.refuse_direct_first_read = true}, load_options(Mode::kAutoCold, 1));
  LoadHandle handle = rig.loader.load_async({path_});
  expect_matches_file(handle.wait(), path_, image_);
  EXPECT_EQ(rig.env.direct_opens(), 1u);
  // The file ends up read through the page cache, and progress says so.
  EXPECT_EQ(handle.progress().files_direct, 0u);
  EXPECT_EQ(handle.progress().files_buffered, 1u);
}

TEST_F(FaultTest, DirectRefusedAtFirstReadIsAnErrorUnderOn) {
  if (!direct_ok_) GTEST_SKIP() << "no O_DIRECT here";
  Rig rig(Faults{.refuse_direct_first_read = true}, load_options(Mode::kOn));
  try {
    rig.loader.load({path_});
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    expect_names_file(e, path_);
    EXPECT_TRUE(e.context().begin.has_value());
  }
  expect_released(rig);
}

// ---- truncation ----

// Buffered, with the file found in the page cache: copied from a mapping.
LoadOptions mapped_options(unsigned threads = 4) {
  LoadOptions o = load_options(Mode::kOff, threads);
  o.resident_threshold = 0.0;  // any file counts as cached
  o.cached_read = CachedRead::kMap;  // every chunk, not as CachedRead::kAuto measures
  return o;
}

void expect_mapping_released(const FaultEnv& env) { EXPECT_EQ(env.file_mapped_bytes(), 0); }

TEST_F(FaultTest, TruncatedAfterHeaderParseIsIoError) {
  const std::uint64_t cut = data_offset() + 300'001;
  // nullopt: copied from a mapping, where populate_read fails with EFAULT past
  // the cut and the pread fallback finds the end of the file.
  for (const std::optional<Mode> mode : {std::optional(Mode::kOff), std::optional(Mode::kOn),
                                         std::optional(Mode::kAutoCold), std::optional<Mode>()}) {
    if (mode && *mode != Mode::kOff && !direct_ok_) continue;
    SCOPED_TRACE(mode ? mode_name(*mode) : "mapped");
    Rig rig(Faults{.truncate_to = cut}, mode ? load_options(*mode) : mapped_options());
    try {
      rig.loader.load({path_});
      FAIL() << "expected IoError";
    } catch (const IoError& e) {
      expect_names_file(e, path_);
      ASSERT_TRUE(e.context().begin.has_value());
      if (mode != Mode::kOn) {  // O_DIRECT may refuse the clipped length instead
        EXPECT_GE(*e.context().begin, cut);
        EXPECT_NE(e.message().find("ended"), std::string::npos) << e.what();
      }
    }
    if (!mode) {
      EXPECT_GT(rig.env.populates(), 0u);
    }
    expect_mapping_released(rig.env);
    expect_released(rig);
  }
}

// ---- copies from a mapping (Note [Mapped reads]) ----

TEST_F(FaultTest, MappedLoadCopiesFromTheMappingAndUnmapsIt) {
  Rig rig(Faults{}, mapped_options());
  {
    LoadHandle handle = rig.loader.load_async({path_});
    expect_matches_file(handle.wait(), path_, image_);
    EXPECT_EQ(handle.progress().files_mapped, 1u);
  }
  EXPECT_GT(rig.env.populates(), 0u);
  EXPECT_EQ(rig.env.reads(), 2u) << "only the header is pread";
  expect_mapping_released(rig.env);
  expect_released(rig);
}

TEST_F(FaultTest, RefusedMappingFallsBackToPread) {
  Rig rig(Faults{.refuse_map_file = true}, mapped_options());
  {
    LoadHandle handle = rig.loader.load_async({path_});
    expect_matches_file(handle.wait(), path_, image_);
    EXPECT_EQ(handle.progress().files_mapped, 0u);
  }
  EXPECT_EQ(rig.env.populates(), 0u);
  EXPECT_GT(rig.env.reads(), 2u);
  expect_released(rig);
}

TEST_F(FaultTest, FailedPopulateRereadsTheChunkWithPread) {
  for (const int err : {ENOMEM, EIO, EHWPOISON}) {
    SCOPED_TRACE(std::strerror(err));
    Rig rig(Faults{.populate_errno = err}, mapped_options());
    expect_matches_file(rig.loader.load({path_}), path_, image_);
    EXPECT_GT(rig.env.populates(), 0u);
    EXPECT_EQ(rig.env.reads() - 2, rig.env.populates()) << "each chunk pread once";
    expect_mapping_released(rig.env);
    expect_released(rig);
  }
}

TEST_F(FaultTest, InterruptedPopulateIsRetried) {
  Rig rig(Faults{.eintr_every_other = true}, mapped_options());
  expect_matches_file(rig.loader.load({path_}), path_, image_);
  EXPECT_GT(rig.env.populates(), 0u);
  expect_released(rig);
}

// ---- zero-copy loads (Note [Zero-copy loads]) under an injected-fault Env ----

LoadOptions zero_copy_options(unsigned threads = 4) {
  LoadOptions o = load_options(Mode::kOff, threads);
  o.zero_copy = ZeroCopy::kOn;
  return o;
}

// No mapping, lease or watcher of a zero-copy load is left.
void expect_no_lease() {
  EXPECT_EQ(detail::LeasedMapping::live_count(), 0u);
  EXPECT_FALSE(detail::LeasedMapping::watcher_running());
}

TEST_F(FaultTest, ZeroCopyLoadMapsThroughTheEnvAndReleasesEverything) {
  Rig rig(Faults{}, zero_copy_options());
  {
    LoadHandle handle = rig.loader.load_async({path_});
    expect_matches_file(handle.wait(), path_, image_);
    EXPECT_EQ(handle.progress().files_zero_copy, 1u);
    EXPECT_EQ(rig.env.private_maps(), 1u);
    EXPECT_GT(rig.env.populates(), 0u);
    EXPECT_EQ(rig.env.reads(), 2u) << "only the header is pread";
  }
  expect_no_lease();
  expect_released(rig);
}

TEST_F(FaultTest, ZeroCopyPopulateThatFailsIsIoErrorNamingFileAndOffset) {
  for (const int err : {EIO, ENOMEM, EHWPOISON}) {
    SCOPED_TRACE(std::strerror(err));
    Rig rig(Faults{.populate_errno = err}, zero_copy_options());
    try {
      rig.loader.load({path_});
      ADD_FAILURE() << "no error";
    } catch (const IoError& e) {
      expect_names_file(e, path_);
      ASSERT_TRUE(e.context().begin.has_value()) << e.what();
      EXPECT_LT(*e.context().begin, file_size()) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::strerror(err)), std::string::npos) << e.what();
    }
    EXPECT_EQ(rig.env.private_maps(), 1u);
    expect_no_lease();
    expect_released(rig);
  }
}

TEST_F(FaultTest, ZeroCopyInterruptedPopulateIsRetried) {
  Rig rig(Faults{.eintr_every_other = true}, zero_copy_options());
  {
    LoadHandle handle = rig.loader.load_async({path_});
    expect_matches_file(handle.wait(), path_, image_);
    EXPECT_EQ(handle.progress().files_zero_copy, 1u);
  }
  EXPECT_GT(rig.env.populates(), 1u);
  expect_no_lease();
  expect_released(rig);
}

TEST_F(FaultTest, ZeroCopyRefusedMappingReadsTheFileInstead) {
  Rig rig(Faults{.refuse_map_file_private = true}, zero_copy_options());
  {
    LoadHandle handle = rig.loader.load_async({path_});
    expect_matches_file(handle.wait(), path_, image_);
    EXPECT_EQ(handle.progress().files_zero_copy, 0u);
  }
  EXPECT_EQ(rig.env.private_maps(), 0u);
  EXPECT_GT(rig.env.reads(), 2u);
  expect_no_lease();
  expect_released(rig);
}

TEST_F(FaultTest, ZeroCopyFallbackReadsMeetTheInjectedFaults) {
  // The mapping is refused, so the file is read, and the 3rd pread's EIO is
  // the load's error: the fallback is under the same Env.
  Rig rig(Faults{.fail_read_at = 3, .refuse_map_file_private = true}, zero_copy_options());
  EXPECT_THROW(rig.loader.load({path_}), IoError);
  expect_no_lease();
  expect_released(rig);
}

TEST_F(FaultTest, ZeroCopyShortReadsOfTheHeaderStillLoadByteExact) {
  Rig rig(Faults{.short_read_bytes = 7}, zero_copy_options());
  {
    LoadHandle handle = rig.loader.load_async({path_});
    expect_matches_file(handle.wait(), path_, image_);
    EXPECT_EQ(handle.progress().files_zero_copy, 1u);
  }
  expect_no_lease();
  expect_released(rig);
}

// Cuts the real file after the Nth populate_read has filled its pages: the
// copy that follows touches pages the kernel has just unmapped, and the
// mapping raises a real SIGBUS.
class TruncateAfterPopulateEnv : public EnvWrapper {
 public:
  TruncateAfterPopulateEnv(Env* target, std::string path, std::uint64_t cut_to, std::uint64_t nth)
      : EnvWrapper(target), path_(std::move(path)), cut_to_(cut_to), nth_(nth) {}
  int populate_read(const void* address, std::size_t bytes) override {
    const int rc = EnvWrapper::populate_read(address, bytes);
    if (++calls_ == nth_) std::filesystem::resize_file(path_, cut_to_);
    return rc;
  }
  std::uint64_t calls() const { return calls_; }

 private:
  std::string path_;
  std::uint64_t cut_to_;
  std::uint64_t nth_;
  std::atomic<std::uint64_t> calls_{0};
};

TEST_F(FaultTest, SigbusWhileCopyingFromATruncatedMappingIsIoError) {
  const std::string path = dir_.file("cut-while-copying.safetensors");
  std::filesystem::copy_file(path_, path);
  FaultEnv counting;
  // The 3rd chunk of 64 KiB is cut away under its copy, after its populate.
  TruncateAfterPopulateEnv cutting(&counting, path, data_offset() + 100, 3);
  auto pool = Pool::create(make_locked_memory_backend(&counting));
  Loader loader(mapped_options(1), pool, &cutting);
  try {
    loader.load({path});
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    expect_names_file(e, path);
    ASSERT_TRUE(e.context().begin.has_value());
    EXPECT_NE(e.message().find("ended"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cutting.calls(), 3u) << "the load stops at the chunk that was cut";
  EXPECT_EQ(pool->stats().live_blocks, 0u);
  EXPECT_EQ(counting.open_fds(), 0);
  expect_mapping_released(counting);
}

// Under a sanitizer, the handler before pinload's is the sanitizer's, which
// reports the SIGBUS and exits.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// pinload's SIGBUS handler only takes faults of its own copies: a SIGBUS
// elsewhere (here, a truncated mapping of the test's own) still goes to the
// handler before it, or kills.
TEST_F(FaultTest, SigbusOutsidePinloadsCopiesStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  {
    Rig rig(Faults{}, mapped_options());  // installs the handler
    expect_matches_file(rig.loader.load({path_}), path_, image_);
  }
  const std::string path = dir_.file("mine.bin");
  testing::write_file(path, std::vector<std::uint8_t>(3 * 4096, 1));
  EXPECT_EXIT(
      {
        const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
        auto* p = static_cast<volatile const char*>(::mmap(nullptr, 3 * 4096, PROT_READ, MAP_SHARED, fd, 0));
        if (::ftruncate(fd, 0) == 0) (void)p[2 * 4096];  // SIGBUS here
        std::_Exit(0);                                   // survived: the SIGBUS was swallowed
      },
      [](int status) {
        if (kSanitized) return WIFEXITED(status) && WEXITSTATUS(status) != 0;
        return WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS;
      },
      kSanitized ? "Sanitizer.*BUS" : "");
}

TEST_F(FaultTest, FileThatShrankSinceItsHeaderWasReadIsIoError) {
  const std::string path = dir_.file("shrinking.safetensors");
  std::filesystem::copy_file(path_, path);
  Rig rig(Faults{}, load_options(Mode::kOff));
  const Checkpoint checkpoint = open_checkpoint(&rig.env, {path});
  std::filesystem::resize_file(path, file_size() - 10);
  try {
    rig.loader.load(checkpoint);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    expect_names_file(e, path);
  }
  expect_released(rig);
}

// ---- memory ----

TEST_F(FaultTest, MapFailureIsOutOfMemory) {
  Rig rig(Faults{.fail_map_at = 1}, load_options(Mode::kOff));
  EXPECT_THROW(rig.loader.load({path_}), OutOfMemoryError);
  expect_released(rig);
  EXPECT_EQ(rig.env.mapped_bytes(), 0);
  EXPECT_EQ(rig.pool->stats().reserved_bytes, 0u);
  expect_matches_file(rig.loader.load({path_}), path_, image_);  // the second map succeeds
}

// Each file fits the budget, all three do not: waiting could never end, as
// the load itself holds the memory.
TEST_F(FaultTest, CheckpointOverTheBudgetFailsAtOnce) {
  std::vector<std::string> paths;
  for (int i = 0; i < 3; ++i) {
    paths.push_back(dir_.file("big" + std::to_string(i) + ".safetensors"));
    write_blob(paths.back(), "b" + std::to_string(i), 700 * KiB);
  }
  for (WhenFull when_full : {WhenFull::kFail, WhenFull::kWait}) {
    PoolOptions pool_options;
    pool_options.capacity_bytes = 2 * MiB;
    pool_options.when_full = when_full;
    pool_options.wait_timeout = std::chrono::seconds(20);
    Rig rig(Faults{}, load_options(Mode::kOff), pool_options);
    const auto start = Clock::now();
    try {
      rig.loader.load(paths);
      FAIL() << "expected OutOfMemoryError";
    } catch (const OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what()).find("budget"), std::string::npos) << e.what();
    }
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
    expect_released(rig);
  }
}

// ---- cancellation ----

class CancelTest : public FaultTest {
 protected:
  void SetUp() override {
    FaultTest::SetUp();
    slow_path_ = dir_.file("slow.safetensors");
    write_blob(slow_path_, "slow", 2 * MiB);
  }
  // 512 reads of 4 ms: about a second on 2 threads, so a load that was not
  // cancelled stands out.
  static Faults slow() { return Faults{.read_delay_us = 4000}; }
  static LoadOptions slow_options(unsigned threads = 2) { return load_options(Mode::kOff, threads, 4 * KiB); }

  static void wait_for_progress(const LoadHandle& handle) {
    for (int i = 0; i < 1000 && handle.progress().bytes_done == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  std::string slow_path_;
};

TEST_F(CancelTest, CancelGivesCancelledErrorAndReleasesEverything) {
  Rig rig(slow(), slow_options());
  LoadHandle handle = rig.loader.load_async({slow_path_});
  wait_for_progress(handle);
  EXPECT_FALSE(handle.done());
  const auto start = Clock::now();
  handle.cancel();
  EXPECT_THROW(handle.wait(), CancelledError);
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(500));
  EXPECT_LT(handle.progress().bytes_done, handle.progress().bytes_total);
  expect_released(rig);
}

TEST_F(CancelTest, DestroyingTheHandleMidLoadCancelsIt) {
  Rig rig(slow(), slow_options());
  std::optional<LoadHandle> handle = rig.loader.load_async({slow_path_});
  wait_for_progress(*handle);
  EXPECT_FALSE(handle->done());
  const auto start = Clock::now();
  handle.reset();
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(500));
  expect_released(rig);
}

TEST_F(CancelTest, AssigningOverARunningHandleCancelsIt) {
  Rig rig(slow(), slow_options(1));
  Rig quick(Faults{}, load_options(Mode::kOff));
  LoadHandle handle = rig.loader.load_async({slow_path_});
  wait_for_progress(handle);
  const auto start = Clock::now();
  handle = quick.loader.load_async({path_});
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(500));
  expect_released(rig);
  expect_matches_file(handle.wait(), path_, image_);
}

TEST_F(CancelTest, StopTokenCancelsASynchronousLoad) {
  Rig rig(slow(), slow_options());
  const Checkpoint checkpoint = open_checkpoint(&rig.env, {slow_path_});
  std::stop_source stop;
  std::jthread canceller([&] {
    while (rig.env.reads() < 10) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    stop.request_stop();
  });
  EXPECT_THROW(rig.loader.load(checkpoint, stop.get_token()), CancelledError);
  canceller.join();
  expect_released(rig);
}

TEST_F(CancelTest, CancelWhileWaitingForPoolMemory) {
  PoolOptions pool_options;
  pool_options.capacity_bytes = 8 * MiB;
  pool_options.when_full = WhenFull::kWait;
  pool_options.wait_timeout = std::chrono::seconds(20);
  Rig rig(Faults{}, load_options(Mode::kOff), pool_options);
  auto held = rig.pool->allocate(7 * MiB);  // 8 MiB reserved: the 2 MiB file's block must wait
  LoadHandle handle = rig.loader.load_async({slow_path_});
  for (int i = 0; i < 1000 && rig.pool->stats().budget_waits == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_EQ(rig.pool->stats().budget_waits, 1u);
  const auto start = Clock::now();
  handle.cancel();
  EXPECT_THROW(handle.wait(), CancelledError);
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(500));
  EXPECT_EQ(rig.pool->stats().live_blocks, 1u);
  held.reset();
  expect_released(rig);
}

}  // namespace
}  // namespace pinload
