// NUMA placement (numa.h): the sysfs parsers against fake trees, the placement
// rules, the Env calls a load makes on one-node and two-node topologies
// (counted through an EnvWrapper), and the real POSIX calls on this machine.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "file_check.h"
#include "pinload/checkpoint.h"
#include "pinload/device.h"
#include "pinload/error.h"
#include "pinload/host_memory.h"
#include "pinload/loader.h"
#include "pinload/numa.h"
#include "test_files.h"

namespace pinload {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

// ---- fakes ----

// A sysfs tree in a temporary folder: nodes with cpulists, PCI devices with
// numa_node files, written verbatim (malformed text included).
class FakeSysfs {
 public:
  FakeSysfs() {
    write("devices/system/node/online", "0\n");  // files beside the node folders are ignored
    write("devices/system/node/possible", "0\n");
    fs::create_directories(dir_.path() / "devices/system/node/power");
  }
  void add_node(int id, const std::string& cpulist) {
    write("devices/system/node/node" + std::to_string(id) + "/cpulist", cpulist);
  }
  void add_pci_device(const std::string& sysfs_bus_id, const std::string& numa_node) {
    write("bus/pci/devices/" + sysfs_bus_id + "/numa_node", numa_node);
  }
  std::string root() const { return dir_.path().string(); }
  std::string path(const std::string& relative) const { return (dir_.path() / relative).string(); }

 private:
  void write(const std::string& relative, const std::string& text) {
    const fs::path p = dir_.path() / relative;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
  }
  TempDir dir_;
};

// Counts the NUMA calls of the Env seam. bind_memory and
// set_thread_memory_node are recorded and not forwarded (a fake node may not
// exist here). Affinity calls are forwarded unless `fake_affinity` is set, in
// which case get returns it and set only records. Each pread records the CPUs
// its thread was pinned to (empty: never pinned) and the CPU it ran on; so
// does each populate_read (a chunk copied from a mapping).
class NumaCountingEnv : public EnvWrapper {
 public:
  struct Bind {
    void* address;
    std::size_t bytes;
    int node;
  };
  struct Read {
    std::vector<int> pinned_to;
    int cpu;
  };

  explicit NumaCountingEnv(std::optional<std::vector<int>> fake_affinity = std::nullopt)
      : EnvWrapper(default_env()), fake_affinity_(std::move(fake_affinity)) {}

  int bind_memory(void* address, std::size_t bytes, int node) override {
    std::lock_guard lock(mu_);
    binds_.push_back({address, bytes, node});
    calls_.push_back("bind");
    return 0;
  }
  int set_thread_memory_node(int node) override {
    std::lock_guard lock(mu_);
    memory_nodes_.push_back(node);
    return 0;
  }
  int get_thread_affinity(std::vector<int>* cpus) override {
    {
      std::lock_guard lock(mu_);
      ++affinity_gets_;
    }
    if (fake_affinity_) {
      *cpus = *fake_affinity_;
      return 0;
    }
    return EnvWrapper::get_thread_affinity(cpus);
  }
  int set_thread_affinity(const std::vector<int>& cpus) override {
    const int rc = fake_affinity_ ? 0 : EnvWrapper::set_thread_affinity(cpus);
    std::lock_guard lock(mu_);
    affinity_sets_.push_back(cpus);
    if (rc == 0) pinned_[std::this_thread::get_id()] = cpus;
    return rc;
  }
  int lock(void* address, std::size_t bytes) override {
    {
      std::lock_guard lock(mu_);
      calls_.push_back("lock");
    }
    return EnvWrapper::lock(address, bytes);
  }
  // Reads of checkpoints only: a load's probes of /proc and cgroup files
  // (memory limits) go through the Env too, from the calling thread.
  int open_read(const std::string& path, int extra_flags) override {
    const int fd = EnvWrapper::open_read(path, extra_flags);
    if (fd >= 0 && path.ends_with(".safetensors")) {
      std::lock_guard lock(mu_);
      checkpoint_fds_.insert(fd);
    }
    return fd;
  }
  int close(int fd) override {
    {
      std::lock_guard lock(mu_);
      checkpoint_fds_.erase(fd);
    }
    return EnvWrapper::close(fd);
  }
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    bool checkpoint;
    {
      std::lock_guard lock(mu_);
      checkpoint = checkpoint_fds_.contains(fd);
    }
    if (checkpoint) record_read();
    return EnvWrapper::pread(fd, buffer, bytes, offset);
  }
  // A chunk copied from a mapping (Note [Mapped reads]) is a read too.
  int populate_read(const void* address, std::size_t bytes) override {
    record_read();
    return EnvWrapper::populate_read(address, bytes);
  }

  void record_read() {
    std::lock_guard lock(mu_);
    auto it = pinned_.find(std::this_thread::get_id());
    reads_.push_back({it == pinned_.end() ? std::vector<int>{} : it->second, ::sched_getcpu()});
  }

  // Every NUMA call so far; 0 means the load left placement to the OS.
  std::size_t numa_calls() const {
    std::lock_guard lock(mu_);
    return binds_.size() + memory_nodes_.size() + affinity_gets_ + affinity_sets_.size();
  }
  std::vector<Bind> binds() const {
    std::lock_guard lock(mu_);
    return binds_;
  }
  std::vector<std::vector<int>> affinity_sets() const {
    std::lock_guard lock(mu_);
    return affinity_sets_;
  }
  std::vector<Read> reads() const {
    std::lock_guard lock(mu_);
    return reads_;
  }
  std::vector<std::string> calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }
  void clear_reads() {
    std::lock_guard lock(mu_);
    reads_.clear();
  }

 private:
  const std::optional<std::vector<int>> fake_affinity_;
  std::set<int> checkpoint_fds_;  // with mu_
  mutable std::mutex mu_;
  std::vector<Bind> binds_;
  std::vector<int> memory_nodes_;
  std::size_t affinity_gets_ = 0;
  std::vector<std::vector<int>> affinity_sets_;
  std::map<std::thread::id, std::vector<int>> pinned_;
  std::vector<Read> reads_;
  std::vector<std::string> calls_;  // "bind" and "lock", in order
};

std::vector<int> real_affinity() {
  std::vector<int> cpus;
  EXPECT_EQ(default_env()->get_thread_affinity(&cpus), 0);
  return cpus;
}

// ---- cpulist ----

TEST(Cpulist, ParsesTheKernelSyntax) {
  EXPECT_EQ(parse_cpulist("0-3,8-11\n"), (std::vector<int>{0, 1, 2, 3, 8, 9, 10, 11}));
  EXPECT_EQ(parse_cpulist("5"), std::vector<int>{5});
  EXPECT_EQ(parse_cpulist(""), std::vector<int>{});
  EXPECT_EQ(parse_cpulist("\n"), std::vector<int>{});
  EXPECT_EQ(parse_cpulist("7,0-1,1"), (std::vector<int>{0, 1, 7}));  // any order, as the kernel's parser
  EXPECT_EQ(format_cpulist({0, 1, 2, 3, 8, 9, 10, 11}), "0-3,8-11");
  EXPECT_EQ(format_cpulist({4}), "4");
  EXPECT_EQ(format_cpulist({}), "");
  EXPECT_EQ(format_cpulist(parse_cpulist("0,2-3,5")), "0,2-3,5");
}

TEST(Cpulist, MalformedTextIsATypedErrorNamingTheFile) {
  const std::string file = "/sys/devices/system/node/node1/cpulist";
  for (const char* bad : {",", "0-", "-1", "3-1", "a", "0-3,,5", "0-3,", "0-7:2/4", "1 2", "+1", "0x1", "99999999",
                          "1-99999999"}) {
    SCOPED_TRACE(bad);
    try {
      parse_cpulist(bad, file);
      ADD_FAILURE() << "accepted";
    } catch (const InvalidFileError& e) {
      EXPECT_EQ(e.context().file, file);
      EXPECT_NE(std::string(e.what()).find("malformed cpulist"), std::string::npos) << e.what();
    }
  }
}

// ---- PCI bus ids ----

TEST(PciBusId, NormalisesToTheSysfsSpelling) {
  EXPECT_EQ(normalize_pci_bus_id("0000:19:00.0"), "0000:19:00.0");
  EXPECT_EQ(normalize_pci_bus_id("0000:3B:00.0"), "0000:3b:00.0");      // cudaDeviceGetPCIBusId's case
  EXPECT_EQ(normalize_pci_bus_id("00000000:3B:00.0"), "0000:3b:00.0");  // nvidia-smi's 8-digit domain
  EXPECT_EQ(normalize_pci_bus_id("3b:00.1"), "0000:3b:00.1");           // no domain
  EXPECT_EQ(normalize_pci_bus_id("10000:01:1f.7"), "10000:01:1f.7");    // VMD domains have 5 digits
  EXPECT_EQ(normalize_pci_bus_id(std::string("0000:19:00.0\n\0\0", 16)), "0000:19:00.0");
  for (const char* bad : {"", "0000:19:00", "0000:19:20.0", "0000:19:00.8", "zz:00.0", "0000:0000:19:00.0", "19.0",
                          "0000:19:00.0.0", "000000000:19:00.0", ":19:00.0", "0000:119:00.0"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW(normalize_pci_bus_id(bad), InvalidFileError);
  }
}

// ---- topology from sysfs ----

TEST(NumaTopology, ReadsNodesAndCpusFromSysfs) {
  FakeSysfs sysfs;
  sysfs.add_node(1, "4-7\n");
  sysfs.add_node(0, "0-3\n");
  sysfs.add_node(2, "\n");  // memory without CPUs (CXL, a GPU's memory)
  const NumaTopology t = NumaTopology::read(sysfs.root());
  ASSERT_EQ(t.nodes().size(), 3u);
  EXPECT_TRUE(t.multi_node());
  EXPECT_EQ(t.nodes()[0].id, 0);
  EXPECT_EQ(t.nodes()[1].id, 1);
  EXPECT_EQ(t.node(1)->cpus, (std::vector<int>{4, 5, 6, 7}));
  EXPECT_TRUE(t.node(2)->cpus.empty());
  EXPECT_EQ(t.node(3), nullptr);
}

TEST(NumaTopology, NoNodeFolderIsAnEmptyTopology) {
  TempDir empty;
  const NumaTopology t = NumaTopology::read(empty.path().string());
  EXPECT_TRUE(t.nodes().empty());
  EXPECT_FALSE(t.multi_node());
  EXPECT_EQ(t.node_of_pci_device("0000:19:00.0"), -1);
}

TEST(NumaTopology, MalformedOrMissingCpulistIsATypedError) {
  {
    FakeSysfs sysfs;
    sysfs.add_node(0, "0-3\n");
    sysfs.add_node(1, "4-\n");
    try {
      NumaTopology::read(sysfs.root());
      ADD_FAILURE() << "accepted";
    } catch (const InvalidFileError& e) {
      EXPECT_EQ(e.context().file, sysfs.path("devices/system/node/node1/cpulist"));
    }
  }
  {
    FakeSysfs sysfs;
    sysfs.add_node(0, "0-3\n");
    fs::create_directories(sysfs.path("devices/system/node/node1"));
    EXPECT_THROW(NumaTopology::read(sysfs.root()), InvalidFileError);
  }
}

TEST(NumaTopology, NodeOfPciDevice) {
  FakeSysfs sysfs;
  sysfs.add_node(0, "0-3\n");
  sysfs.add_node(1, "4-7\n");
  sysfs.add_pci_device("0000:3b:00.0", "1\n");
  sysfs.add_pci_device("0000:19:00.0", "-1\n");
  sysfs.add_pci_device("0000:1a:00.0", "one\n");
  sysfs.add_pci_device("0000:1b:00.0", "-2\n");
  sysfs.add_pci_device("0000:1c:00.0", "");
  const NumaTopology t = NumaTopology::read(sysfs.root());
  EXPECT_EQ(t.node_of_pci_device("0000:3B:00.0"), 1);
  EXPECT_EQ(t.node_of_pci_device("00000000:3b:00.0"), 1);
  EXPECT_EQ(t.node_of_pci_device("0000:19:00.0"), -1);  // firmware does not say
  EXPECT_EQ(t.node_of_pci_device("0000:5e:00.0"), -1);  // no such device
  for (const char* bad : {"0000:1a:00.0", "0000:1b:00.0", "0000:1c:00.0"}) {
    SCOPED_TRACE(bad);
    try {
      t.node_of_pci_device(bad);
      ADD_FAILURE() << "accepted";
    } catch (const InvalidFileError& e) {
      EXPECT_EQ(e.context().file, sysfs.path(std::string("bus/pci/devices/") + bad + "/numa_node"));
    }
  }
  EXPECT_THROW(t.node_of_pci_device("not a bus id"), InvalidFileError);
}

// ---- placement rules (Note [NUMA placement]) ----

TEST(PlaceNuma, FollowsTheRules) {
  const NumaTopology one({{0, {0, 1}}});
  const NumaTopology two({{0, {0, 1, 2, 3}}, {1, {4, 5, 6, 7}}});
  const NumaTopology none;
  // One node: never, whatever is asked.
  EXPECT_FALSE(place_numa(one, kNumaAuto, 0).active());
  EXPECT_FALSE(place_numa(one, 0, 0).active());
  EXPECT_FALSE(place_numa(none, kNumaAuto, 0).active());
  EXPECT_FALSE(place_numa(none, 0, -1).active());  // an empty topology is node 0
  EXPECT_THROW(place_numa(one, 1, 0), InvalidArgumentError);
  EXPECT_THROW(place_numa(none, 1, -1), InvalidArgumentError);
  // Two nodes.
  const NumaPlacement p = place_numa(two, kNumaAuto, 1);
  EXPECT_EQ(p.node, 1);
  EXPECT_EQ(p.cpus, (std::vector<int>{4, 5, 6, 7}));
  EXPECT_FALSE(place_numa(two, kNumaAuto, -1).active());  // unknown device node, or no device
  EXPECT_FALSE(place_numa(two, kNumaAuto, 7).active());   // a node the machine does not have
  EXPECT_FALSE(place_numa(two, kNumaNone, 1).active());
  EXPECT_EQ(place_numa(two, 0, 1).node, 0);  // an explicit node wins over the device's
  EXPECT_THROW(place_numa(two, 5, 1), InvalidArgumentError);
  EXPECT_THROW(place_numa(two, -3, 1), InvalidArgumentError);
}

// ---- ThreadAffinityScope ----

TEST(ThreadAffinityScope, PinsToTheIntersectionAndRestores) {
  const std::vector<int> all{0, 1, 2, 3, 4, 5, 6, 7};
  NumaCountingEnv env(all);
  {
    ThreadAffinityScope scope(&env, {4, 5, 6, 7, 8, 9});
    EXPECT_TRUE(scope.pinned());
  }
  EXPECT_EQ(env.affinity_sets(), (std::vector<std::vector<int>>{{4, 5, 6, 7}, all}));
  {
    ThreadAffinityScope outside(&env, {20, 21});  // none of them allowed: left alone
    ThreadAffinityScope same(&env, all);          // nothing to change
    EXPECT_FALSE(outside.pinned());
    EXPECT_FALSE(same.pinned());
  }
  EXPECT_EQ(env.affinity_sets().size(), 2u);
  const std::size_t calls = env.numa_calls();
  { ThreadAffinityScope empty(&env, {}); }
  EXPECT_EQ(env.numa_calls(), calls);  // empty: not even a get
}

// ---- the real POSIX calls ----

TEST(RealEnv, ThreadPinnedToCpu0RunsOnCpu0) {
  const std::vector<int> before = real_affinity();
  if (std::find(before.begin(), before.end(), 0) == before.end()) GTEST_SKIP() << "CPU 0 is not ours";
  int rc = -1, cpu = -1;
  std::vector<int> inside;
  std::thread([&] {
    rc = default_env()->set_thread_affinity({0});
    cpu = ::sched_getcpu();
    default_env()->get_thread_affinity(&inside);
  }).join();
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(cpu, 0);
  EXPECT_EQ(inside, std::vector<int>{0});
  EXPECT_EQ(real_affinity(), before);  // another thread's affinity is its own
  EXPECT_LT(default_env()->set_thread_affinity({}), 0);
  EXPECT_LT(default_env()->set_thread_affinity({-1}), 0);
}

TEST(RealEnv, AffinityScopeRestoresTheThread) {
  const std::vector<int> before = real_affinity();
  if (before.size() < 2) GTEST_SKIP() << "one CPU: nothing to narrow";
  std::thread([&] {
    {
      ThreadAffinityScope scope(default_env(), {before.back()});
      EXPECT_TRUE(scope.pinned());
      EXPECT_EQ(::sched_getcpu(), before.back());
    }
    EXPECT_EQ(real_affinity(), before);
  }).join();
}

TEST(RealEnv, BindMemoryPlacesPagesOnTheNode) {
  const std::size_t bytes = 2u << 20;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  const int rc = default_env()->bind_memory(p, bytes, 0);
  if (rc == -ENOSYS || rc == -EPERM) {
    ::munmap(p, bytes);
    GTEST_SKIP() << "mbind refused here (" << -rc << ")";
  }
  EXPECT_EQ(rc, 0);
  static_cast<volatile char*>(p)[0] = 1;
  // move_pages with no target nodes reports where each page is.
  void* pages[1] = {p};
  int status[1] = {-1};
  ASSERT_EQ(::syscall(SYS_move_pages, 0, 1ul, pages, nullptr, status, 0), 0);
  EXPECT_EQ(status[0], 0);
  if (!NumaTopology::read().node(1)) {
    EXPECT_LT(default_env()->bind_memory(p, bytes, 1), 0);  // no such node
  }
  EXPECT_EQ(default_env()->bind_memory(p, bytes, -1), -EINVAL);
  ::munmap(p, bytes);
  int policy_rc = -1, default_rc = -1;
  std::thread([&] {
    policy_rc = default_env()->set_thread_memory_node(0);
    default_rc = default_env()->set_thread_memory_node(-1);
  }).join();
  EXPECT_EQ(policy_rc, 0);
  EXPECT_EQ(default_rc, 0);
}

// ---- backends ----

TEST(LockedMemoryBackend, BindsEachReservationBeforeLockingIt) {
  NumaCountingEnv env;
  auto backend = make_locked_memory_backend(&env, LockedMemoryOptions{.numa_node = 1});
  const HostRange a = backend->reserve(4u << 20);
  const HostRange b = backend->reserve(2u << 20);
  const auto binds = env.binds();
  ASSERT_EQ(binds.size(), 2u);
  EXPECT_EQ(binds[0].address, a.data);
  EXPECT_EQ(binds[0].bytes, a.bytes);
  EXPECT_EQ(binds[1].address, b.data);
  for (const auto& bind : binds) EXPECT_EQ(bind.node, 1);
  EXPECT_EQ(env.calls(), (std::vector<std::string>{"bind", "lock", "bind", "lock"}));
  backend->release(a);
  backend->release(b);

  NumaCountingEnv plain_env;
  auto plain = make_locked_memory_backend(&plain_env);
  plain->release(plain->reserve(2u << 20));
  EXPECT_EQ(plain_env.numa_calls(), 0u);
}

TEST(SimDevice, ReportsItsConfiguredNodeOrThePciDevicesNode) {
  FakeSysfs sysfs;
  sysfs.add_node(0, "0-3\n");
  sysfs.add_node(1, "4-7\n");
  sysfs.add_pci_device("0000:3b:00.0", "1\n");
  const NumaTopology t = NumaTopology::read(sysfs.root());
  EXPECT_EQ(make_sim_device()->numa_node(t), -1);
  EXPECT_EQ(make_sim_device(SimDeviceOptions{.numa_node = 0})->numa_node(t), 0);
  auto by_pci = make_sim_device(SimDeviceOptions{.pci_bus_id = "0000:3B:00.0"});
  EXPECT_EQ(by_pci->pci_bus_id(), "0000:3B:00.0");
  EXPECT_EQ(by_pci->numa_node(t), 1);
}

// ---- loads ----

struct Written {
  std::string path;
  testing::FileImage image;
};

Written write_model(const TempDir& dir, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Written w{dir.file("model.safetensors"), {}};
  w.image = testing::write_random_checkpoint(w.path, rng, 40, 1u << 14);
  return w;
}

// Every tensor's bytes, from the host or read back from the device, equal
// the file's (the independent reader of file_check.h).
void expect_bytes_equal_file(const StateDict& sd, const Written& w, Device* device) {
  const std::vector<char> file = testing::slurp(w.path);
  const std::uint64_t data_at = 8 + w.image.header_json.size();
  ASSERT_EQ(sd.size(), testing::layout_of(w.image).size());
  for (const testing::Layout& l : testing::layout_of(w.image)) {
    const Tensor& t = sd.at(l.name);
    ASSERT_EQ(t.nbytes(), l.end - l.begin) << l.name;
    std::vector<char> got(t.nbytes());
    if (t.on_host()) {
      std::copy_n(reinterpret_cast<const char*>(t.data()), got.size(), got.begin());
    } else if (!got.empty()) {
      device->copy_to_host(got.data(), *t.device_buffer(), t.device_offset(), got.size());
    }
    ASSERT_TRUE(std::equal(got.begin(), got.end(), file.begin() + static_cast<std::ptrdiff_t>(data_at + l.begin)))
        << l.name;
  }
}

LoadOptions small_blocks(const FakeSysfs* sysfs) {
  LoadOptions o;
  o.threads = 4;
  o.block_size = 16u << 10;  // many chunks, so that every reader reads
  o.zero_copy = ZeroCopy::kOff;  // read into the pool's placed blocks, never mapped
  if (sysfs != nullptr) o.numa.sysfs_root = sysfs->root();
  return o;
}

TEST(NumaLoad, OneNodeMachineMakesNoNumaCall) {
  TempDir dir;
  const Written w = write_model(dir, 1);
  FakeSysfs sysfs;
  sysfs.add_node(0, "0-7\n");
  sysfs.add_pci_device("0000:3b:00.0", "0\n");
  auto device = make_sim_device(SimDeviceOptions{.pci_bus_id = "0000:3b:00.0"});
  for (int requested : {kNumaAuto, 0, kNumaNone}) {
    for (DeviceMode mode : {DeviceMode::kCached, DeviceMode::kStreaming}) {
      SCOPED_TRACE(::testing::Message() << "numa.node " << requested << " mode " << static_cast<int>(mode));
      NumaCountingEnv env;
      LoadOptions o = small_blocks(&sysfs);
      o.numa.node = requested;
      o.target = {device.get(), mode, {}, 1u << 20};
      Loader loader(o, nullptr, &env);
      EXPECT_FALSE(loader.numa_placement().active());
      expect_bytes_equal_file(loader.load({w.path}), w, device.get());
      EXPECT_EQ(env.numa_calls(), 0u);
    }
  }
}

TEST(NumaLoad, ThisMachineIsANoOpToo) {
  if (NumaTopology::read().multi_node()) GTEST_SKIP() << "this machine has several NUMA nodes";
  TempDir dir;
  const Written w = write_model(dir, 2);
  auto device = make_sim_device(SimDeviceOptions{.numa_node = 0});
  NumaCountingEnv env;
  LoadOptions o = small_blocks(nullptr);  // the real /sys
  o.target.device = device.get();
  Loader loader(o, nullptr, &env);
  expect_bytes_equal_file(loader.load({w.path}), w, device.get());
  EXPECT_EQ(env.numa_calls(), 0u);
}

// Two nodes, the device on node 1 (found through its PCI address), CPUs 0-15
// as far as the readers know: every reservation is bound to node 1 and every
// chunk is read by a thread pinned to node 1's CPUs.
class TwoNodeLoad : public ::testing::TestWithParam<DeviceMode> {};

TEST_P(TwoNodeLoad, PoolOnTheDevicesNodeAndReadersOnItsCpus) {
  TempDir dir;
  const Written w = write_model(dir, 3);
  FakeSysfs sysfs;
  sysfs.add_node(0, "0-3,8-11\n");
  sysfs.add_node(1, "4-7,12-15\n");
  sysfs.add_pci_device("0000:3b:00.0", "1\n");
  std::vector<int> all(16);
  for (int i = 0; i < 16; ++i) all[static_cast<std::size_t>(i)] = i;
  const std::vector<int> node1{4, 5, 6, 7, 12, 13, 14, 15};
  auto device = make_sim_device(SimDeviceOptions{.pci_bus_id = "0000:3B:00.0"});
  NumaCountingEnv env(all);
  LoadOptions o = small_blocks(&sysfs);
  o.target = {device.get(), GetParam(), {}, 1u << 20};
  Loader loader(o, nullptr, &env);
  EXPECT_EQ(loader.numa_placement().node, 1);
  EXPECT_EQ(loader.numa_placement().cpus, node1);

  const Checkpoint checkpoint = open_checkpoint(&env, {w.path});
  env.clear_reads();  // the header reads above ran on this thread, unpinned
  const StateDict sd = loader.load(checkpoint);
  expect_bytes_equal_file(sd, w, device.get());

  std::uint64_t reservations = loader.pool()->stats().os_reservations;
  if (loader.staging_pool()) reservations += loader.staging_pool()->stats().os_reservations;
  EXPECT_GT(reservations, 0u);
  const auto binds = env.binds();
  EXPECT_EQ(binds.size(), reservations);
  for (const auto& bind : binds) EXPECT_EQ(bind.node, 1);

  const auto reads = env.reads();
  ASSERT_GT(reads.size(), 8u);
  for (const auto& read : reads) EXPECT_EQ(read.pinned_to, node1);
  // Each reader pinned itself once and restored itself once (4 threads, and
  // the extra readers of direct reads: Note [Direct reads in flight]).
  const auto sets = env.affinity_sets();
  const auto pins = std::count(sets.begin(), sets.end(), node1);
  EXPECT_GE(pins, 1);
  EXPECT_LE(pins, static_cast<long>(std::max(o.threads, kDirectReadsInFlight)));
  EXPECT_EQ(std::count(sets.begin(), sets.end(), all), pins);
  EXPECT_EQ(sets.size(), static_cast<std::size_t>(2 * pins));
}

INSTANTIATE_TEST_SUITE_P(Modes, TwoNodeLoad, ::testing::Values(DeviceMode::kCached, DeviceMode::kStreaming),
                         [](const ::testing::TestParamInfo<DeviceMode>& param) {
                           return param.param == DeviceMode::kCached ? "Cached" : "Streaming";
                         });

// The same with this machine's CPUs as the fake nodes and the real affinity
// calls: readers really run on node 1's CPU, and the calling thread, which
// reads too, gets its own affinity back.
TEST(NumaLoad, ReadersRunOnTheNodesCpuForReal) {
  const std::vector<int> mine = real_affinity();
  if (mine.size() < 2) GTEST_SKIP() << "one CPU: nothing to pin";
  TempDir dir;
  const Written w = write_model(dir, 4);
  FakeSysfs sysfs;
  sysfs.add_node(0, std::to_string(mine.front()) + "\n");
  sysfs.add_node(1, std::to_string(mine.back()) + "\n");
  auto device = make_sim_device(SimDeviceOptions{.numa_node = 1});
  NumaCountingEnv env;  // affinity forwarded to the kernel
  LoadOptions o = small_blocks(&sysfs);
  o.target.device = device.get();
  Loader loader(o, nullptr, &env);
  const Checkpoint checkpoint = open_checkpoint(&env, {w.path});
  env.clear_reads();
  expect_bytes_equal_file(loader.load(checkpoint), w, device.get());
  const auto reads = env.reads();
  ASSERT_FALSE(reads.empty());
  for (const auto& read : reads) {
    EXPECT_EQ(read.pinned_to, std::vector<int>{mine.back()});
    EXPECT_EQ(read.cpu, mine.back());
  }
  EXPECT_EQ(real_affinity(), mine);
}

TEST(NumaLoad, ExplicitNodeAppliesToHostOnlyLoads) {
  TempDir dir;
  const Written w = write_model(dir, 5);
  FakeSysfs sysfs;
  sysfs.add_node(0, "0-3\n");
  sysfs.add_node(1, "4-7\n");
  NumaCountingEnv env(std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  LoadOptions o = small_blocks(&sysfs);
  {
    Loader automatic(o, nullptr, &env);  // kNumaAuto without a device: nothing to be near
    EXPECT_FALSE(automatic.numa_placement().active());
    expect_bytes_equal_file(automatic.load({w.path}), w, nullptr);
    EXPECT_EQ(env.numa_calls(), 0u);
  }
  o.numa.node = 0;
  Loader loader(o, nullptr, &env);
  const Checkpoint checkpoint = open_checkpoint(&env, {w.path});
  env.clear_reads();
  expect_bytes_equal_file(loader.load(checkpoint), w, nullptr);
  ASSERT_EQ(env.binds().size(), loader.pool()->stats().os_reservations);
  for (const auto& bind : env.binds()) EXPECT_EQ(bind.node, 0);
  ASSERT_FALSE(env.reads().empty());
  for (const auto& read : env.reads()) EXPECT_EQ(read.pinned_to, (std::vector<int>{0, 1, 2, 3}));
  o.numa.node = 2;
  EXPECT_THROW(Loader(o, nullptr, &env), InvalidArgumentError);
}

// What auto does when sysfs does not say, or says nonsense: no placement, no
// Env call, a load that still works. An explicit node still fails loudly.
TEST(NumaLoad, UnknownOrMalformedSysfsIsANoOpUnderAuto) {
  TempDir dir;
  const Written w = write_model(dir, 6);
  struct Case {
    const char* what;
    const char* cpulist1;
    const char* numa_node;  // null: no sysfs entry for the device
    bool explicit_fails;
  };
  for (const Case& c : {Case{"no PCI entry", "4-7\n", nullptr, false}, Case{"numa_node -1", "4-7\n", "-1\n", false},
                        Case{"malformed numa_node", "4-7\n", "node1\n", false},
                        Case{"malformed cpulist", "4-x\n", "1\n", true}}) {
    SCOPED_TRACE(c.what);
    FakeSysfs sysfs;
    sysfs.add_node(0, "0-3\n");
    sysfs.add_node(1, c.cpulist1);
    if (c.numa_node != nullptr) sysfs.add_pci_device("0000:3b:00.0", c.numa_node);
    auto device = make_sim_device(SimDeviceOptions{.pci_bus_id = "0000:3b:00.0"});
    NumaCountingEnv env(std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
    LoadOptions o = small_blocks(&sysfs);
    o.target.device = device.get();
    Loader loader(o, nullptr, &env);
    EXPECT_FALSE(loader.numa_placement().active());
    expect_bytes_equal_file(loader.load({w.path}), w, device.get());
    EXPECT_EQ(env.numa_calls(), 0u);
    o.numa.node = 1;
    if (c.explicit_fails) {
      EXPECT_THROW(Loader(o, nullptr, &env), InvalidFileError);
    } else {
      EXPECT_EQ(Loader(o, nullptr, &env).numa_placement().node, 1);
    }
  }
}

TEST(NumaLoad, NoneTurnsPlacementOff) {
  FakeSysfs sysfs;
  sysfs.add_node(0, "0-3\n");
  sysfs.add_node(1, "4-7\n");
  auto device = make_sim_device(SimDeviceOptions{.numa_node = 1});
  NumaCountingEnv env(std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  LoadOptions o = small_blocks(&sysfs);
  o.target.device = device.get();
  o.numa.node = kNumaNone;
  TempDir dir;
  const Written w = write_model(dir, 7);
  Loader loader(o, nullptr, &env);
  EXPECT_FALSE(loader.numa_placement().active());
  expect_bytes_equal_file(loader.load({w.path}), w, device.get());
  EXPECT_EQ(env.numa_calls(), 0u);
}

}  // namespace
}  // namespace pinload
