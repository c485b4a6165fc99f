// pinload::Session (Note [Sessions] in pinload/session.h): one device and one
// pool per device and budget, shared by the loaders it makes; its loads'
// bytes are the files'.
#include "pinload/session.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "file_check.h"
#include "pinload/error.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::FileImage;
using testing::TempDir;

LoadOptions host_options() {
  LoadOptions o;
  o.threads = 2;
  o.block_size = 64 << 10;
  o.zero_copy = ZeroCopy::kOff;  // read into the session's pool
  o.direct = DirectIo::kOff;
  return o;
}

TEST(SessionTest, OneDeviceAndOnePoolPerDeviceAndBudget) {
  Session session;
  EXPECT_EQ(session.device("cpu"), nullptr);
  Device* sim = session.device("sim");
  ASSERT_NE(sim, nullptr);
  EXPECT_EQ(session.device("sim"), sim);
  EXPECT_EQ(sim->kind(), DeviceKind::kSim);
  EXPECT_THROW(session.device("tpu:3"), InvalidArgumentError);

  EXPECT_EQ(session.pool("cpu"), session.pool("cpu"));
  EXPECT_NE(session.pool("cpu"), session.pool("sim"));
  EXPECT_NE(session.pool("cpu"), session.pool("cpu", 64 << 20));
  EXPECT_EQ(session.pool("cpu", 64 << 20)->options().capacity_bytes, 64u << 20);
  EXPECT_THROW(session.staging_pool("cpu", 64 << 20), InvalidArgumentError);
  EXPECT_EQ(session.staging_pool("sim", 64 << 20), session.staging_pool("sim", 64 << 20));
}

TEST(SessionTest, LoadersShareTheSessionsPools) {
  Session session;
  LoadOptions o = host_options();
  const Loader a = session.loader("cpu", o);
  const Loader b = session.loader("cpu", o);
  EXPECT_EQ(a.pool(), b.pool());
  EXPECT_EQ(a.pool(), session.pool("cpu"));
  o.pool_bytes = 32 << 20;
  EXPECT_EQ(session.loader("cpu", o).pool(), session.pool("cpu", 32 << 20));

  LoadOptions streaming = host_options();
  streaming.target.mode = DeviceMode::kStreaming;
  streaming.target.staging_bytes = 16 << 20;
  const Loader c = session.loader("sim", streaming);
  EXPECT_EQ(c.options().target.device, session.device("sim"));
  EXPECT_EQ(c.pool(), session.pool("sim"));
  EXPECT_EQ(c.staging_pool(), session.staging_pool("sim", 16 << 20));
  EXPECT_EQ(session.loader("sim", streaming).staging_pool(), c.staging_pool());
  EXPECT_EQ(Session::process().device("sim"), Session::process().device("sim"));
  EXPECT_NE(Session::process().device("sim"), session.device("sim"));  // a session of its own
}

TEST(SessionTest, ALoadThroughTheSessionHasTheFilesBytesAndALaterOneReusesItsMemory) {
  TempDir dir;
  std::mt19937_64 rng(7);
  const std::string path = dir.file("model.safetensors");
  const FileImage image = testing::write_random_checkpoint(path, rng, 12, 50'000);
  Session session;
  {
    LoadHandle handle = session.start("cpu", host_options(), {path});
    testing::expect_matches_file(handle.wait(), path, image);
  }
  const std::uint64_t reservations = session.pool("cpu")->stats().os_reservations;
  EXPECT_GT(reservations, 0u);
  // Another loader of the same session: the memory the first load gave back.
  const StateDict again = session.loader("cpu", host_options()).load(session.open({path}));
  testing::expect_matches_file(again, path, image);
  EXPECT_EQ(session.pool("cpu")->stats().os_reservations, reservations);
}

}  // namespace
}  // namespace pinload
