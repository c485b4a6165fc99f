// Tests of zero-copy host loads (Note [Zero-copy loads] in loader.h, Note
// [Leased mappings] in io/leased_mapping.h): tensors as views of leased file
// mappings hold the bytes of the version they loaded when another process
// truncates or rewrites the file, never crash the holder, and leave no fd,
// mapping or thread behind. Bytes are compared with an independent reader
// (file_check.h) of the file as it was.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "file_check.h"
#include "pinload/env.h"
#include "io/leased_mapping.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::expect_tensor_bytes;
using testing::FileImage;
using testing::layout_of;
using testing::slurp;
using testing::TempDir;

std::size_t count_entries(const char* dir) {
  std::size_t n = 0;
  DIR* d = ::opendir(dir);
  if (d == nullptr) return 0;
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n;
}

// Lines of `path` that contain `needle` (all lines when it is empty).
std::size_t count_lines(const char* path, const std::string& needle = {}) {
  std::ifstream in(path);
  std::size_t n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(needle) != std::string::npos;
  return n;
}

// A file of `tensors` tensors of about `bytes_each` bytes each.
FileImage write_big(const std::string& path, int tensors, std::uint64_t bytes_each, std::uint64_t seed = 7) {
  std::mt19937_64 rng(seed);
  std::vector<testing::TensorSpec> specs;
  for (int i = 0; i < tensors; ++i) specs.push_back({"t" + std::to_string(i), "U8", {bytes_each + static_cast<std::uint64_t>(i)}});
  FileImage image = testing::make_image(specs, rng);
  testing::write_file(path, image.bytes());
  return image;
}

void expect_bytes_of(const StateDict& sd, const std::vector<char>& file, const FileImage& image) {
  const auto layouts = layout_of(image);
  ASSERT_EQ(sd.size(), layouts.size());
  for (const auto& l : layouts) expect_tensor_bytes(sd.at(l.name), file, image, l);
}

LoadOptions zero_copy_options(ZeroCopy z) {
  LoadOptions o;
  o.zero_copy = z;
  o.threads = 2;
  return o;
}

// A child process that runs `action` and exits; returns its pid.
template <class F>
pid_t spawn(F action) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    action();
    ::_exit(0);
  }
  return pid;
}

// Waits for `pid` for up to `timeout`; true if it exited with status 0.
bool reap(pid_t pid, std::chrono::seconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (std::chrono::steady_clock::now() < end) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) && WEXITSTATUS(status) == 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return false;
}

TEST(ZeroCopy, HandsOutTheFilesBytesWithoutThePool) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  const FileImage image = write_big(path, 5, 300000);
  Loader loader(zero_copy_options(ZeroCopy::kOn));
  LoadHandle h = loader.load_async({path});
  const StateDict sd = h.wait();
  EXPECT_EQ(h.progress().files_zero_copy, 1u);
  EXPECT_EQ(h.progress().bytes_done, h.progress().bytes_total);
  EXPECT_EQ(loader.pool()->stats().in_use_bytes, 0u);  // no pool memory
  expect_bytes_of(sd, slurp(path), image);
}

TEST(ZeroCopy, OffReadsIntoThePool) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  const FileImage image = write_big(path, 3, 100000);
  Loader loader(zero_copy_options(ZeroCopy::kOff));
  LoadHandle h = loader.load_async({path});
  const StateDict sd = h.wait();
  EXPECT_EQ(h.progress().files_zero_copy, 0u);
  EXPECT_GT(loader.pool()->stats().in_use_bytes, 0u);
  expect_bytes_of(sd, slurp(path), image);
}

// kAuto: a resident file maps while the pool has nothing to spare; once the
// pool holds idle memory enough for it, the load reads into that (the
// pool-kept case stays as it was).
TEST(ZeroCopy, AutoMapsOnlyWhenThePoolWouldNeedFreshMemory) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  const FileImage image = write_big(path, 4, 200000);  // just written: in the page cache
  const std::vector<char> file = slurp(path);
  Loader loader(zero_copy_options(ZeroCopy::kAuto));
  {
    LoadHandle h = loader.load_async({path});
    expect_bytes_of(h.wait(), file, image);
    EXPECT_EQ(h.progress().files_zero_copy, 1u);
  }
  {
    LoadOptions off = zero_copy_options(ZeroCopy::kOff);
    Loader reader(off, loader.pool());
    expect_bytes_of(reader.load({path}), file, image);  // leaves its block idle in the pool
  }
  LoadHandle h = loader.load_async({path});
  expect_bytes_of(h.wait(), file, image);
  EXPECT_EQ(h.progress().files_zero_copy, 0u);
}

// Resident kilobytes of the mappings of `path` in this process (/proc/self/smaps).
std::uint64_t resident_kib_of_mappings(const std::string& path) {
  std::ifstream in("/proc/self/smaps");
  std::uint64_t kib = 0;
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') != std::string::npos &&
        line.find(' ') < line.find(':')) {
      inside = line.size() >= path.size() && line.compare(line.size() - path.size(), path.size(), path) == 0;
    } else if (inside && line.rfind("Rss:", 0) == 0) {
      kib += std::stoull(line.substr(4));
    }
  }
  return kib;
}

// kAuto hands out a load, not a lazy map: before any tensor is touched,
// every data byte of the mapped file is in this process's page tables.
TEST(ZeroCopy, AutoLeavesEveryMappedByteResident) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  const FileImage image = write_big(path, 8, 1 << 20);  // 8 MiB, just written: in the page cache
  Loader loader(zero_copy_options(ZeroCopy::kAuto));
  LoadHandle h = loader.load_async({path});
  const StateDict sd = h.wait();
  ASSERT_EQ(h.progress().files_zero_copy, 1u);
  const std::uint64_t data_kib = image.data.size() / 1024;
  EXPECT_GE(resident_kib_of_mappings(path), data_kib);
  expect_bytes_of(sd, slurp(path), image);
}

// Note [One read ahead per range]: each range of a mapping is advised
// (MADV_WILLNEED, one request for the whole range) before it is faulted in.
class ReadAheadEnv : public EnvWrapper {
 public:
  using EnvWrapper::EnvWrapper;
  int advise(void* address, std::size_t bytes, int advice) override {
    if (advice == MADV_WILLNEED) {
      std::lock_guard lock(mu);
      advised.emplace_back(static_cast<const void*>(address), bytes);
    }
    return EnvWrapper::advise(address, bytes, advice);
  }
  int populate_read(const void* address, std::size_t bytes) override {
    {
      std::lock_guard lock(mu);
      const bool ahead = std::find(advised.begin(), advised.end(), std::make_pair(address, bytes)) != advised.end();
      populated_after_advice += ahead;
      ++populated;
    }
    return EnvWrapper::populate_read(address, bytes);
  }
  std::mutex mu;
  std::vector<std::pair<const void*, std::size_t>> advised;
  std::size_t populated = 0;
  std::size_t populated_after_advice = 0;
};

TEST(ZeroCopy, EachPopulatedRangeIsReadAheadFirst) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  const FileImage image = write_big(path, 8, 3 << 20);  // 24 MiB: three 8 MiB ranges and a tail
  ReadAheadEnv env(default_env());
  LoadOptions options = zero_copy_options(ZeroCopy::kOn);
  options.block_size = 8 << 20;
  Loader loader(options, nullptr, &env);
  const StateDict sd = loader.load({path});
  EXPECT_GE(env.populated, 4u);
  EXPECT_EQ(env.populated_after_advice, env.populated);
  expect_bytes_of(sd, slurp(path), image);
}

// Several files, some mapped and some not: one state dict in file order.
TEST(ZeroCopy, MixesMappedAndReadFiles) {
  TempDir dir;
  std::mt19937_64 rng(3);
  const std::string a = dir.file("a.safetensors"), b = dir.file("b.safetensors");
  const FileImage ia = testing::write_random_checkpoint(a, rng, 20, 4096, "a.");
  const FileImage ib = testing::write_random_checkpoint(b, rng, 20, 4096, "b.");
  const int writer = ::open(b.c_str(), O_WRONLY);  // no lease on b while it is open for writing
  ASSERT_GE(writer, 0);
  Loader loader(zero_copy_options(ZeroCopy::kOn));
  LoadHandle h = loader.load_async({a, b});
  const StateDict sd = h.wait();
  ::close(writer);
  EXPECT_EQ(h.progress().files_zero_copy, 1u);
  testing::expect_matches_file(sd, a, ia);
  testing::expect_matches_file(sd, b, ib);
  const auto la = layout_of(ia);
  ASSERT_EQ(sd.size(), la.size() + layout_of(ib).size());
  EXPECT_EQ(sd[0].name(), la[0].name);  // a's tensors first, as the paths were given
}

// Another process truncates the file while the tensors are held: its
// truncate(2) waits until they have been moved out, the holder does not die,
// and the tensors keep the bytes they loaded.
TEST(ZeroCopy, TruncationAfterTheLoadKeepsTheLoadedBytes) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  const FileImage image = write_big(path, 6, 1 << 20);
  const std::vector<char> original = slurp(path);
  Loader loader(zero_copy_options(ZeroCopy::kOn));
  LoadHandle h = loader.load_async({path});
  const StateDict sd = h.wait();
  ASSERT_EQ(h.progress().files_zero_copy, 1u);
  const pid_t child = spawn([&] {
    if (::truncate(path.c_str(), 0) != 0) ::_exit(1);
  });
  ASSERT_TRUE(reap(child, std::chrono::seconds(30))) << "the truncating process did not proceed";
  EXPECT_EQ(std::filesystem::file_size(path), 0u);
  expect_bytes_of(sd, original, image);  // touching every byte: no SIGBUS
}

// A writer that replaces the contents in place (open O_TRUNC, write other
// bytes) gets through, and the tensors keep the old version's bytes.
TEST(ZeroCopy, RewriteInPlaceKeepsTheLoadedVersion) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  const FileImage image = write_big(path, 4, 1 << 20);
  const std::vector<char> original = slurp(path);
  Loader loader(zero_copy_options(ZeroCopy::kOn));
  const StateDict sd = loader.load({path});
  const pid_t child = spawn([&] {
    const int fd = ::open(path.c_str(), O_WRONLY | O_TRUNC);
    if (fd < 0) ::_exit(1);
    std::vector<char> junk(original.size(), 'x');
    if (::write(fd, junk.data(), junk.size()) != static_cast<ssize_t>(junk.size())) ::_exit(2);
    ::close(fd);
  });
  ASSERT_TRUE(reap(child, std::chrono::seconds(30)));
  EXPECT_EQ(slurp(path)[100], 'x');
  expect_bytes_of(sd, original, image);
}

// A truncating process racing the load itself: the load either returns the
// version it read (mapped or read) or fails with a pinload::Error; the
// process never dies.
TEST(ZeroCopy, TruncationDuringTheLoadNeverCrashes) {
  for (int round = 0; round < 4; ++round) {
    TempDir dir;
    const std::string path = dir.file("a.safetensors");
    const FileImage image = write_big(path, 8, 2 << 20, 11 + static_cast<std::uint64_t>(round));
    const std::vector<char> original = slurp(path);
    const pid_t child = spawn([&] {
      ::usleep(static_cast<useconds_t>(round * 2000));
      if (::truncate(path.c_str(), 4096) != 0) ::_exit(1);
    });
    try {
      Loader loader(zero_copy_options(ZeroCopy::kOn));
      const StateDict sd = loader.load({path});
      expect_bytes_of(sd, original, image);
    } catch (const Error& e) {
      SUCCEED() << "typed failure: " << e.what();
    }
    EXPECT_TRUE(reap(child, std::chrono::seconds(30)));
  }
}

// In-place writes to a tensor stay private: the file keeps its bytes.
TEST(ZeroCopy, WritesToATensorNeverReachTheFile) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  write_big(path, 2, 100000);
  const std::vector<char> before = slurp(path);
  Loader loader(zero_copy_options(ZeroCopy::kOn));
  const StateDict sd = loader.load({path});
  std::byte* p = const_cast<std::byte*>(sd[0].data());
  p[0] = std::byte{0x5a};
  p[1] = std::byte{0xa5};
  EXPECT_EQ(sd[0].data()[0], std::byte{0x5a});
  EXPECT_EQ(slurp(path), before);
}

// The mapping, its fd, the lease and the watcher thread live exactly as long
// as a tensor does.
TEST(ZeroCopy, LeavesNoFdMappingOrThreadBehind) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  const FileImage image = write_big(path, 3, 500000);
  const std::vector<char> file = slurp(path);
  Loader loader(zero_copy_options(ZeroCopy::kOn));
  {
    const StateDict warmup = loader.load({path});  // the loader's own first-use state
  }
  const std::size_t fds = count_entries("/proc/self/fd");
  // Mappings of the file: the process's other mappings move under a sanitizer's allocator.
  const std::size_t maps = count_lines("/proc/self/maps", path);
  const std::size_t threads = count_entries("/proc/self/task");
  Tensor kept = [&] {
    const StateDict sd = loader.load({path});
    EXPECT_EQ(detail::LeasedMapping::live_count(), 1u);
    EXPECT_TRUE(detail::LeasedMapping::watcher_running());
    return sd[1];
  }();
  // One tensor alone keeps the mapping.
  expect_tensor_bytes(kept, file, image, layout_of(image)[1]);
  EXPECT_EQ(detail::LeasedMapping::live_count(), 1u);
  kept = Tensor("x", DType::kU8, {}, std::shared_ptr<Block>(), 0, 0);
  EXPECT_EQ(detail::LeasedMapping::live_count(), 0u);
  EXPECT_FALSE(detail::LeasedMapping::watcher_running());
  EXPECT_EQ(count_entries("/proc/self/fd"), fds);
  EXPECT_EQ(count_lines("/proc/self/maps", path), maps);
  // A leak leaves more threads; a thread of the baseline may have ended since (a clean-clone run saw 3 of 4).
  EXPECT_LE(count_entries("/proc/self/task"), threads);
}

// A moved mapping (as after a lease break) keeps its address and bytes and
// has given its file up: a writer no longer waits.
TEST(ZeroCopy, MoveOutKeepsAddressesAndReleasesTheFile) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  const FileImage image = write_big(path, 3, 400000);
  const std::vector<char> file = slurp(path);
  FileStat st;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_EQ(default_env()->stat(fd, &st), 0);
  ::close(fd);
  std::string why;
  auto m = detail::LeasedMapping::open(default_env(), path, FileIdentity::of(st), &why);
  ASSERT_TRUE(m) << why;
  const std::byte* before = m->data();
  m->move_out();
  EXPECT_TRUE(m->moved());
  EXPECT_EQ(m->data(), before);
  const int w = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);  // would be EWOULDBLOCK under a lease
  EXPECT_GE(w, 0);
  if (w >= 0) ::close(w);
  EXPECT_EQ(std::memcmp(m->data(), file.data(), file.size()), 0);
}

}  // namespace
}  // namespace pinload
