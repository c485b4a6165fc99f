// The node store in one process: a daemon thread (serve_store) and loads
// through Loader with LoadOptions::store. Real processes: tests/store.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <thread>

#include "fault_env.h"
#include "file_check.h"
#include "pinload/device.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "pinload/store.h"
#include "store/wire.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::FaultEnv;
using testing::Faults;
using testing::TempDir;

// A daemon on a socket in its own folder, stopped on destruction.
class Daemon {
 public:
  explicit Daemon(const TempDir& dir, std::uint64_t budget = 1u << 30, Env* env = nullptr) {
    options_.socket = dir.file("store.sock");
    options_.budget_bytes = budget;
    options_.threads = 4;
    options_.env = env;
    options_.stop = &stop_;
    options_.on_ready = [](void* self) { static_cast<Daemon*>(self)->ready_ = true; };
    options_.on_ready_context = this;
    thread_ = std::thread([this] {
      try {
        serve_store(options_);
      } catch (const Error& e) {
        failure_ = e.what();
        ready_ = true;
      }
    });
    while (!ready_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~Daemon() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  const std::string& socket() const { return options_.socket; }
  const std::string& failure() const { return failure_; }

 private:
  StoreServerOptions options_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> ready_{false};
  std::string failure_;
  std::thread thread_;
};

// What an entry of a file of `bytes` takes of the budget: whole huge pages
// from 2 MiB up, whole 4 KiB pages below.
std::uint64_t charge_of(std::uint64_t bytes) {
  const std::uint64_t round = bytes >= (2u << 20) ? (2u << 20) : 4096;
  return (bytes + round - 1) / round * round;
}

LoadOptions with_store(const std::string& socket, bool required = false) {
  LoadOptions o;
  o.store.socket = socket;
  o.store.required = required;
  o.zero_copy = ZeroCopy::kOff;
  return o;
}

struct Model {
  std::string path;
  testing::FileImage image;
};

Model write_model(const TempDir& dir, const std::string& name, std::uint64_t seed, int count = 6,
                  std::uint64_t max_elements = 1u << 16) {
  std::mt19937_64 rng(seed);
  Model m{dir.file(name), {}};
  m.image = testing::write_random_checkpoint(m.path, rng, count, max_elements);
  return m;
}

// One float32 tensor of 4096 elements: every such file has the same size.
Model write_even_model(const TempDir& dir, const std::string& name, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Model m{dir.file(name), testing::make_image({{"w", "F32", {4096}}}, rng)};
  testing::write_file(m.path, m.image.bytes());
  return m;
}

// Loads `model` through the store; the counters say whether the store served it.
StateDict load_through(const std::string& socket, const Model& model, LoadProgress* progress = nullptr,
                       bool required = false) {
  Loader loader(with_store(socket, required));
  LoadHandle h = loader.load_async({model.path});
  StateDict sd = h.wait();
  if (progress != nullptr) *progress = h.progress();
  return sd;
}

TEST(StoreTest, ALoadMapsTheStoresCopyWithTheFilesBytes) {
  TempDir dir;
  Daemon daemon(dir);
  const Model m = write_model(dir, "a.safetensors", 1);
  LoadProgress p;
  {
    StateDict first = load_through(daemon.socket(), m, &p);
    testing::expect_matches_file(first, m.path, m.image);
    EXPECT_EQ(p.files_store, 1u);
    StateDict second = load_through(daemon.socket(), m, &p);
    testing::expect_matches_file(second, m.path, m.image);
    EXPECT_EQ(p.files_store, 1u);
    // Both are views of the one sealed copy, mapped twice.
    EXPECT_NE(first[0].data(), second[0].data());
  }
  const StoreStatus s = store_status(daemon.socket());
  EXPECT_EQ(s.reads, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.hits, 1u);
  ASSERT_EQ(s.entries.size(), 1u);
  EXPECT_EQ(s.entries[0].bytes, std::filesystem::file_size(m.path));
}

TEST(StoreTest, AClientsWritesStayItsOwn) {
  TempDir dir;
  Daemon daemon(dir);
  const Model m = write_model(dir, "a.safetensors", 2);
  StateDict writer = load_through(daemon.socket(), m);
  auto* bytes = const_cast<std::byte*>(writer[0].data());
  const std::byte before = bytes[0];
  bytes[0] = ~before;  // copy-on-write: only this process's page changes
  StateDict reader = load_through(daemon.socket(), m);
  EXPECT_EQ(reader[0].data()[0], before);
  testing::expect_matches_file(reader, m.path, m.image);
}

TEST(StoreTest, ConcurrentMissesOfOneFileReadItOnce) {
  TempDir dir;
  Faults slow;
  slow.read_delay_us = 20000;  // every read takes 20 ms: the misses overlap
  FaultEnv env(slow);
  Daemon daemon(dir, 1u << 30, &env);
  const Model m = write_model(dir, "a.safetensors", 3, 4, 1u << 20);
  std::vector<std::thread> clients;
  std::atomic<int> matched{0};
  for (int i = 0; i < 6; ++i) {
    clients.emplace_back([&] {
      LoadProgress p;
      StateDict sd = load_through(daemon.socket(), m, &p);
      if (p.files_store == 1) ++matched;
      testing::expect_matches_file(sd, m.path, m.image);
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(matched.load(), 6);
  const StoreStatus s = store_status(daemon.socket());
  EXPECT_EQ(s.reads, 1u);
  EXPECT_EQ(s.misses + s.hits, 6u);
}

TEST(StoreTest, UnheldEntriesAreEvictedLeastRecentlyUsedFirst) {
  TempDir dir;
  const Model a = write_even_model(dir, "a.safetensors", 4);
  const Model b = write_even_model(dir, "b.safetensors", 5);
  const Model c = write_even_model(dir, "c.safetensors", 6);
  Daemon daemon(dir, 2 * charge_of(std::filesystem::file_size(a.path)));  // room for two entries, not three
  (void)load_through(daemon.socket(), a);
  (void)load_through(daemon.socket(), b);
  (void)load_through(daemon.socket(), a);  // a is now the more recent
  (void)load_through(daemon.socket(), c);  // evicts b
  const StoreStatus s = store_status(daemon.socket());
  EXPECT_EQ(s.evictions, 1u);
  ASSERT_EQ(s.entries.size(), 2u);
  EXPECT_EQ(s.entries[0].path, c.path);
  EXPECT_EQ(s.entries[1].path, a.path);
  EXPECT_LE(s.bytes, s.budget_bytes);
}

TEST(StoreTest, HeldEntriesStayAndAFullBudgetFallsBackOrFails) {
  TempDir dir;
  const Model a = write_even_model(dir, "a.safetensors", 7);
  const Model b = write_even_model(dir, "b.safetensors", 8);
  Daemon daemon(dir, charge_of(std::filesystem::file_size(a.path)));  // room for one entry
  StateDict held = load_through(daemon.socket(), a);
  EXPECT_EQ(store_status(daemon.socket()).entries.at(0).holders, 1u);
  // b does not fit beside the held a: read without the store, or an error when the store is required.
  LoadProgress p;
  StateDict local = load_through(daemon.socket(), b, &p);
  EXPECT_EQ(p.files_store, 0u);
  testing::expect_matches_file(local, b.path, b.image);
  EXPECT_THROW(load_through(daemon.socket(), b, nullptr, true), OutOfMemoryError);
  testing::expect_matches_file(held, a.path, a.image);
  // Dropping the tensors closes the load's connection and ends its hold.
  held = StateDict();
  for (int i = 0; i < 200 && store_status(daemon.socket()).entries.at(0).holders != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(store_status(daemon.socket()).entries.at(0).holders, 0u);
  (void)load_through(daemon.socket(), b, &p);
  EXPECT_EQ(p.files_store, 1u);
}

TEST(StoreTest, TensorsOutliveTheDaemon) {
  TempDir dir;
  const Model m = write_model(dir, "a.safetensors", 9);
  StateDict sd;
  {
    Daemon daemon(dir);
    sd = load_through(daemon.socket(), m);
  }
  testing::expect_matches_file(sd, m.path, m.image);
}

TEST(StoreTest, AnUnreachableStoreLoadsLocallyUnlessRequired) {
  TempDir dir;
  const Model m = write_model(dir, "a.safetensors", 10);
  LoadProgress p;
  StateDict sd = load_through(dir.file("nobody.sock"), m, &p);
  EXPECT_EQ(p.files_store, 0u);
  testing::expect_matches_file(sd, m.path, m.image);
  try {
    (void)load_through(dir.file("nobody.sock"), m, nullptr, true);
    ADD_FAILURE() << "no error";
  } catch (const UnavailableError& e) {
    EXPECT_EQ(e.context().file, dir.file("nobody.sock"));
  }
}

// The store's local key (Note [The store's security boundary] in src/store/server.cc): a file
// rewritten in place with its mtime set back keeps device, inode, size and mtime, but not its
// ctime, which Env::stat reads and FileIdentity compares; identities that do not know a ctime or
// generation (0) compare without it.
TEST(StoreTest, AnIdentityHasTheChangeTimeThatARestoredMtimeKeeps) {
  TempDir dir;
  const std::string path = dir.file("f.bin");
  testing::write_file(path, std::vector<std::uint8_t>(4096, 1));
  const FileStat before = stat_or_throw(default_env(), ScopedFd(default_env(), ::open(path.c_str(), O_RDONLY)).get(), path);
  EXPECT_NE(before.ctime_ns, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  {
    ScopedFd fd(default_env(), ::open(path.c_str(), O_WRONLY));
    ASSERT_EQ(::pwrite(fd.get(), std::vector<char>(4096, 2).data(), 4096, 0), 4096);
    const timespec times[2] = {{0, UTIME_OMIT}, {before.mtime_ns / 1'000'000'000, before.mtime_ns % 1'000'000'000}};
    ASSERT_EQ(::futimens(fd.get(), times), 0);
  }
  const FileStat after = stat_or_throw(default_env(), ScopedFd(default_env(), ::open(path.c_str(), O_RDONLY)).get(), path);
  EXPECT_EQ(after.mtime_ns, before.mtime_ns);
  EXPECT_EQ(after.inode, before.inode);
  EXPECT_NE(after.ctime_ns, before.ctime_ns);
  EXPECT_FALSE(FileIdentity::of(after) == FileIdentity::of(before));
  EXPECT_NE(FileIdentity::of(after).describe().find("ctime"), std::string::npos);
  FileIdentity unknown = FileIdentity::of(before);
  unknown.ctime_ns = 0, unknown.generation = 0;  // as an I/O template records it
  EXPECT_TRUE(unknown == FileIdentity::of(after));
  FileIdentity other_generation = FileIdentity::of(before);
  other_generation.generation = before.generation + 1;
  EXPECT_FALSE(other_generation == FileIdentity::of(before));
}

TEST(StoreTest, AFileReplacedAfterItsHeaderWasReadIsAnError) {
  TempDir dir;
  Daemon daemon(dir);
  const Model m = write_model(dir, "a.safetensors", 11);
  const Checkpoint checkpoint = open_checkpoint(default_env(), {m.path});
  std::mt19937_64 rng(12);
  testing::write_random_checkpoint(dir.file("b.safetensors"), rng, 6);
  std::filesystem::rename(dir.file("b.safetensors"), m.path);  // a new inode under the path
  Loader loader(with_store(daemon.socket()));
  EXPECT_THROW((void)loader.load(checkpoint), IoError);
}

TEST(StoreTest, AFailedReadIsAnErrorAndLeavesNoEntry) {
  TempDir dir;
  Faults faults;
  faults.truncate_to = 4096;  // the daemon's reads find the file cut after its header
  FaultEnv env(faults);
  Daemon daemon(dir, 1u << 30, &env);
  const Model m = write_model(dir, "a.safetensors", 13);
  ASSERT_GT(std::filesystem::file_size(m.path), 3 * 4096u);
  try {
    (void)load_through(daemon.socket(), m, nullptr, true);
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.context().file, m.path);
    EXPECT_NE(std::string(e.what()).find("ended early"), std::string::npos) << e.what();
  }
  StoreStatus s = store_status(daemon.socket());
  EXPECT_TRUE(s.entries.empty());
  EXPECT_EQ(s.bytes, 0u);
  EXPECT_EQ(s.reads, 0u);
  // Not required: the load reads the file itself, whole.
  LoadProgress p;
  StateDict sd = load_through(daemon.socket(), m, &p);
  EXPECT_EQ(p.files_store, 0u);
  testing::expect_matches_file(sd, m.path, m.image);
}

TEST(StoreTest, ASecondDaemonOnALiveSocketIsRefusedAndAStaleOneReplaced) {
  TempDir dir;
  {
    Daemon first(dir);
    Daemon second(dir);
    EXPECT_NE(second.failure().find("another store"), std::string::npos) << second.failure();
  }
  // A socket file that nothing listens on (a crashed daemon's).
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strcpy(a.sun_path, dir.file("store.sock").c_str());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ::close(fd);
  ASSERT_TRUE(std::filesystem::exists(dir.file("store.sock")));
  Daemon restarted(dir);
  EXPECT_EQ(restarted.failure(), "");
  const Model m = write_model(dir, "a.safetensors", 14);
  LoadProgress p;
  (void)load_through(restarted.socket(), m, &p);
  EXPECT_EQ(p.files_store, 1u);
}

// Sends one raw record (and `fds`) and returns the reply's body.
nlohmann::json send_raw(int fd, const std::string& bytes, const std::vector<int>& fds = {}) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)] = {};
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  EXPECT_GE(::sendmsg(fd, &msg, MSG_NOSIGNAL), 0);
  std::optional<detail::WireMessage> reply = detail::receive_message(fd);
  EXPECT_TRUE(reply.has_value());
  return reply ? reply->body : nlohmann::json();
}

TEST(StoreTest, MalformedRequestsGetErrorsAndTheDaemonGoesOn) {
  TempDir dir;
  Daemon daemon(dir);
  const Model m = write_model(dir, "a.safetensors", 15);
  (void)load_through(daemon.socket(), m);  // the entry's memfd is open from now on
  const int before = testing::open_fd_count();
  {
    ScopedFd file(default_env(), ::open(m.path.c_str(), O_RDONLY));
    ScopedFd o_path(default_env(), ::open(m.path.c_str(), O_PATH));
    ScopedFd pipe_read, pipe_write;
    int p[2];
    ASSERT_EQ(::pipe(p), 0);
    pipe_read = ScopedFd(default_env(), p[0]);
    pipe_write = ScopedFd(default_env(), p[1]);
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strcpy(a.sun_path, daemon.socket().c_str());
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    const std::vector<std::pair<std::string, std::vector<int>>> cases = {
        {"not json", {}},
        {"[1,2,3]", {}},
        {"{}", {}},
        {R"({"op": 7})", {}},
        {R"({"op": "explode"})", {}},
        {R"({"op": "get"})", {}},
        {R"({"op": "get", "path": 5, "hold": "yes"})", {pipe_read.get()}},
        {R"({"op": "get"})", {file.get(), file.get(), file.get()}},
        {R"({"op": "get"})", {file.get(), pipe_read.get()}},  // a second descriptor of another file
        {R"({"op": "get"})", {o_path.get()}},                 // opens nothing for reading
        {R"({"op": "get"})", {file.get(), o_path.get()}},
        {R"({"op": "get"})", {pipe_write.get()}},
        {R"({"op": "evict"})", {file.get(), file.get()}},
        {std::string(70000, '{'), {}},
        {R"({"op": "get"})", {file.get(), file.get(), file.get(), file.get(), file.get(), file.get()}},
        // Converted entries' options (Note [Converted store entries]).
        {R"({"op": "get", "dtype": 3})", {file.get()}},
        {R"({"op": "get", "dtype": {}})", {file.get()}},
        {R"({"op": "get", "dtype": {"to": "Q7"}})", {file.get()}},
        {R"({"op": "get", "dtype": {"to": "I64"}})", {file.get()}},
        {R"({"op": "get", "dtype": {"to": "BF16", "keep": "x"}})", {file.get()}},
        {R"({"op": "get", "dtype": {"to": "BF16", "keep": [1]}})", {file.get()}},
        {R"({"op": "get", "dtype": {"to": "BF16", "prefix": []}})", {file.get()}},
        {R"({"op": "get", "dtype": {"to": "BF16", "keep_to": "U8"}})", {file.get()}},
    };
    for (const auto& [bytes, fds] : cases) {
      const nlohmann::json reply = send_raw(fd, bytes, fds);
      EXPECT_EQ(reply.value("ok", true), false) << bytes.substr(0, 40);
      EXPECT_TRUE(reply.contains("error")) << bytes.substr(0, 40);
    }
    // Random records: every one is answered, none kills the daemon.
    std::mt19937_64 rng(16);
    for (int i = 0; i < 300; ++i) {
      std::string junk(rng() % 200, '\0');
      for (char& c : junk) c = static_cast<char>(rng());
      if (i % 3 == 0) junk = R"({"op": "get", "hold": )" + junk + "}";
      if (i % 3 == 1) junk = R"({"op": "get", "dtype": {"to": "BF16", "keep": )" + junk + "}}";
      const nlohmann::json reply = send_raw(fd, junk.empty() ? std::string("x") : junk);
      EXPECT_TRUE(reply.is_object());
    }
    ::close(fd);
  }
  LoadProgress p;
  StateDict sd = load_through(daemon.socket(), m, &p);
  EXPECT_EQ(p.files_store, 1u);
  testing::expect_matches_file(sd, m.path, m.image);
  EXPECT_GE(store_status(daemon.socket()).errors, 20u);
  sd = StateDict();
  // The daemon closed every descriptor it was sent (it runs in this process).
  for (int i = 0; i < 200 && testing::open_fd_count() > before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_LE(testing::open_fd_count(), before);
}

TEST(StoreTest, WarmAndEvictByPath) {
  TempDir dir;
  Daemon daemon(dir);
  const Model a = write_model(dir, "a.safetensors", 17);
  const Model b = write_model(dir, "b.safetensors", 18);
  EXPECT_EQ(store_warm(daemon.socket(), {a.path, b.path}),
            std::filesystem::file_size(a.path) + std::filesystem::file_size(b.path));
  StoreStatus s = store_status(daemon.socket());
  EXPECT_EQ(s.reads, 2u);
  EXPECT_EQ(s.entries.size(), 2u);
  EXPECT_EQ(s.entries[0].holders + s.entries[1].holders, 0u);  // warming holds nothing
  EXPECT_EQ(store_evict(daemon.socket(), {a.path}), 1u);
  s = store_status(daemon.socket());
  ASSERT_EQ(s.entries.size(), 1u);
  EXPECT_EQ(s.entries[0].path, b.path);
  EXPECT_EQ(store_evict(daemon.socket(), {}), 1u);
  EXPECT_EQ(store_status(daemon.socket()).bytes, 0u);
}

}  // namespace
}  // namespace pinload

namespace pinload {
namespace {

// A device load takes its host copy from the store and copies from there:
// the device's bytes equal the file's, in both modes, and no byte is staged
// (Note [Host copy counts] in device.h).
TEST(StoreTest, DeviceLoadsCopyFromTheStoresCopy) {
  TempDir dir;
  Daemon daemon(dir);
  const Model m = write_model(dir, "a.safetensors", 19);
  const std::vector<char> file = testing::slurp(m.path);
  // Note [Copies from mapped memory]: the copies run from the mapping registered with the
  // device, and the registration lasts as long as the tensors that use the mapping.
  SimDeviceOptions sim;
  std::atomic<std::int64_t> registered{0}, most{0};
  sim.on_register = [&](std::size_t bytes, bool on) {
    const std::int64_t now = registered += on ? std::int64_t(bytes) : -std::int64_t(bytes);
    std::int64_t seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
  };
  std::unique_ptr<Device> device = make_sim_device(sim);
  auto expect_bytes = [&](const StateDict& sd, DeviceMode mode) {
    for (const testing::Layout& t : testing::layout_of(m.image)) {
      const Tensor& tensor = sd.at(t.name);
      ASSERT_TRUE(tensor.on_device());
      EXPECT_EQ(tensor.on_host(), mode == DeviceMode::kCached);
      std::vector<char> back(tensor.nbytes());
      if (!back.empty()) device->copy_to_host(back.data(), *tensor.device_buffer(), tensor.device_offset(), back.size());
      EXPECT_TRUE(std::equal(back.begin(), back.end(), file.begin() + static_cast<std::ptrdiff_t>(8 + m.image.header_json.size() + t.begin)))
          << t.name;
    }
  };
  for (const DeviceMode mode : {DeviceMode::kCached, DeviceMode::kStreaming}) {
    SCOPED_TRACE(mode == DeviceMode::kCached ? "cached" : "streaming");
    most = registered.load();  // this round's peak, not the round before's
    LoadOptions o = with_store(daemon.socket());
    o.target.device = device.get();
    o.target.mode = mode;
    Loader loader(o);
    const HostCopyCounts before = device->host_copy_counts();
    {
      LoadHandle h = loader.load_async({m.path});
      const StateDict sd = h.wait();
      EXPECT_EQ(h.progress().files_store, 1u);
      EXPECT_EQ(h.progress().bytes_copied, h.progress().bytes_total);
      expect_bytes(sd, mode);
      const HostCopyCounts after = device->host_copy_counts();
      EXPECT_EQ(after.staged_bytes, before.staged_bytes) << "a store device load staged bytes";
      EXPECT_EQ(after.direct_bytes - before.direct_bytes, h.progress().bytes_total);
      EXPECT_GE(most.load(), static_cast<std::int64_t>(file.size()));
      if (mode == DeviceMode::kCached) {
        // Kept while the host tensors use the mapping: a second load registers nothing
        // and asks the store nothing.
        EXPECT_GE(registered.load(), static_cast<std::int64_t>(file.size()));
        const StoreStatus status = store_status(daemon.socket());
        const StateDict again = loader.load({m.path});
        expect_bytes(again, mode);
        const HostCopyCounts second = device->host_copy_counts();
        EXPECT_EQ(second.registrations, after.registrations) << "the second load registered again";
        EXPECT_EQ(second.staged_bytes, before.staged_bytes);
        const StoreStatus status_after = store_status(daemon.socket());
        EXPECT_EQ(status_after.hits + status_after.misses, status.hits + status.misses) << "the store was asked again";
      } else {
        EXPECT_EQ(registered.load(), 0) << "streaming: the mapping went with the load";
      }
    }
    EXPECT_EQ(registered.load(), 0);
    EXPECT_EQ(device->host_copy_counts().live_registrations, 0u);
  }
  EXPECT_EQ(store_status(daemon.socket()).reads, 1u);
}

// PINLOAD_STORE_REGISTER=0, or a device that refuses the entry's pages: the
// copies run from pageable memory, which the stand-in counts as staged.
TEST(StoreTest, UnregisteredStorePagesAreStaged) {
  TempDir dir;
  Daemon daemon(dir);
  const Model m = write_model(dir, "a.safetensors", 23);
  SimDeviceOptions sim;
  sim.refuse_register = [](const void*, std::size_t) { return std::string("refused by the test"); };
  std::unique_ptr<Device> device = make_sim_device(sim);
  LoadOptions o = with_store(daemon.socket());
  o.target.device = device.get();
  o.target.mode = DeviceMode::kStreaming;
  LoadHandle h = Loader(o).load_async({m.path});
  const StateDict sd = h.wait();
  EXPECT_EQ(h.progress().files_store, 1u);
  const HostCopyCounts c = device->host_copy_counts();
  EXPECT_EQ(c.registrations_refused, 1u);
  EXPECT_EQ(c.registrations, 0u);
  EXPECT_EQ(c.staged_bytes, h.progress().bytes_total);
  EXPECT_EQ(c.direct_bytes, 0u);
}

}  // namespace
}  // namespace pinload

namespace pinload {
namespace {

// Note [Converted store entries]: what the store hands out for a load with a
// dtype equals what the same load converts locally: names and order, dtypes,
// shapes, bytes and metadata, FP8 scales applied and dropped.
void expect_same(const StateDict& got, const StateDict& want) {
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(got.metadata(), want.metadata());
  for (std::size_t i = 0; i < want.size(); ++i) {
    const Tensor& g = got[i];
    const Tensor& w = want[i];
    EXPECT_EQ(g.name(), w.name());
    EXPECT_EQ(g.dtype(), w.dtype()) << w.name();
    EXPECT_EQ(g.shape(), w.shape()) << w.name();
    ASSERT_EQ(g.nbytes(), w.nbytes()) << w.name();
    EXPECT_TRUE(w.nbytes() == 0 || std::memcmp(g.data(), w.data(), w.nbytes()) == 0) << w.name();
  }
}

TEST(StoreTest, AConvertingLoadMapsAConvertedEntryEqualToALocalConversion) {
  TempDir dir;
  Daemon daemon(dir);
  std::mt19937_64 rng(21);
  const std::string source = dir.file("source.safetensors");
  testing::write_file(source, testing::make_image({{"blocks.0.attn.weight", "F32", {64, 48}},
                                                   {"blocks.0.attn.bias", "F16", {64}},
                                                   {"blocks.0.norm.weight", "BF16", {48}},
                                                   {"position_ids", "I64", {7}},
                                                   {"odd", "U8", {3}},
                                                   {"blocks.1.proj.weight", "F16", {32, 33}},
                                                   {"head.weight", "BF16", {16, 8}}},
                                                  rng, 8, R"({"format":"pt","note":"kept"})")
                                  .bytes());
  // An FP8 file in ComfyUI's layout: quantised weights, their scales and markers.
  const std::string fp8 = dir.file("fp8.safetensors");
  convert_checkpoint(source, fp8);
  for (const std::string& path : {source, fp8}) {
    for (const bool keep : {false, true}) {
      LoadOptions local;
      local.zero_copy = ZeroCopy::kOff;
      local.dtype.to = DType::kBF16;
      if (keep) {
        local.dtype.keep = {"head"};
        local.dtype.keep_to = DType::kF32;
      }
      const StateDict want = Loader(local).load({path});
      LoadOptions through = with_store(daemon.socket(), /*required=*/true);
      through.dtype = local.dtype;
      for (int pass = 0; pass < 2; ++pass) {  // a miss (converted in the daemon), then a hit
        Loader loader(through);
        LoadHandle h = loader.load_async({path});
        const StateDict got = h.wait();
        EXPECT_EQ(h.progress().files_store, 1u) << path;
        expect_same(got, want);
      }
    }
  }
  const StoreStatus s = store_status(daemon.socket());
  EXPECT_EQ(s.misses, 4u);  // two files, two variants each
  EXPECT_EQ(s.hits, 4u);
  ASSERT_EQ(s.entries.size(), 4u);
  std::set<std::string> variants;
  for (const StoreEntryStatus& e : s.entries) variants.insert(e.dtype);
  EXPECT_EQ(variants, (std::set<std::string>{"BF16", "BF16 keep=[\"head\"] keep_to=F32"}));
  // A plain load of the file is an entry of its own; warming a variant already there reads nothing.
  StateDict plain = load_through(daemon.socket(), Model{fp8, {}});
  EXPECT_EQ(store_status(daemon.socket()).entries.size(), 5u);
  DTypeOptions bf16;
  bf16.to = DType::kBF16;
  store_warm(daemon.socket(), {fp8}, nullptr, bf16);
  EXPECT_EQ(store_status(daemon.socket()).reads, 5u);
}

// A pipeline folder: keep patterns match the names the client's load sees
// ("unet/..."), so the daemon converts each file under its component's prefix.
TEST(StoreTest, ConvertedEntriesOfAPipelineKeepByComponent) {
  TempDir dir;
  Daemon daemon(dir);
  std::mt19937_64 rng(23);
  std::filesystem::create_directories(dir.path() / "unet");
  std::filesystem::create_directories(dir.path() / "text_encoder");
  testing::write_file(dir.file("model_index.json"), {'{', '}'});
  testing::write_file(dir.file("unet/diffusion_pytorch_model.safetensors"),
                      testing::make_image({{"conv.weight", "F32", {8, 4}}, {"w", "F16", {9}}}, rng).bytes());
  testing::write_file(dir.file("text_encoder/model.safetensors"),
                      testing::make_image({{"w", "F32", {16}}, {"ids", "I64", {2}}}, rng).bytes());
  LoadOptions local;
  local.zero_copy = ZeroCopy::kOff;
  local.dtype.to = DType::kBF16;
  local.dtype.keep = {"unet/*"};
  const StateDict want = Loader(local).load({dir.path().string()});
  EXPECT_EQ(want.at("unet/conv.weight").dtype(), DType::kF32);
  EXPECT_EQ(want.at("text_encoder/w").dtype(), DType::kBF16);
  LoadOptions through = with_store(daemon.socket(), /*required=*/true);
  through.dtype = local.dtype;
  Loader loader(through);
  LoadHandle h = loader.load_async({dir.path().string()});
  const StateDict got = h.wait();
  EXPECT_EQ(h.progress().files_store, 2u);
  expect_same(got, want);
}

// A file the daemon cannot convert (an FP8 weight's scale of the wrong dtype)
// is the load's own InvalidFileError under store_required, and a local
// conversion (with the same error) without it; the daemon keeps no entry.
TEST(StoreTest, AFileTheDaemonCannotConvertLeavesNoEntry) {
  TempDir dir;
  Daemon daemon(dir);
  std::mt19937_64 rng(22);
  const std::string path = dir.file("bad.safetensors");
  testing::write_file(path, testing::make_image({{"l.weight", "F8_E4M3", {4, 4}}, {"l.weight_scale", "F16", {}}}, rng).bytes());
  LoadOptions o = with_store(daemon.socket(), /*required=*/true);
  o.dtype.to = DType::kBF16;
  EXPECT_THROW(Loader(o).load({path}), InvalidFileError);
  o.store.required = false;
  EXPECT_THROW(Loader(o).load({path}), InvalidFileError);
  const StoreStatus s = store_status(daemon.socket());
  EXPECT_TRUE(s.entries.empty());
  EXPECT_EQ(s.bytes, 0u);
}

}  // namespace
}  // namespace pinload
