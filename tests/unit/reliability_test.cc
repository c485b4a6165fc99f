// Reliability under hostile input and limits: one version of each file
// per load, special files, typed errors, descriptors held only for the files
// in flight, memory limits.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <random>
#include <set>

#include "file_check.h"
#include "pinload/checkpoint.h"
#include "pinload/env.h"
#include "pinload/error.h"
#include "pinload/file_identity.h"
#include "pinload/loader.h"
#include "pinload/memory_limit.h"
#include "test_files.h"

namespace pinload {
namespace {

namespace fs = std::filesystem;
using testing::FileImage;
using testing::TempDir;
using testing::TensorSpec;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

LoadOptions small_options(unsigned threads = 4, std::size_t files_in_flight = 2) {
  LoadOptions o;
  o.threads = threads;
  o.block_size = 4096;
  o.files_in_flight = files_in_flight;
  o.direct = DirectIo::kOff;
  o.numa.node = kNumaNone;
  return o;
}

std::shared_ptr<Pool> host_pool() { return Pool::create(make_locked_memory_backend(default_env())); }

// Two files of the same size and header length whose tensors differ (names,
// shapes, bytes): a load that mixed them would be seen.
struct TwoVersions {
  FileImage a, b;
  std::string path_a, path_b;
};

TwoVersions two_versions(const TempDir& dir) {
  std::mt19937_64 rng(13);
  TwoVersions v;
  v.a = testing::make_image({{"w", "F32", {4, 4}}}, rng, 64);
  v.b = testing::make_image({{"w", "F16", {8, 4}}}, rng, 64);
  v.path_a = dir.file("a.safetensors");
  v.path_b = dir.file("b.safetensors");
  testing::write_file(v.path_a, v.a.bytes());
  testing::write_file(v.path_b, v.b.bytes());
  EXPECT_EQ(v.a.bytes().size(), v.b.bytes().size());
  return v;
}

// ---- FileIdentity ----

TEST(FileIdentity, ComparesDeviceInodeSizeAndMtime) {
  FileStat st;
  st.device = 1, st.inode = 2, st.size = 3, st.mtime_ns = 4;
  const FileIdentity id = FileIdentity::of(st);
  EXPECT_EQ(id, (FileIdentity{1, 2, 3, 4}));
  for (int field = 0; field < 4; ++field) {
    FileStat other = st;
    if (field == 0) other.device = 9;
    if (field == 1) other.inode = 9;
    if (field == 2) other.size = 9;
    if (field == 3) other.mtime_ns = 9;
    EXPECT_NE(FileIdentity::of(other), id) << field;
  }
  FileStat aligned = st;
  aligned.dio_mem_align = 512;
  EXPECT_EQ(FileIdentity::of(aligned), id);
}

TEST(FileIdentity, CheckIdentityRefusesAReplacedFile) {
  TempDir dir;
  const TwoVersions v = two_versions(dir);
  const std::string path = dir.file("m.safetensors");
  fs::copy_file(v.path_a, path);
  ScopedFd before = open_or_throw(default_env(), path);
  const FileIdentity id = FileIdentity::of(stat_or_throw(default_env(), before.get(), path));
  EXPECT_NO_THROW(check_identity(default_env(), before.get(), path, id));
  fs::rename(v.path_b, path);  // same size, another inode
  ScopedFd after = open_or_throw(default_env(), path);
  try {
    check_identity(default_env(), after.get(), path, id);
    FAIL() << "a replaced file passed";
  } catch (const IoError& e) {
    EXPECT_TRUE(contains(e.what(), "replaced or modified since its header was read")) << e.what();
    EXPECT_EQ(e.context().file, path);
  }
}

// ---- item 1: one version of each file per load ----

// The header is read, the path replaced by a file of the same size, then the
// data is read: the old code compared only the size and returned the new
// bytes under the old header.
TEST(OneVersionPerLoad, ReplacedAfterHeaderReadFailsTyped) {
  TempDir dir;
  const TwoVersions v = two_versions(dir);
  const std::string path = dir.file("m.safetensors");
  fs::copy_file(v.path_a, path);
  const Checkpoint checkpoint = open_checkpoint(default_env(), {path});
  fs::rename(v.path_b, path);
  Loader loader(small_options(), host_pool());
  try {
    (void)loader.load(checkpoint);
    FAIL() << "loaded the old header with the new bytes";
  } catch (const IoError& e) {
    EXPECT_TRUE(contains(e.what(), "replaced or modified")) << e.what();
    EXPECT_EQ(e.context().file, path);
  }
}

TEST(OneVersionPerLoad, RewrittenInPlaceFailsTyped) {
  TempDir dir;
  const TwoVersions v = two_versions(dir);
  const std::string path = dir.file("m.safetensors");
  fs::copy_file(v.path_a, path);
  const Checkpoint checkpoint = open_checkpoint(default_env(), {path});
  // Same inode and size, new mtime.
  const auto later = fs::last_write_time(path) + std::chrono::seconds(2);
  testing::write_file(path, v.b.bytes());
  fs::last_write_time(path, later);
  Loader loader(small_options(), host_pool());
  EXPECT_THROW((void)loader.load(checkpoint), IoError);
}

// A load that runs while the path is swapped between two versions returns
// one of them whole, or fails with a typed error: never a mix.
TEST(OneVersionPerLoad, RacingRenamerNeverMixes) {
  TempDir dir;
  const TwoVersions v = two_versions(dir);
  const std::string path = dir.file("m.safetensors");
  fs::copy_file(v.path_a, path);
  std::atomic<bool> stop{false};
  std::thread renamer([&] {
    const std::string tmp = dir.file("tmp.safetensors");
    for (int i = 0; !stop; ++i) {
      std::error_code ec;
      fs::create_hard_link(i % 2 ? v.path_a : v.path_b, tmp, ec);
      fs::rename(tmp, path, ec);
      // Each swap changes both files' ctime (their link counts), which a load
      // counts as a change of its file (file_identity.h): back to back, no load
      // finishes between two swaps; a pause lets some through, most overlap one.
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  });
  Loader loader(small_options(2), host_pool());
  const std::vector<char> bytes_a = testing::slurp(v.path_a);
  const std::vector<char> bytes_b = testing::slurp(v.path_b);
  int whole = 0, refused = 0;
  for (int i = 0; i < 300; ++i) {
    try {
      const StateDict sd = loader.load({path});
      const Tensor& w = sd.at("w");
      const bool is_a = w.dtype() == DType::kF32;
      const FileImage& image = is_a ? v.a : v.b;
      const std::vector<char>& file = is_a ? bytes_a : bytes_b;
      testing::expect_tensor_bytes(w, file, image, testing::find_layout(image, "w"));
      ++whole;
    } catch (const IoError&) {
      ++refused;
    } catch (const NotFoundError&) {
      ++refused;  // between the unlink of the old name and the new one: not here
    }
    if (::testing::Test::HasFailure()) break;
  }
  stop = true;
  renamer.join();
  EXPECT_GT(whole, 0);
  RecordProperty("refused", refused);
}

// Note [Holding a file]: reads through a HeldFileEnv reach the held file even
// after its path is replaced.
TEST(OneVersionPerLoad, HeldFileEnvReadsTheHeldFile) {
  TempDir dir;
  const TwoVersions v = two_versions(dir);
  const std::string path = dir.file("m.safetensors");
  fs::copy_file(v.path_a, path);
  HeldFileEnv held(default_env(), path);
  const CheckpointFile header = read_checkpoint_file(&held, path);
  fs::rename(v.path_b, path);
  for (DirectIo direct : {DirectIo::kOff, DirectIo::kAuto}) {
    LoadOptions o = small_options();
    o.direct = direct;
    Loader loader(o, host_pool(), &held);
    const StateDict sd = loader.load({path});
    ASSERT_EQ(sd.at("w").dtype(), DType::kF32);
    testing::expect_tensor_bytes(sd.at("w"), testing::slurp(v.path_a), v.a, testing::find_layout(v.a, "w"));
  }
  EXPECT_EQ(header.header.tensors.at(0).dtype, DType::kF32);
}

// ---- item 4: special files ----

// Runs `f` with a deadline: a blocking open would otherwise hang the test.
template <class F>
void within_seconds(int seconds, F f) {
  auto done = std::async(std::launch::async, f);
  ASSERT_EQ(done.wait_for(std::chrono::seconds(seconds)), std::future_status::ready) << "blocked";
  done.get();
}

void expect_refused_as(const std::string& path, const std::string& type) {
  try {
    (void)open_checkpoint(default_env(), {path});
    ADD_FAILURE() << "accepted " << path;
  } catch (const InvalidFileError& e) {
    EXPECT_TRUE(contains(e.what(), "is a " + type)) << e.what();
    EXPECT_EQ(e.context().file, path);
  }
  // Opened directly (no path resolution): refused from the open file's stat.
  if (type != "socket") {
    try {
      (void)read_checkpoint_file(default_env(), path);
      ADD_FAILURE() << "read a header from " << path;
    } catch (const InvalidFileError& e) {
      EXPECT_TRUE(contains(e.what(), "not a regular file")) << e.what();
    }
  }
}

TEST(SpecialFiles, FifoIsRefusedWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.file("fifo.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  within_seconds(10, [&] { expect_refused_as(fifo, "FIFO"); });
}

TEST(SpecialFiles, IndexNamingAFifoShardIsRefused) {
  TempDir dir;
  ASSERT_EQ(::mkfifo(dir.file("model-00001-of-00001.safetensors").c_str(), 0600), 0);
  std::ofstream(dir.file("model.safetensors.index.json"))
      << R"({"weight_map": {"w": "model-00001-of-00001.safetensors"}})";
  within_seconds(10, [&] {
    EXPECT_THROW((void)open_checkpoint(default_env(), {dir.file("model.safetensors.index.json")}), InvalidFileError);
  });
}

TEST(SpecialFiles, SocketAndDevicesAreRefused) {
  TempDir dir;
  const std::string socket_path = dir.file("s.safetensors");
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(s, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(socket_path.size(), sizeof addr.sun_path);
  std::strcpy(addr.sun_path, socket_path.c_str());
  ASSERT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  within_seconds(10, [&] { expect_refused_as(socket_path, "socket"); });
  ::close(s);
  within_seconds(10, [&] { expect_refused_as("/dev/zero", "character device"); });
}

// ---- item 5: typed errors ----

TEST(TypedErrors, SymlinkLoopIsAnIoErrorNotNotFound) {
  TempDir dir;
  const std::string loop = dir.file("loop.safetensors");
  fs::create_symlink(loop, loop);
  try {
    (void)open_checkpoint(default_env(), {loop});
    FAIL();
  } catch (const NotFoundError& e) {
    FAIL() << "ELOOP reported as not found: " << e.what();
  } catch (const IoError& e) {
    EXPECT_TRUE(contains(e.what(), "symbolic links")) << e.what();
    EXPECT_EQ(e.context().file, loop);
  }
}

TEST(TypedErrors, FolderWithASymlinkLoopIsAPinloadError) {
  TempDir dir;
  fs::create_directory(dir.path() / "model");
  const std::string loop = dir.file("model/x.safetensors");
  fs::create_symlink(loop, loop);
  try {
    (void)open_checkpoint(default_env(), {dir.file("model")});
    FAIL();
  } catch (const Error& e) {
    EXPECT_FALSE(e.context().file.empty()) << e.what();
  }
}

TEST(TypedErrors, UnreadableFolderIsAPinloadError) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads every folder";
  TempDir dir;
  fs::create_directory(dir.path() / "model");
  fs::permissions(dir.path() / "model", fs::perms::none);
  EXPECT_THROW((void)open_checkpoint(default_env(), {dir.file("model")}), IoError);
  fs::permissions(dir.path() / "model", fs::perms::owner_all);
}

// ---- item 6: descriptors only for the files in flight ----

// Counts the descriptors open at once.
class CountingEnv : public EnvWrapper {
 public:
  CountingEnv() : EnvWrapper(default_env()) {}
  int open_read(const std::string& path, int flags) override {
    const int fd = EnvWrapper::open_read(path, flags);
    if (fd >= 0) {
      std::lock_guard lock(mu_);
      peak_ = std::max(peak_, ++open_);
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
  int peak() const {
    std::lock_guard lock(mu_);
    return peak_;
  }
  int open() const {
    std::lock_guard lock(mu_);
    return open_;
  }

 private:
  mutable std::mutex mu_;
  int open_ = 0, peak_ = 0;
};

TEST(FilesInFlight, FortyShardsHoldOnlyTheFilesInFlight) {
  TempDir dir;
  std::mt19937_64 rng(6);
  std::vector<std::string> paths;
  std::vector<FileImage> images;
  for (int i = 0; i < 40; ++i) {
    paths.push_back(dir.file("shard-" + std::to_string(i) + ".safetensors"));
    images.push_back(testing::write_random_checkpoint(paths.back(), rng, 3, 3000, "s" + std::to_string(i) + "."));
  }
  for (DirectIo direct : {DirectIo::kOff, DirectIo::kOn}) {
    CountingEnv env;
    LoadOptions o = small_options(/*threads=*/8, /*files_in_flight=*/2);
    o.direct = direct;
    Loader loader(o, host_pool(), &env);
    StateDict sd;
    try {
      sd = loader.load(paths);
    } catch (const IoError& e) {
      if (direct == DirectIo::kOn) GTEST_SKIP() << "no O_DIRECT here: " << e.what();
      throw;
    }
    for (int i = 0; i < 40; ++i) testing::expect_matches_file(sd, paths[i], images[i]);
    // Two files in flight, two descriptors each (buffered and O_DIRECT).
    EXPECT_LE(env.peak(), 4) << "direct " << static_cast<int>(direct);
    EXPECT_EQ(env.open(), 0);
  }
}

// ---- item 2: memory limits ----

void write_text(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

TEST(MemoryLimit, ReadsCgroupV1AndMemAvailable) {
  TempDir root;
  write_text(root.path() / "proc/meminfo", "MemTotal: 100000 kB\nMemAvailable:   50000 kB\n");
  write_text(root.path() / "proc/self/cgroup", "12:cpu,cpuacct:/x\n4:memory:/jobs/a\n");
  const fs::path cg = root.path() / "sys/fs/cgroup/memory/jobs/a";
  write_text(cg / "memory.limit_in_bytes", "1000000\n");
  write_text(cg / "memory.usage_in_bytes", "700000\n");
  write_text(cg / "memory.stat", "cache 300000\nrss 400000\ntotal_cache 300000\n");
  write_text(root.path() / "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  const std::optional<HostMemoryLimit> limit = read_host_memory_limit(default_env(), root.path().string());
  ASSERT_TRUE(limit);
  EXPECT_EQ(limit->available_bytes, 1000000u - 400000u);  // page cache is reclaimed before a kill
  EXPECT_TRUE(contains(limit->source, "cgroup v1 memory.limit_in_bytes 1000000")) << limit->source;
}

TEST(MemoryLimit, ReadsCgroupV2AndItsAncestors) {
  TempDir root;
  write_text(root.path() / "proc/meminfo", "MemAvailable: 4 kB\n");
  write_text(root.path() / "proc/self/cgroup", "0::/a/b\n");
  write_text(root.path() / "sys/fs/cgroup/a/b/memory.max", "max\n");
  write_text(root.path() / "sys/fs/cgroup/a/memory.max", "90000\n");
  write_text(root.path() / "sys/fs/cgroup/a/memory.current", "10000\n");
  write_text(root.path() / "sys/fs/cgroup/a/memory.stat", "anon 10000\nfile 0\n");
  std::optional<HostMemoryLimit> limit = read_host_memory_limit(default_env(), root.path().string());
  ASSERT_TRUE(limit);
  EXPECT_EQ(limit->available_bytes, 4096u);  // MemAvailable is tighter
  write_text(root.path() / "proc/meminfo", "MemAvailable: 1000000 kB\n");
  limit = read_host_memory_limit(default_env(), root.path().string());
  ASSERT_TRUE(limit);
  EXPECT_EQ(limit->available_bytes, 80000u);
  EXPECT_TRUE(contains(limit->source, "cgroup v2 memory.max 90000")) << limit->source;
}

TEST(MemoryLimit, NothingReadableIsNoLimit) {
  TempDir root;
  EXPECT_FALSE(read_host_memory_limit(default_env(), root.path().string()));
}

TEST(MemoryLimit, PoolBudgetTooSmallFailsBeforeReadingNamingTheFile) {
  TempDir dir;
  std::mt19937_64 rng(2);
  const std::string path = dir.file("big.safetensors");
  testing::write_file(path, testing::make_image({{"w", "U8", {200000}}}, rng).bytes());
  LoadOptions o = small_options();
  o.pool_bytes = 64 * 1024;
  CountingEnv env;
  Loader loader(o, nullptr, &env);
  try {
    (void)loader.load({path});
    FAIL();
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.context().file, path);
    EXPECT_TRUE(contains(e.what(), "the pool budget is 65536 bytes")) << e.what();
  }
  EXPECT_EQ(loader.pool()->stats().reserved_bytes, 0u);
}

}  // namespace
}  // namespace pinload
