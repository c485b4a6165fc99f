// Tests of Note [Keeping the page cache] (loader.h): a load leaves its cold
// files in the page cache where the rule (or the override) says so, and reads
// them with O_DIRECT, leaving the page cache alone, where it says not. The
// page cache is checked with mincore on a mapping of the file of our own once
// the load has returned; bytes are then compared with an independent reader.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "file_check.h"
#include "load/zero_copy.h"
#include "pinload/device.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "test_files.h"

namespace pinload {
namespace {

namespace fs = std::filesystem;
using testing::FileImage;
using testing::TempDir;

// The fraction of `path`'s pages in the page cache (mincore of every page).
double cached_fraction(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st {};
  ::fstat(fd, &st);
  const std::size_t size = static_cast<std::size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return -1;
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((size + page - 1) / page);
  double fraction = -1;
  if (::mincore(p, size, in.data()) == 0) {
    std::size_t n = 0;
    for (unsigned char c : in) n += c & 1;
    fraction = static_cast<double>(n) / static_cast<double>(in.size());
  }
  ::munmap(p, size);
  return fraction;
}

// Drops `path` from the page cache; false where the filesystem keeps it
// (tmpfs), which makes a cold test meaningless.
bool evict(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return cached_fraction(path) < 0.05;
}

// A cold file of about 24 MiB: several chunks of the default block.
FileImage write_cold(const std::string& path) {
  std::mt19937_64 rng(37);
  std::vector<testing::TensorSpec> specs;
  for (int i = 0; i < 6; ++i) specs.push_back({"t" + std::to_string(i), "U8", {(4u << 20) + 4096u * i}});
  FileImage image = testing::make_image(specs, rng);
  testing::write_file(path, image.bytes());
  return image;
}

// A fake /proc and /sys under `root`: MemAvailable of `available` bytes,
// and, when `cgroup_limit` is not 0, a cgroup v1 memory limit of that many
// bytes with nothing in use.
void fake_memory(const fs::path& root, std::uint64_t available, std::uint64_t cgroup_limit = 0) {
  fs::create_directories(root / "proc/self");
  std::ofstream(root / "proc/meminfo") << "MemTotal: 99999999 kB\nMemAvailable: " << available / 1024 << " kB\n";
  if (cgroup_limit == 0) return;
  std::ofstream(root / "proc/self/cgroup") << "4:memory:/worker\n";
  const fs::path dir = root / "sys/fs/cgroup/memory/worker";
  fs::create_directories(dir);
  std::ofstream(dir / "memory.limit_in_bytes") << cgroup_limit << "\n";
  std::ofstream(dir / "memory.usage_in_bytes") << 0 << "\n";
  std::ofstream(dir / "memory.stat") << "total_cache 0\n";
}

struct Loaded {
  LoadProgress progress;
  double cached_after = -1;  // the file's page-cache fraction when the load has returned
};

// Loads `path` cold with `options` (on `device` when given), measures what
// the load left in the page cache, then checks every byte.
Loaded load_cold(const std::string& path, const FileImage& image, LoadOptions options, Device* device = nullptr) {
  Loaded out;
  options.threads = 4;
  if (device != nullptr) {
    options.target.device = device;
    options.target.mode = DeviceMode::kStreaming;
    options.target.staging_bytes = 32u << 20;
  }
  {
    Loader loader(options);
    LoadHandle h = loader.load_async({path});
    const StateDict sd = h.wait();
    out.progress = h.progress();
    // Before the independent reader, which reads through the page cache.
    out.cached_after = cached_fraction(path);
    if (device == nullptr) testing::expect_matches_file(sd, path, image);
  }
  return out;
}

class ColdLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    ::unsetenv(kPageCacheVariable);
    path_ = dir_.file("cold.safetensors");
    image_ = write_cold(path_);
    if (!evict(path_)) GTEST_SKIP() << "the page cache keeps " << path_ << " (tmpfs?): no cold load here";
    fs::create_directories(dir_.path() / "memory");
  }
  void TearDown() override { ::unsetenv(kPageCacheVariable); }

  std::uint64_t bytes() const { return image_.bytes().size(); }

  TempDir dir_;
  std::string path_;
  FileImage image_;
};

// The restart case: a new process's load of files that fit memory leaves
// them in the page cache (mapped, the only copy), where direct reads left
// nothing for the next process.
TEST_F(ColdLoad, AutoKeepsColdFilesThatFitAndHandsOutTheMapping) {
  const Loaded r = load_cold(path_, image_, LoadOptions{});
  EXPECT_EQ(r.progress.files_zero_copy, 1u);
  EXPECT_EQ(r.progress.files_direct, 0u);
  EXPECT_GE(r.cached_after, 0.99);
}

// Memory that cannot hold the files twice over (MemAvailable, then a cgroup
// v1 limit, at 1.5 x the file): O_DIRECT, as before, and the page cache is
// left alone.
TEST_F(ColdLoad, AutoBypassesWhereTheMemoryLeftCannotHoldThem) {
  LoadOptions o;
  o.memory_root = (dir_.path() / "memory").string();
  fake_memory(o.memory_root, bytes() * 3 / 2);
  Loaded r = load_cold(path_, image_, o);
  EXPECT_EQ(r.progress.files_zero_copy, 0u);
  EXPECT_EQ(r.progress.files_direct, 1u);
  EXPECT_LT(r.cached_after, 0.05);

  ASSERT_TRUE(evict(path_));
  fake_memory(o.memory_root, 1ull << 40, bytes() * 3 / 2);
  r = load_cold(path_, image_, o);
  EXPECT_EQ(r.progress.files_direct, 1u);
  EXPECT_LT(r.cached_after, 0.05);
}

TEST_F(ColdLoad, BypassReadsDirectWhateverMemoryIsLeft) {
  LoadOptions o;
  o.page_cache = pinload::PageCache::kBypass;
  const Loaded r = load_cold(path_, image_, o);
  EXPECT_EQ(r.progress.files_zero_copy, 0u);
  EXPECT_EQ(r.progress.files_direct, 1u);
  EXPECT_LT(r.cached_after, 0.05);
}

// direct=on asks for O_DIRECT: auto leaves the page cache alone.
TEST_F(ColdLoad, AutoBypassesUnderDirectOn) {
  LoadOptions o;
  o.direct = DirectIo::kOn;
  const Loaded r = load_cold(path_, image_, o);
  EXPECT_EQ(r.progress.files_zero_copy, 0u);
  EXPECT_EQ(r.progress.files_direct, 1u);
  EXPECT_LT(r.cached_after, 0.05);
}

// kKeep overrides the rule both where it would bypass (too little memory)
// and where the load keeps a copy of its own (a read into the pool): those
// read buffered.
TEST_F(ColdLoad, KeepOverridesTheRule) {
  LoadOptions o;
  o.page_cache = pinload::PageCache::kKeep;
  o.memory_root = (dir_.path() / "memory").string();
  fake_memory(o.memory_root, bytes() * 3 / 2);
  Loaded r = load_cold(path_, image_, o);
  EXPECT_EQ(r.progress.files_zero_copy, 1u);
  EXPECT_GE(r.cached_after, 0.99);

  ASSERT_TRUE(evict(path_));
  o.zero_copy = ZeroCopy::kOff;
  r = load_cold(path_, image_, o);
  EXPECT_EQ(r.progress.files_direct, 0u);
  EXPECT_EQ(r.progress.files_buffered, 1u);
  EXPECT_GE(r.cached_after, 0.99);
}

// A read into the pool under kAuto keeps its own copy: the page cache would
// be a second one, so the rule bypasses it.
TEST_F(ColdLoad, AutoBypassesWhereTheLoadKeepsItsOwnCopy) {
  LoadOptions o;
  o.zero_copy = ZeroCopy::kOff;
  const Loaded r = load_cold(path_, image_, o);
  EXPECT_EQ(r.progress.files_direct, 1u);
  EXPECT_LT(r.cached_after, 0.05);
}

TEST_F(ColdLoad, EnvironmentVariableOverridesAutoOnly) {
  ::setenv(kPageCacheVariable, "bypass", 1);
  Loaded r = load_cold(path_, image_, LoadOptions{});
  EXPECT_EQ(r.progress.files_direct, 1u);
  EXPECT_LT(r.cached_after, 0.05);

  ASSERT_TRUE(evict(path_));
  LoadOptions keep;
  keep.page_cache = pinload::PageCache::kKeep;  // the option wins
  r = load_cold(path_, image_, keep);
  EXPECT_GE(r.cached_after, 0.99);

  ASSERT_TRUE(evict(path_));
  ::setenv(kPageCacheVariable, "keep", 1);
  LoadOptions small;
  small.memory_root = (dir_.path() / "memory").string();
  fake_memory(small.memory_root, bytes());
  r = load_cold(path_, image_, small);
  EXPECT_EQ(r.progress.files_zero_copy, 1u);
  EXPECT_GE(r.cached_after, 0.99);

  ASSERT_TRUE(evict(path_));
  ::setenv(kPageCacheVariable, "sometimes", 1);  // warned about, then auto
  r = load_cold(path_, image_, LoadOptions{});
  EXPECT_EQ(r.progress.files_zero_copy, 1u);
}

// A streaming device load holds no host copy (staging only): the page cache
// keeps the files for the next process's device load where they fit.
TEST_F(ColdLoad, StreamingDeviceLoadKeepsWhereTheyFit) {
  std::unique_ptr<Device> sim = make_sim_device();
  Loaded r = load_cold(path_, image_, LoadOptions{}, sim.get());
  EXPECT_EQ(r.progress.files_direct, 0u);
  EXPECT_EQ(r.progress.files_buffered, 1u);
  EXPECT_GE(r.cached_after, 0.99);

  ASSERT_TRUE(evict(path_));
  LoadOptions o;
  o.memory_root = (dir_.path() / "memory").string();
  fake_memory(o.memory_root, 1ull << 40, bytes() * 3 / 2);
  r = load_cold(path_, image_, o, sim.get());
  EXPECT_EQ(r.progress.files_direct, 1u);
  EXPECT_LT(r.cached_after, 0.05);
}

// The threshold itself: kept up to kKeepFraction of the memory left.
TEST(PageCacheRule, KeepsUpToTheFractionOfWhatMemoryLeaves) {
  ::unsetenv(kPageCacheVariable);
  TempDir dir;
  LoadOptions o;
  o.memory_root = dir.path().string();
  fake_memory(dir.path(), 1ull << 30);
  const auto limit = static_cast<std::uint64_t>(kKeepFraction * (1ull << 30));
  EXPECT_TRUE(detail::keep_page_cache(o, default_env(), limit, true));
  EXPECT_FALSE(detail::keep_page_cache(o, default_env(), limit + 4096, true));
  EXPECT_FALSE(detail::keep_page_cache(o, default_env(), 1, false));  // the load keeps its own copy
  fake_memory(dir.path(), 1ull << 40, 1ull << 30);       // the cgroup is the tighter
  EXPECT_FALSE(detail::keep_page_cache(o, default_env(), limit + 4096, true));
  o.memory_root = (dir.path() / "nothing").string();  // nothing readable: bypass, as before
  EXPECT_FALSE(detail::keep_page_cache(o, default_env(), 1, true));
}

TEST(PageCacheRule, OptionsSpellAndValidate) {
  EXPECT_EQ(parse_page_cache("keep"), pinload::PageCache::kKeep);
  EXPECT_EQ(parse_page_cache("bypass"), pinload::PageCache::kBypass);
  EXPECT_EQ(parse_page_cache("auto"), pinload::PageCache::kAuto);
  EXPECT_FALSE(parse_page_cache("on"));
  EXPECT_STREQ(page_cache_name(pinload::PageCache::kKeep), "keep");
  LoadOptions o;
  o.page_cache = pinload::PageCache::kBypass;
  o.zero_copy = ZeroCopy::kOn;
  EXPECT_THROW(o.validate(), InvalidArgumentError);
}

}  // namespace
}  // namespace pinload
