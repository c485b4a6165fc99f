// Tests of load_batch (pinload/batch.h): every item is compared byte for byte
// with what a plain std::ifstream reads at the offsets of the test's own
// header, and with a load of that path alone; bad paths among good ones fail
// alone (Note [Batch errors]).
#include "pinload/batch.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "fault_env.h"
#include "file_check.h"
#include "pinload/error.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::FileImage;
using testing::TempDir;

// `count` LoRA-like files whose tensors share their names ("lora.<i>.weight").
struct Library {
  TempDir dir;
  std::vector<std::string> paths;
  std::vector<FileImage> images;
  explicit Library(int count, int tensors = 12) {
    std::mt19937_64 rng(7);
    for (int i = 0; i < count; ++i) {
      paths.push_back(dir.file("lora" + std::to_string(i) + ".safetensors"));
      images.push_back(testing::write_random_checkpoint(paths.back(), rng, tensors, 20000, "lora."));
    }
  }
};

LoadOptions small_options() {
  LoadOptions o;
  o.threads = 4;
  o.block_size = 64 << 10;  // several chunks per file: files interleave
  o.zero_copy = ZeroCopy::kOff;  // pool blocks and descriptors are counted: no file mappings
  return o;
}

void expect_same(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name(), b[i].name());
    EXPECT_EQ(a[i].dtype(), b[i].dtype());
    EXPECT_EQ(a[i].shape(), b[i].shape());
    ASSERT_EQ(a[i].nbytes(), b[i].nbytes());
    EXPECT_TRUE(std::equal(a[i].bytes().begin(), a[i].bytes().end(), b[i].bytes().begin())) << a[i].name();
  }
  EXPECT_EQ(a.metadata(), b.metadata());
}

std::string error_file(const std::exception_ptr& e, ErrorCode* code) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    *code = err.code();
    return err.context().file;
  }
}

TEST(BatchTest, EveryItemEqualsTheFileAndItsOwnLoad) {
  Library lib(100);
  for (unsigned block : {64u << 10, 8u << 20}) {  // many chunks per file, and one
    LoadOptions o = small_options();
    o.block_size = block;
    const Loader loader(o);
    const std::vector<BatchItem> items = load_batch(loader, lib.paths);
    ASSERT_EQ(items.size(), lib.paths.size());
    for (std::size_t i = 0; i < items.size(); ++i) {
      ASSERT_TRUE(items[i].ok()) << lib.paths[i];
      EXPECT_EQ(items[i].path, lib.paths[i]);
      testing::expect_matches_file(items[i].state, lib.paths[i], lib.images[i]);
      expect_same(items[i].state, loader.load(std::vector<std::string>{lib.paths[i]}));
    }
  }
}

// The message of StateDict::at for a tensor `sd` does not hold ("" if it holds it).
std::string missing_tensor_message(const StateDict& sd) {
  try {
    sd.at("no.such.tensor");
  } catch (const NotFoundError& e) {
    EXPECT_EQ(e.context().tensor, "no.such.tensor");
    return e.what();
  }
  return {};
}

// A state dict of the sweep names its file for a missing tensor, as a load of
// the path alone does (it named none); so does one loaded again on its own
// after a failed sweep (Note [Batch errors]).
TEST(BatchTest, AMissingTensorNamesTheItemsFile) {
  Library lib(3);
  const Loader loader(small_options());
  const std::vector<BatchItem> items = load_batch(loader, lib.paths);
  ASSERT_EQ(items.size(), 3u);
  for (std::size_t i = 0; i < items.size(); ++i) {
    ASSERT_TRUE(items[i].ok()) << lib.paths[i];
    EXPECT_EQ(items[i].state.files(), std::vector<std::string>{lib.paths[i]});
    EXPECT_EQ(missing_tensor_message(items[i].state), lib.paths[i] + ": tensor 'no.such.tensor': no such tensor in the file");
  }
  // A folder is one item of several files: each is named.
  const std::string a = lib.dir.file("sub/a.safetensors"), b = lib.dir.file("sub/b.safetensors");
  std::filesystem::create_directories(lib.dir.path() / "sub");
  std::mt19937_64 rng(11);
  testing::write_random_checkpoint(a, rng, 3, 2000, "a.");
  testing::write_random_checkpoint(b, rng, 3, 2000, "b.");
  const std::vector<BatchItem> folder = load_batch(loader, {(lib.dir.path() / "sub").string(), lib.paths[0]});
  ASSERT_TRUE(folder[0].ok());
  EXPECT_EQ(missing_tensor_message(folder[0].state),
            "tensor 'no.such.tensor': no such tensor in the 2 files loaded (" + a + ", " + b + ")");
}

TEST(BatchTest, FoldersAndRepeatedPaths) {
  Library lib(3);
  const Loader loader(small_options());
  // A file given twice is two equal items, in blocks of their own; a folder
  // is one item, which here fails alone: its files share tensor names.
  const std::vector<BatchItem> items = load_batch(loader, {lib.paths[0], lib.dir.path().string(), lib.paths[0]});
  ASSERT_EQ(items.size(), 3u);
  ASSERT_TRUE(items[0].ok());
  ASSERT_TRUE(items[2].ok());
  expect_same(items[0].state, items[2].state);
  EXPECT_NE(items[0].state[0].block(), items[2].state[0].block());
  EXPECT_FALSE(items[1].ok());  // duplicate tensor names across the folder's files
  ErrorCode code{};
  error_file(items[1].error, &code);
  EXPECT_EQ(code, ErrorCode::kInvalidFile);
}

TEST(BatchTest, OneBadHeaderAmongAHundredFailsAlone) {
  Library lib(100);
  std::vector<std::string> paths = lib.paths;
  // 37: a header that is not JSON; 64: a data section past the file's end; 90: missing.
  testing::write_file(paths[37], testing::raw_file("{not json"));
  testing::write_file(paths[64], testing::raw_file(R"({"x":{"dtype":"U8","shape":[4096],"data_offsets":[0,4096]}})",
                                                  std::vector<std::uint8_t>(100)));
  paths[90] = lib.dir.file("missing.safetensors");
  const Loader loader(small_options());
  const int fds = testing::open_fd_count();
  const std::vector<BatchItem> items = load_batch(loader, paths);
  EXPECT_EQ(testing::open_fd_count(), fds);
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i == 37 || i == 64 || i == 90) {
      ASSERT_FALSE(items[i].ok()) << i;
      EXPECT_TRUE(items[i].state.empty());
      ErrorCode code{};
      EXPECT_EQ(error_file(items[i].error, &code), paths[i]);
      EXPECT_EQ(code, i == 90 ? ErrorCode::kNotFound : ErrorCode::kInvalidFile) << i;
      continue;
    }
    ASSERT_TRUE(items[i].ok()) << i;
    testing::expect_matches_file(items[i].state, paths[i], lib.images[i]);
  }
}

// Rewrites one file after its header was read, at its next open: the sweep
// fails (the file is not the version whose header was read), and the batch
// loads each path alone.
class ChangeAfterHeaderEnv : public EnvWrapper {
 public:
  ChangeAfterHeaderEnv(std::string victim, std::vector<std::uint8_t> bytes)
      : EnvWrapper(default_env()), victim_(std::move(victim)), bytes_(std::move(bytes)) {}
  int open_read(const std::string& path, int extra_flags) override {
    if (path == victim_ && opens_.fetch_add(1) == 1) testing::write_file(path, bytes_);
    return EnvWrapper::open_read(path, extra_flags);
  }

 private:
  std::string victim_;
  std::vector<std::uint8_t> bytes_;
  std::atomic<int> opens_{0};
};

TEST(BatchTest, AFileChangedDuringTheSweepFailsAlone) {
  Library lib(100);
  std::vector<std::uint8_t> longer = testing::read_file(lib.paths[50]);
  longer.resize(longer.size() + 4096, 0);
  ChangeAfterHeaderEnv env(lib.paths[50], longer);
  const Loader loader(small_options(), nullptr, &env);
  const std::vector<BatchItem> items = load_batch(loader, lib.paths);
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i == 50) {
      ASSERT_FALSE(items[i].ok());
      ErrorCode code{};
      EXPECT_EQ(error_file(items[i].error, &code), lib.paths[i]);
      EXPECT_EQ(code, ErrorCode::kIo);
      continue;
    }
    ASSERT_TRUE(items[i].ok()) << i;
    testing::expect_matches_file(items[i].state, lib.paths[i], lib.images[i]);
  }
}

TEST(BatchTest, AReadErrorFailsOnlyItsFile) {
  Library lib(20);
  // EIO on every data read of file 5 (buffered preads: no mapping, no O_DIRECT).
  struct FailOneEnv : testing::PathTrackingEnv {
    std::string victim;
    explicit FailOneEnv(std::string v) : PathTrackingEnv(default_env()), victim(std::move(v)) {}
    std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
      if (bytes >= 4096 && path_of(fd) == victim) return -EIO;
      return PathTrackingEnv::pread(fd, buffer, bytes, offset);
    }
  } env(lib.paths[5]);
  LoadOptions o = small_options();
  o.direct = DirectIo::kOff;
  o.cached_read = CachedRead::kPread;
  const Loader loader(o, nullptr, &env);
  const std::vector<BatchItem> items = load_batch(loader, lib.paths);
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i == 5) {
      ASSERT_FALSE(items[i].ok());
      ErrorCode code{};
      EXPECT_EQ(error_file(items[i].error, &code), lib.paths[i]);
      EXPECT_EQ(code, ErrorCode::kIo);
      continue;
    }
    ASSERT_TRUE(items[i].ok()) << i;
    testing::expect_matches_file(items[i].state, lib.paths[i], lib.images[i]);
  }
}

// Counts the descriptors open at once (slowing every read, so that reads of
// different files overlap whenever the loader lets them).
class ConcurrentOpensEnv : public EnvWrapper {
 public:
  ConcurrentOpensEnv() : EnvWrapper(default_env()) {}
  int open_read(const std::string& path, int extra_flags) override {
    const int fd = EnvWrapper::open_read(path, extra_flags);
    if (fd >= 0) {
      std::lock_guard lock(mu_);
      most_ = std::max(most_, ++open_);
    }
    return fd;
  }
  int close(int fd) override {
    {
      std::lock_guard lock(mu_);
      --open_;
    }
    return EnvWrapper::close(fd);
  }
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return EnvWrapper::pread(fd, buffer, bytes, offset);
  }
  int most() const {
    std::lock_guard lock(mu_);
    return most_;
  }

 private:
  mutable std::mutex mu_;
  int open_ = 0, most_ = 0;
};

// Note [Small files]: files of one chunk each interleave with none, and still
// files_in_flight of them are read at once (before, one at a time).
TEST(BatchTest, OneChunkFilesAreReadFilesInFlightAtOnce) {
  TempDir dir;
  std::vector<std::string> paths;
  std::mt19937_64 rng(11);
  for (int i = 0; i < 16; ++i) {
    paths.push_back(dir.file("f" + std::to_string(i) + ".safetensors"));
    testing::write_random_checkpoint(paths.back(), rng, 4, 2000, "f" + std::to_string(i) + ".");
  }
  ConcurrentOpensEnv env;
  LoadOptions o;
  o.threads = 4;
  o.files_in_flight = 4;
  o.direct = DirectIo::kOff;
  o.cached_read = CachedRead::kPread;  // one descriptor per file
  o.zero_copy = ZeroCopy::kOff;
  const Loader loader(o, nullptr, &env);
  const Checkpoint checkpoint = open_checkpoint(&env, paths);  // headers: one file open at a time
  EXPECT_EQ(env.most(), 1);
  const StateDict sd = loader.load(checkpoint);
  EXPECT_EQ(sd.size(), 64u);
  EXPECT_GE(env.most(), 3);
  EXPECT_LE(env.most(), 4);
}

TEST(BatchTest, CancelledBatchThrows) {
  Library lib(4);
  const Loader loader(small_options());
  std::stop_source stop;
  stop.request_stop();
  EXPECT_THROW(load_batch(loader, lib.paths, stop.get_token()), CancelledError);
}

TEST(BatchTest, EmptyAndAllBad) {
  const Loader loader(small_options());
  EXPECT_TRUE(load_batch(loader, {}).empty());
  const std::vector<BatchItem> items = load_batch(loader, {"/nonexistent/a.safetensors", "/nonexistent/b.safetensors"});
  ASSERT_EQ(items.size(), 2u);
  EXPECT_FALSE(items[0].ok());
  EXPECT_FALSE(items[1].ok());
}

}  // namespace
}  // namespace pinload
