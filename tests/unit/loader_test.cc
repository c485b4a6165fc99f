// Tests of the parallel loader (pinload/loader.h): every tensor it returns is
// compared byte for byte with what a plain std::ifstream reads at the offsets
// of the test's own header.
#include "pinload/loader.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <thread>
#include <tuple>

#include "fault_env.h"
#include "pinload/error.h"
#include "pinload/io_template.h"
#include "file_check.h"
#include "test_files.h"

namespace pinload {
namespace {

namespace fs = std::filesystem;
using testing::direct_io_works;
using testing::FaultEnv;
using testing::FileImage;
using testing::Layout;
using testing::expect_matches_file;
using testing::layout_of;
using testing::expect_tensor_bytes;
using testing::find_layout;
using testing::slurp;
using testing::TempDir;
using testing::TensorSpec;

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

// ---- checkpoints ----

// Odd sizes and an odd data offset: unaligned tensors, tensors straddling
// 4 KiB .. 2 MiB blocks, a zero-size tensor, a scalar and a partial last block.
FileImage write_odd_checkpoint(const std::string& path) {
  const std::vector<TensorSpec> specs = {
      {"a", "U8", {1}},         {"b", "U8", {4095}},      {"c", "F32", {1025}},
      {"d", "BF16", {6151}},    {"empty", "F32", {0, 3}}, {"e", "U8", {70'001}},
      {"f", "F16", {3, 5, 7}},  {"g", "U8", {2, 1'048'583}},  // 2 MiB + 14: straddles every block size
      {"h", "I64", {333}},      {"scalar", "F64", {}},    {"i", "U8", {12'289}}};
  for (std::string pad;; pad += "x") {  // pad the metadata until the data offset is odd
    std::mt19937_64 rng(1);
    FileImage image = testing::make_image(specs, rng, 1, "{\"format\":\"pt\",\"pad\":\"" + pad + "\"}");
    if ((8 + image.header_json.size()) % 2 == 1) {
      testing::write_file(path, image.bytes());
      return image;
    }
  }
}

// One odd checkpoint for the whole binary (building it is slow under
// sanitizers); removed at exit. Tests must not modify it.
struct OddModel {
  TempDir dir;
  std::string path = dir.file("model.safetensors");
  FileImage image = write_odd_checkpoint(path);
};
const OddModel& odd_model() {
  static const OddModel model;
  return model;
}

// A small shard of `count` tensors named "<stem>.<i>" of about `bytes` each.
FileImage write_shard(const std::string& path, const std::string& stem, int count, std::uint64_t bytes,
                      std::uint64_t seed, const std::string& metadata = "") {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < count; ++i) specs.push_back({stem + "." + std::to_string(i), "U8", {bytes + i * 13}});
  std::mt19937_64 rng(seed);
  FileImage image = testing::make_image(specs, rng, 1, metadata);
  testing::write_file(path, image.bytes());
  return image;
}

// kAuto reads a freshly written (cached) file buffered; kAutoCold makes it try
// O_DIRECT as it would on a cold file.
// kOff copies cached files from a mapping (Note [Mapped reads]); kOffPread
// preads them.
enum class Mode { kOn, kOff, kOffPread, kAuto, kAutoCold };

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kOn: return "On";
    case Mode::kOff: return "Off";
    case Mode::kOffPread: return "OffPread";
    case Mode::kAuto: return "Auto";
    case Mode::kAutoCold: return "AutoCold";
  }
  return "?";
}

LoadOptions load_options(unsigned threads, std::size_t block_size, Mode mode, std::size_t files_in_flight = 2) {
  LoadOptions o;
  o.threads = threads;
  o.block_size = block_size;
  o.files_in_flight = files_in_flight;
  o.direct = mode == Mode::kOn                                ? DirectIo::kOn
             : mode == Mode::kOff || mode == Mode::kOffPread ? DirectIo::kOff
                                                             : DirectIo::kAuto;
  if (mode == Mode::kOffPread) o.cached_read = CachedRead::kPread;
  if (mode == Mode::kAutoCold) o.resident_threshold = 2.0;
  o.zero_copy = ZeroCopy::kOff;  // the read paths; zero-copy loads have zero_copy_test and the fault tests
  return o;
}

bool wants_direct(Mode m) { return m == Mode::kOn || m == Mode::kAutoCold; }

class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::thread([] {}).join();  // sanitizers start a helper thread on the first one
    baseline_threads_ = testing::stable_thread_count();
  }
  void TearDown() override {
    EXPECT_EQ(env_.open_fds(), 0);
    EXPECT_EQ(testing::settled_thread_count(baseline_threads_), baseline_threads_);
  }
  std::shared_ptr<Pool> make_pool() { return Pool::create(make_locked_memory_backend(&env_)); }

  TempDir dir_;
  FaultEnv env_;  // no faults: counts descriptors and O_DIRECT opens
  int baseline_threads_ = 0;
};

// ---- byte-exact across threads, block sizes and I/O modes ----

using MatrixParam = std::tuple<unsigned, std::size_t, Mode>;

class LoaderMatrixTest : public LoaderTest, public ::testing::WithParamInterface<MatrixParam> {};

TEST_P(LoaderMatrixTest, TensorsMatchTheFileByteForByte) {
  const auto [threads, block, mode] = GetParam();
  const std::string& path = odd_model().path;
  const FileImage& image = odd_model().image;
  ASSERT_EQ((8 + image.header_json.size()) % 2, 1u);
  const bool direct_ok = direct_io_works(path);
  if (mode == Mode::kOn && !direct_ok) GTEST_SKIP() << path << ": O_DIRECT refused here";

  Loader loader(load_options(threads, block, mode), make_pool(), &env_);
  const StateDict sd = loader.load({path});
  EXPECT_EQ(sd.size(), layout_of(image).size());
  expect_matches_file(sd, path, image);
  EXPECT_EQ(sd.total_bytes(), image.data.size());
  EXPECT_EQ(sd.at("scalar").shape().size(), 0u);
  EXPECT_EQ(sd.at("f").shape(), (std::vector<std::uint64_t>{3, 5, 7}));
  EXPECT_EQ(sd.at("c").dtype(), DType::kF32);
  if (mode == Mode::kOff || mode == Mode::kOffPread || mode == Mode::kAuto) {
    EXPECT_EQ(env_.direct_opens(), 0u);
  }
  // The file was just written, so it is in the page cache: copied from a
  // mapping unless told to pread.
  EXPECT_EQ(env_.populates() > 0, mode == Mode::kOff || mode == Mode::kAuto) << mode_name(mode);
  EXPECT_EQ(env_.file_mapped_bytes(), 0);
  if (wants_direct(mode) && direct_ok) {
    EXPECT_EQ(env_.direct_opens(), 1u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, LoaderMatrixTest,
    ::testing::Combine(::testing::Values(1u, 2u, 8u), ::testing::Values(4 * KiB, 12 * KiB, 64 * KiB, 2 * MiB),
                       ::testing::Values(Mode::kOn, Mode::kOff, Mode::kOffPread, Mode::kAuto, Mode::kAutoCold)),
    [](const ::testing::TestParamInfo<MatrixParam>& p) {
      return "t" + std::to_string(std::get<0>(p.param)) + "_b" + std::to_string(std::get<1>(p.param) / KiB) +
             "k_" + mode_name(std::get<2>(p.param));
    });

TEST_F(LoaderTest, RandomCheckpointsOfEveryDtype) {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    const std::string path = dir_.file("random" + std::to_string(seed) + ".safetensors");
    std::mt19937_64 rng(seed);
    const FileImage image = testing::write_random_checkpoint(path, rng, 40);
    const Mode mode = seed % 3 == 0 ? Mode::kAutoCold : seed % 3 == 1 ? Mode::kOff : Mode::kOffPread;
    Loader loader(load_options(8, 4 * KiB, mode), make_pool(), &env_);
    const StateDict sd = loader.load({path});
    EXPECT_EQ(sd.size(), 40u);
    expect_matches_file(sd, path, image);
  }
}

// A missing tensor's NotFoundError names the file (one file) or every file loaded (several),
// through the read path, a zero-copy load, an async load and a copy of the state dict.
TEST_F(LoaderTest, MissingTensorNamesTheFiles) {
  const std::string one = dir_.file("one.safetensors");
  const std::string two = dir_.file("two.safetensors");
  write_shard(one, "a", 2, 100, 1);
  write_shard(two, "b", 2, 100, 2);
  auto message_of = [](const StateDict& sd) -> std::string {
    try {
      sd.at("nope");
    } catch (const NotFoundError& e) {
      EXPECT_EQ(e.context().tensor, "nope");
      return e.what();
    }
    ADD_FAILURE() << "no NotFoundError";
    return {};
  };
  for (const ZeroCopy zero_copy : {ZeroCopy::kOff, ZeroCopy::kOn}) {
    LoadOptions options = load_options(2, 64 * KiB, Mode::kOff);
    options.zero_copy = zero_copy;
    Loader loader(options, make_pool(), &env_);
    const StateDict sd = loader.load({one});
    EXPECT_EQ(message_of(sd), one + ": tensor 'nope': no such tensor in the file");
    EXPECT_EQ(message_of(StateDict(sd)), one + ": tensor 'nope': no such tensor in the file");
    const StateDict both = loader.load_async({one, two}).wait();
    EXPECT_EQ(both.files(), (std::vector<std::string>{one, two}));
    EXPECT_EQ(message_of(both), "tensor 'nope': no such tensor in the 2 files loaded (" + one + ", " + two + ")");
  }
  EXPECT_EQ(message_of(StateDict()), "tensor 'nope': no such tensor in the state dict");  // built by hand
}

TEST_F(LoaderTest, AsyncLoadReportsProgress) {
  const std::string& path = odd_model().path;
  const FileImage& image = odd_model().image;
  for (Mode mode : {Mode::kOff, Mode::kOn}) {
    if (mode == Mode::kOn && !direct_io_works(path)) continue;
    Loader loader(load_options(4, 64 * KiB, mode), make_pool(), &env_);
    LoadHandle handle = loader.load_async({path});
    const StateDict sd = handle.wait();
    EXPECT_TRUE(handle.done());
    expect_matches_file(sd, path, image);
    const LoadProgress p = handle.progress();
    EXPECT_EQ(p.bytes_done, p.bytes_total);
    EXPECT_GE(p.bytes_total, image.data.size());
    EXPECT_EQ(p.files_direct, mode == Mode::kOn ? 1u : 0u);
    EXPECT_EQ(p.files_buffered, mode == Mode::kOn ? 0u : 1u);
    EXPECT_EQ(p.files_mapped, mode == Mode::kOn ? 0u : 1u);  // written just now: in the page cache
  }
}

TEST_F(LoaderTest, AsyncLoadOutlivesTheLoader) {
  const std::string& path = odd_model().path;
  const FileImage& image = odd_model().image;
  std::optional<LoadHandle> handle;
  {
    Loader loader(load_options(2, 4 * KiB, Mode::kOff), make_pool(), &env_);
    handle.emplace(loader.load_async({path}));
  }
  expect_matches_file(handle->wait(), path, image);
}

// ---- tensors handed out as they arrive (Note [Ready tensors]) ----

// Holds every pread that reaches the end of a file until release(), or until
// a timeout that the test then reports as a failure.
class HoldLastChunkEnv : public EnvWrapper {
 public:
  HoldLastChunkEnv(Env* target, std::uint64_t file_size) : EnvWrapper(target), file_size_(file_size) {}
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    if (offset + bytes >= file_size_) {
      std::unique_lock lock(mu_);
      if (!cv_.wait_for(lock, std::chrono::seconds(30), [&] { return released_; })) timed_out_ = true;
    }
    return EnvWrapper::pread(fd, buffer, bytes, offset);
  }
  void release() {
    {
      std::lock_guard lock(mu_);
      released_ = true;
    }
    cv_.notify_all();
  }
  bool timed_out() {
    std::lock_guard lock(mu_);
    return timed_out_;
  }

 private:
  const std::uint64_t file_size_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
  bool timed_out_ = false;
};

TEST_F(LoaderTest, TensorsAreHandedOutBeforeTheLoadEnds) {
  const std::string& path = odd_model().path;
  const FileImage& image = odd_model().image;
  const std::vector<char> file = slurp(path);
  HoldLastChunkEnv hold(&env_, file.size());
  Loader loader(load_options(1, 4 * KiB, Mode::kOffPread), make_pool(), &hold);  // held at its pread
  LoadHandle handle = loader.load_async({path});
  // The last chunk is held back, so these tensors arrived while the load ran.
  const std::vector<Tensor> first = handle.next_ready();
  EXPECT_FALSE(handle.done());
  hold.release();
  ASSERT_FALSE(first.empty());
  EXPECT_EQ(first.front().name(), "a");
  std::set<std::string> names;
  for (const Tensor& t : first) names.insert(t.name());
  EXPECT_FALSE(names.count("i")) << "the last tensor's bytes were not read yet";
  for (std::vector<Tensor> more = handle.next_ready(); !more.empty(); more = handle.next_ready()) {
    for (const Tensor& t : more) {
      EXPECT_TRUE(names.insert(t.name()).second) << t.name() << " handed out twice";
      expect_tensor_bytes(t, file, image, find_layout(image, t.name()));
    }
  }
  for (const Tensor& t : first) expect_tensor_bytes(t, file, image, find_layout(image, t.name()));
  EXPECT_EQ(names.size(), layout_of(image).size());
  EXPECT_FALSE(hold.timed_out());
  EXPECT_EQ(handle.wait().size(), layout_of(image).size());  // the whole state dict as well
}

TEST_F(LoaderTest, EveryTensorOfEveryShardIsHandedOutOnce) {
  std::vector<std::string> paths;
  std::vector<FileImage> images;
  for (int i = 0; i < 4; ++i) {
    paths.push_back(dir_.file("ready" + std::to_string(i) + ".safetensors"));
    images.push_back(write_shard(paths.back(), "r" + std::to_string(i), 3 + 5 * i, 9 * KiB + 7 * i, 300 + i));
  }
  for (const Mode mode : {Mode::kOff, Mode::kAutoCold}) {
    Loader loader(load_options(8, 4 * KiB, mode, 3), make_pool(), &env_);
    LoadHandle handle = loader.load_async(paths);
    std::vector<Tensor> all;
    for (std::vector<Tensor> more = handle.next_ready(); !more.empty(); more = handle.next_ready()) {
      for (Tensor& t : more) all.push_back(std::move(t));
    }
    const StateDict got(std::move(all));  // throws on a name handed out twice
    for (std::size_t i = 0; i < paths.size(); ++i) expect_matches_file(got, paths[i], images[i]);
    EXPECT_EQ(got.size(), 3u + 8 + 13 + 18);
  }
}

TEST_F(LoaderTest, FailedLoadStopsHandingOutAndThrows) {
  const std::string& path = odd_model().path;
  FaultEnv failing(testing::Faults{.fail_read_at = 40}, &env_);
  Loader loader(load_options(2, 4 * KiB, Mode::kOffPread), make_pool(), &failing);
  LoadHandle handle = loader.load_async({path});
  std::size_t handed_out = 0;
  try {
    for (std::vector<Tensor> more = handle.next_ready(); !more.empty(); more = handle.next_ready()) {
      handed_out += more.size();
    }
    ADD_FAILURE() << "next_ready() ended without the read error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.context().file, path);
  }
  EXPECT_LT(handed_out, layout_of(odd_model().image).size());
  EXPECT_THROW(handle.wait(), IoError);
}

// A filesystem whose direct I/O needs memory aligned beyond a page.
class WideDioAlignEnv : public EnvWrapper {
 public:
  using EnvWrapper::EnvWrapper;
  int stat(int fd, FileStat* out) override {
    const int rc = EnvWrapper::stat(fd, out);
    out->dio_mem_align = 8192;
    out->dio_offset_align = 512;
    return rc;
  }
};

TEST_F(LoaderTest, MemoryAlignmentAbovePageSizeReadsBuffered) {
  const std::string& path = odd_model().path;
  WideDioAlignEnv wide(&env_);
  Loader automatic(load_options(4, 64 * KiB, Mode::kAutoCold), make_pool(), &wide);
  expect_matches_file(automatic.load({path}), path, odd_model().image);
  EXPECT_EQ(env_.direct_opens(), 0u);
  Loader forced(load_options(4, 64 * KiB, Mode::kOn), make_pool(), &wide);
  try {
    (void)forced.load({path});
    ADD_FAILURE() << "direct I/O was forced where it cannot work";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("8192-byte aligned memory"), std::string::npos) << e.what();
    EXPECT_EQ(e.context().file, path);
  }
}

// Note [Locking host pools]: host-only pools are THP-backed and not locked.
TEST_F(LoaderTest, HostOnlyPoolsAreNotLocked) {
  Loader loader(load_options(2, 64 * KiB, Mode::kOff), nullptr, &env_);
  const StateDict sd = loader.load({odd_model().path});
  expect_matches_file(sd, odd_model().path, odd_model().image);
  EXPECT_EQ(loader.pool()->backend_name(), "host");
  for (const Tensor& t : sd) EXPECT_FALSE(t.block()->locked()) << t.name();
  EXPECT_EQ(Pool::create_default()->backend_name(), "host");
  EXPECT_EQ(Pool::create(make_locked_memory_backend(&env_))->backend_name(), "locked-host");
}

TEST_F(LoaderTest, FileWithoutTensors) {
  const std::string path = dir_.file("empty.safetensors");
  std::mt19937_64 rng(1);
  testing::write_file(path, testing::make_image({}, rng, 8).bytes());
  for (Mode mode : {Mode::kOff, Mode::kAutoCold}) {
    Loader loader(load_options(4, 4 * KiB, mode), make_pool(), &env_);
    EXPECT_TRUE(loader.load({path}).empty());
  }
}

// ---- several files ----

class LoaderShardsTest : public LoaderTest, public ::testing::WithParamInterface<std::size_t> {};

TEST_P(LoaderShardsTest, SeveralShardsAtOnce) {
  struct Shard {
    std::string path;
    FileImage image;
  };
  std::vector<Shard> shards;
  const std::uint64_t sizes[] = {3, 100 * KiB + 1, 400 * KiB + 77, 30 * KiB, 5};  // per tensor
  for (int i = 0; i < 5; ++i) {
    const std::string path = dir_.file("shard" + std::to_string(i) + ".safetensors");
    shards.push_back({path, write_shard(path, "s" + std::to_string(i), 1 + i, sizes[i], 100 + i)});
  }
  std::vector<std::string> paths;
  for (const Shard& s : shards) paths.push_back(s.path);

  Loader loader(load_options(4, 64 * KiB, Mode::kAutoCold, GetParam()), make_pool(), &env_);
  const StateDict sd = loader.load(paths);
  EXPECT_EQ(sd.size(), 1u + 2 + 3 + 4 + 5);
  for (const Shard& s : shards) expect_matches_file(sd, s.path, s.image);
  if (direct_io_works(paths[0])) {
    EXPECT_EQ(env_.direct_opens(), 5u);
  }
  EXPECT_EQ(loader.pool()->stats().live_blocks, 5u);  // one block per file
}

INSTANTIATE_TEST_SUITE_P(FilesInFlight, LoaderShardsTest, ::testing::Values(1u, 3u));

TEST_F(LoaderTest, ShardedIndexAndItsFolder) {
  const fs::path model = dir_.path() / "model";
  fs::create_directory(model);
  std::vector<std::pair<std::string, FileImage>> shards;
  std::string weight_map;
  for (int i = 1; i <= 3; ++i) {
    const std::string name = "model-0000" + std::to_string(i) + "-of-00003.safetensors";
    const std::string path = (model / name).string();
    FileImage image = write_shard(path, "layer" + std::to_string(i), 4, 20'000 * i + 1, i,
                                  "{\"format\":\"pt\",\"shard\":\"" + std::to_string(i) + "\"}");
    for (const Layout& t : layout_of(image)) {
      weight_map += std::string(weight_map.empty() ? "" : ",") + "\"" + t.name + "\":\"" + name + "\"";
    }
    shards.emplace_back(path, std::move(image));
  }
  const std::string index = (model / "model.safetensors.index.json").string();
  std::ofstream(index) << "{\"metadata\":{\"total_size\":1},\"weight_map\":{" << weight_map << "}}";

  Loader loader(load_options(8, 12 * KiB, Mode::kAutoCold, 3), make_pool(), &env_);
  for (const std::string& path : {index, model.string()}) {
    SCOPED_TRACE(path);
    const StateDict sd = loader.load({path});
    EXPECT_EQ(sd.size(), 12u);
    for (const auto& [shard, image] : shards) expect_matches_file(sd, shard, image);
    // Metadata is merged; the first shard wins a key.
    const auto& md = sd.metadata();
    auto it = std::find_if(md.begin(), md.end(), [](const auto& kv) { return kv.first == "shard"; });
    ASSERT_NE(it, md.end());
    EXPECT_EQ(it->second, "1");
  }
}

// ---- tmpfs, where older kernels refuse O_DIRECT ----

class ShmDir {
 public:
  ShmDir() {
    std::string templ = "/dev/shm/pinload-test-XXXXXX";
    if (::mkdtemp(templ.data()) != nullptr) path_ = templ;
  }
  ~ShmDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  bool ok() const { return !path_.empty(); }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

TEST_F(LoaderTest, TmpfsFallsBackToBufferedReads) {
  ShmDir shm;
  if (!shm.ok()) GTEST_SKIP() << "no /dev/shm";
  const std::string path = shm.file("model.safetensors");
  const FileImage image = write_odd_checkpoint(path);
  const int probe = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  const bool refused = probe < 0;
  if (!refused) ::close(probe);

  {
    Loader loader(load_options(4, 64 * KiB, Mode::kAutoCold), make_pool(), &env_);
    LoadHandle handle = loader.load_async({path});
    expect_matches_file(handle.wait(), path, image);
    if (refused) {
      EXPECT_EQ(env_.direct_opens(), 0u);
      EXPECT_EQ(handle.progress().files_buffered, 1u);
    }
  }
  Loader strict(load_options(4, 64 * KiB, Mode::kOn), make_pool(), &env_);
  if (refused) {
    try {
      strict.load({path});
      FAIL() << "kOn on tmpfs must throw";
    } catch (const IoError& e) {
      EXPECT_EQ(e.context().file, path);
    }
  } else {
    expect_matches_file(strict.load({path}), path, image);
    GTEST_SKIP() << "this kernel's tmpfs accepts O_DIRECT; fault_injection_test covers refusal";
  }
}

// ---- lifetimes and reuse ----

TEST_F(LoaderTest, TensorsOutliveTheStateDictAndTheLoader) {
  const std::string& path = odd_model().path;
  const FileImage& image = odd_model().image;
  auto pool = make_pool();
  std::optional<Tensor> kept;
  {
    Loader loader(load_options(4, 64 * KiB, Mode::kAutoCold), pool, &env_);
    StateDict sd = loader.load({path});
    StateDict copy = sd;
    kept = copy.at("g");
    sd = StateDict();
  }
  EXPECT_EQ(pool->stats().live_blocks, 1u);
  expect_tensor_bytes(*kept, slurp(path), image, find_layout(image, "g"));
  kept.reset();
  const PoolStats s = pool->stats();
  EXPECT_EQ(s.in_use_bytes, 0u);
  EXPECT_EQ(s.live_blocks, 0u);
}

TEST_F(LoaderTest, TensorsOutliveThePool) {
  const std::string& path = odd_model().path;
  const FileImage& image = odd_model().image;
  std::optional<Tensor> kept;
  {
    Loader loader(load_options(4, 64 * KiB, Mode::kOff), nullptr, &env_);  // a pool of its own
    kept = loader.load({path}).at("e");
  }
  EXPECT_GT(env_.mapped_bytes(), 0);
  expect_tensor_bytes(*kept, slurp(path), image, find_layout(image, "e"));
  kept.reset();
  EXPECT_EQ(env_.mapped_bytes(), 0);
}

TEST_F(LoaderTest, ReloadAfterUnloadMakesNoNewOsAllocation) {
  std::vector<std::string> paths;
  std::vector<FileImage> images;
  for (int i = 0; i < 3; ++i) {
    paths.push_back(dir_.file("shard" + std::to_string(i) + ".safetensors"));
    images.push_back(write_shard(paths.back(), "s" + std::to_string(i), 3, 50 * KiB * (i + 1), i));
  }
  paths.push_back(dir_.file("big.safetensors"));
  images.push_back(write_shard(paths.back(), "big", 2, 700 * KiB, 9));
  // Slabs of 4 MiB: the 1.4 MiB file gets a reservation of its own.
  auto pool = Pool::create(make_locked_memory_backend(&env_), PoolOptions{.slab_bytes = 4 * MiB});
  Loader loader(load_options(4, 256 * KiB, Mode::kAutoCold), pool, &env_);
  loader.load(paths);  // loaded, then unloaded
  const PoolStats before = pool->stats();
  EXPECT_EQ(before.in_use_bytes, 0u);
  const StateDict sd = loader.load(paths);
  const PoolStats after = pool->stats();
  EXPECT_EQ(after.os_reservations, before.os_reservations);
  EXPECT_EQ(after.reserved_bytes, before.reserved_bytes);
  EXPECT_EQ(after.free_list_hits, before.free_list_hits + paths.size());
  for (std::size_t i = 0; i < paths.size(); ++i) expect_matches_file(sd, paths[i], images[i]);
}

// A file read through the page cache and then with O_DIRECT takes the same
// block: 64 MiB of data sits exactly on a size class, where the direct read's
// aligned superset would otherwise need the next class.
TEST_F(LoaderTest, BufferedThenDirectReloadReusesTheBlock) {
  const std::string path = dir_.file("class_edge.safetensors");
  const std::string n = std::to_string(64 * MiB);
  testing::write_file(path, testing::raw_file("{\"w\":{\"dtype\":\"U8\",\"shape\":[" + n + "],\"data_offsets\":[0," + n +
                                                  "]}}",
                                              std::vector<std::uint8_t>(64 * MiB, 0x3c)));
  if (!direct_io_works(path)) GTEST_SKIP() << "O_DIRECT refused here";
  auto pool = Pool::create(make_locked_memory_backend(&env_));
  Loader buffered(load_options(2, 2 * MiB, Mode::kOff), pool, &env_);
  Loader direct(load_options(2, 2 * MiB, Mode::kOn), pool, &env_);
  buffered.load({path});
  const PoolStats before = pool->stats();
  const StateDict sd = direct.load({path});
  EXPECT_EQ(pool->stats().os_reservations, before.os_reservations);
  EXPECT_EQ(sd.at("w").bytes()[12345], std::byte{0x3c});
}

// Note [Tapered tail] in read_plan.h: a large load that reads direct reads
// its last 32 MiB in 1 MiB pieces, the 64 MiB before them in 2 MiB pieces and
// the 128 MiB before those (here, the rest) in 4 MiB pieces; one copied from
// the page cache keeps its 8 MiB chunks. The bytes are the file's either way.
TEST_F(LoaderTest, ALargeLoadEndsInSmallReadsWhereItReadsDirect) {
  const std::string path = dir_.file("large.safetensors");
  const std::uint64_t bytes = 136 * MiB;  // more than 4 x 32 MiB
  std::vector<std::uint8_t> data(bytes);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::uint8_t>(i * 2654435761u >> 13);
  const std::string n = std::to_string(bytes);
  testing::write_file(path, testing::raw_file("{\"w\":{\"dtype\":\"U8\",\"shape\":[" + n + "],\"data_offsets\":[0," + n +
                                                  "]}}", data));
  if (!direct_io_works(path)) GTEST_SKIP() << "O_DIRECT refused here";
  const std::uint64_t file_size = std::filesystem::file_size(path);
  struct Chunks {
    std::uint64_t largest = 0;
    std::uint64_t largest_in_the_last_32_mib = 0;
  };
  auto load_and_measure = [&](Mode mode) {
    LoadOptions options = load_options(2, 8 * MiB, mode);
    options.zero_copy = ZeroCopy::kOff;  // read it, never map it
    const Loader loader(options, make_pool(), &env_);
    IoTemplate record;
    const StateDict sd = loader.load({path}, LoadRequest{{}, nullptr, &record});
    EXPECT_EQ(std::memcmp(sd.at("w").bytes().data(), data.data(), bytes), 0);
    Chunks out;
    const TemplateReads* reads = record.find(loader.destination());
    EXPECT_NE(reads, nullptr);
    for (const TemplateRead& r : reads != nullptr ? reads->reads : std::vector<TemplateRead>{}) {
      out.largest = std::max(out.largest, r.length);
      if (r.offset + 32 * MiB >= file_size) out.largest_in_the_last_32_mib = std::max(out.largest_in_the_last_32_mib, r.length);
    }
    return out;
  };
  const Chunks direct = load_and_measure(Mode::kOn);
  EXPECT_EQ(direct.largest, 4 * MiB);
  EXPECT_EQ(direct.largest_in_the_last_32_mib, 1 * MiB);
  const Chunks cached = load_and_measure(Mode::kAuto);  // the file is in the page cache: copied from a mapping
  EXPECT_EQ(cached.largest, 8 * MiB);
  EXPECT_EQ(cached.largest_in_the_last_32_mib, 8 * MiB);
}

// Counts the preads running at once; each takes 20 ms, so that they overlap.
class InFlightEnv : public EnvWrapper {
 public:
  using EnvWrapper::EnvWrapper;
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    const unsigned now = ++in_flight_;
    for (unsigned most = most_.load(); now > most && !most_.compare_exchange_weak(most, now);) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const std::int64_t n = EnvWrapper::pread(fd, buffer, bytes, offset);
    --in_flight_;
    return n;
  }
  unsigned most() const { return most_.load(); }

 private:
  std::atomic<unsigned> in_flight_{0};
  std::atomic<unsigned> most_{0};
};

// Note [Direct reads in flight]: `threads` bounds the copies out of the page
// cache; direct reads keep more in flight.
TEST_F(LoaderTest, DirectReadsKeepMoreInFlightThanTheThreadsThatCopy) {
  const std::string path = dir_.file("depth.safetensors");
  const FileImage image = write_shard(path, "d", 6, 64 * KiB, 77);  // 6 tensors of 64 KiB: 96 chunks of 4 KiB
  if (!direct_io_works(path)) GTEST_SKIP() << "O_DIRECT refused here";
  {
    InFlightEnv counting(&env_);
    Loader loader(load_options(2, 4 * KiB, Mode::kOffPread), make_pool(), &counting);
    expect_matches_file(loader.load({path}), path, image);
    EXPECT_LE(counting.most(), 2u) << "buffered reads beyond `threads`";
  }
  {
    InFlightEnv counting(&env_);
    Loader loader(load_options(2, 4 * KiB, Mode::kOn), make_pool(), &counting);
    expect_matches_file(loader.load({path}), path, image);
    EXPECT_GT(counting.most(), 8u) << "direct reads held to `threads`";
    EXPECT_LE(counting.most(), kDirectReadsInFlight);
  }
}

}  // namespace
}  // namespace pinload
