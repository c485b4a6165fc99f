// Session::start(Request) (Note [Requests] in pinload/request.h): each kind of
// request, as a table row, against the independent reader and the kind's
// own entry point.
#include "pinload/request.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fault_env.h"
#include "file_check.h"
#include "pinload/error.h"
#include "pinload/session.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::FaultEnv;
using testing::Faults;
using testing::FileImage;
using testing::TempDir;

LoadOptions host_options() {
  LoadOptions o;
  o.threads = 2;
  o.block_size = 64 << 10;
  o.zero_copy = ZeroCopy::kOff;  // read into the session's pool
  o.direct = DirectIo::kOff;
  o.cached_read = CachedRead::kPread;  // every byte read is a pread the FaultEnv counts
  return o;
}

struct Model {
  std::string path;
  FileImage image;
};

Model write_model(const TempDir& dir, const std::string& name, unsigned seed) {
  std::mt19937_64 rng(seed);
  const std::string path = dir.file(name);
  FileImage image = testing::write_random_checkpoint(path, rng, 12, 1u << 14);
  return {path, std::move(image)};
}

Request request(RequestKind kind, std::vector<std::string> paths, std::string device = "cpu") {
  Request r;
  r.kind = kind;
  r.device = std::move(device);
  r.paths = std::move(paths);
  r.options = host_options();
  return r;
}

TEST(RequestTest, KindNames) {
  std::set<std::string> names;
  for (RequestKind k : {RequestKind::kWhole, RequestKind::kStream, RequestKind::kPrefetch, RequestKind::kBatch,
                        RequestKind::kShard, RequestKind::kCached}) {
    names.insert(request_kind_name(k));
  }
  EXPECT_EQ(names, (std::set<std::string>{"whole", "stream", "prefetch", "batch", "shard", "cached"}));
}

TEST(RequestTest, WholeHandsOutEveryTensorFromWaitAndNext) {
  TempDir dir;
  const Model m = write_model(dir, "a.safetensors", 1);
  Session session;
  RequestHandle h = session.start(request(RequestKind::kWhole, {m.path}));
  EXPECT_EQ(h.kind(), RequestKind::kWhole);
  std::size_t seen = 0;
  for (std::vector<Tensor> ready = h.next(); !ready.empty(); ready = h.next()) seen += ready.size();
  const StateDict sd = h.wait();
  EXPECT_EQ(seen, sd.size());
  testing::expect_matches_file(sd, m.path, m.image);
  EXPECT_TRUE(h.done());
  EXPECT_EQ(h.progress().bytes_done, h.progress().bytes_total);
  EXPECT_THROW(h.wait_batch(), InvalidArgumentError);
}

TEST(RequestTest, StreamHandsOutThroughNextOnly) {
  TempDir dir;
  const Model m = write_model(dir, "a.safetensors", 2);
  Session session;
  RequestHandle h = session.start(request(RequestKind::kStream, {m.path}));
  std::vector<Tensor> all;
  for (std::vector<Tensor> ready = h.next(); !ready.empty(); ready = h.next()) all.insert(all.end(), ready.begin(), ready.end());
  testing::expect_matches_file(StateDict(all), m.path, m.image);
  EXPECT_TRUE(h.wait().empty());
}

TEST(RequestTest, AWholeRequestAdoptsTheSessionsPrefetchAndReadsNothingAgain) {
  TempDir dir;
  const Model m = write_model(dir, "a.safetensors", 3);
  FaultEnv env(Faults{});
  Session session(&env);
  RequestHandle p = session.start(request(RequestKind::kPrefetch, {m.path}));
  EXPECT_TRUE(p.next().empty());
  EXPECT_TRUE(p.wait().empty());
  EXPECT_TRUE(p.done());
  const std::uint64_t read_by_prefetch = env.bytes_read();
  EXPECT_GE(read_by_prefetch, m.image.data.size());
  RequestHandle w = session.start(request(RequestKind::kWhole, {m.path}));
  const StateDict sd = w.wait();
  testing::expect_matches_file(sd, m.path, m.image);
  EXPECT_EQ(env.bytes_read(), read_by_prefetch) << "the whole request adopted the prefetch's reads";
  // Adopted once: the next whole request reads again.
  RequestHandle again = session.start(request(RequestKind::kWhole, {m.path}));
  testing::expect_matches_file(again.wait(), m.path, m.image);
  EXPECT_GT(env.bytes_read(), read_by_prefetch);
}

TEST(RequestTest, ADroppedPrefetchHandleLeavesThePrefetchToTheSession) {
  TempDir dir;
  const Model m = write_model(dir, "a.safetensors", 8);
  Faults slow;
  slow.read_delay_us = 20000;  // still reading when the handle goes
  FaultEnv env(slow);
  Session session(&env);
  session.start(request(RequestKind::kPrefetch, {m.path}));  // the handle goes at once
  // A cancelled prefetch would stop short of the data; this one reads it all.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (env.bytes_read() < m.image.data.size() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(env.bytes_read(), m.image.data.size());
  const std::uint64_t read_by_prefetch = env.bytes_read();
  testing::expect_matches_file(session.start(request(RequestKind::kWhole, {m.path})).wait(), m.path, m.image);
  EXPECT_LE(env.bytes_read(), read_by_prefetch + 8 + m.image.header_json.size()) << "adopted: only the header again";
}

TEST(RequestTest, BatchGivesOneItemPerPathAndAPathsErrorIsItsOwn) {
  TempDir dir;
  const Model a = write_model(dir, "a.safetensors", 4);
  const Model b = write_model(dir, "b.safetensors", 5);
  Session session;
  RequestHandle h = session.start(request(RequestKind::kBatch, {a.path, dir.file("missing.safetensors"), b.path}));
  EXPECT_THROW(h.wait(), InvalidArgumentError);
  const std::vector<BatchItem> items = h.wait_batch();
  ASSERT_EQ(items.size(), 3u);
  ASSERT_TRUE(items[0].ok());
  testing::expect_matches_file(items[0].state, a.path, a.image);
  EXPECT_FALSE(items[1].ok());
  EXPECT_THROW(std::rethrow_exception(items[1].error), NotFoundError);
  ASSERT_TRUE(items[2].ok());
  testing::expect_matches_file(items[2].state, b.path, b.image);
}

TEST(RequestTest, ShardHasTheRanksPartsAsShardLoadHasThem) {
  TempDir dir;
  const Model m = write_model(dir, "a.safetensors", 6);
  Session session;
  Request r = request(RequestKind::kShard, {m.path});
  r.shard.rank = 1;
  r.shard.world_size = 2;
  RequestHandle h = session.start(r);
  const StateDict sd = h.wait();
  const StateDict reference = load_shard({m.path}, r.shard);
  ASSERT_EQ(sd.size(), reference.size());
  ASSERT_GT(sd.size(), 0u);
  for (const Tensor& t : reference) {
    const Tensor* got = sd.find(t.name());
    ASSERT_NE(got, nullptr) << t.name();
    EXPECT_EQ(got->shape(), t.shape()) << t.name();
    EXPECT_TRUE(std::equal(got->bytes().begin(), got->bytes().end(), t.bytes().begin(), t.bytes().end())) << t.name();
  }
  EXPECT_THROW(session.start(request(RequestKind::kShard, {m.path}, "sim")), InvalidArgumentError);
}

TEST(RequestTest, CachedReadsOnceAndAHitReadsNothing) {
  TempDir dir;
  const Model m = write_model(dir, "a.safetensors", 7);
  FaultEnv env(Faults{});
  Session session(&env);
  Request r = request(RequestKind::kCached, {m.path});
  r.cache_bytes = 64 << 20;
  RequestHandle first = session.start(r);
  const StateDict host = first.wait();
  testing::expect_matches_file(host, m.path, m.image);
  const std::uint64_t read_once = env.bytes_read();
  EXPECT_GE(read_once, m.image.data.size());
  RequestHandle hit = session.start(r);
  std::vector<Tensor> all = hit.next();
  EXPECT_TRUE(hit.next().empty());
  testing::expect_matches_file(StateDict(all), m.path, m.image);
  EXPECT_EQ(env.bytes_read(), read_once) << "a hit reads nothing";
  // On a device: the host copy uploaded, the device's bytes the file's.
  Request on_sim = r;
  on_sim.device = "sim";
  RequestHandle uploaded = session.start(on_sim);
  const StateDict sd = uploaded.wait();
  ASSERT_EQ(sd.size(), host.size());
  for (const Tensor& t : sd) {
    ASSERT_TRUE(t.on_device()) << t.name();
    const Tensor& h = host.at(t.name());
    EXPECT_EQ(std::memcmp(t.device_data(), h.data(), h.nbytes()), 0) << t.name();  // the stand-in's memory is the host's
  }
  EXPECT_EQ(env.bytes_read(), read_once);
}

TEST(RequestTest, ARequestWithoutPathsIsRefused) {
  Session session;
  EXPECT_THROW(session.start(request(RequestKind::kWhole, {})), InvalidArgumentError);
}

TEST(RequestTest, AFailedLoadThrowsFromWaitAndNext) {
  TempDir dir;
  Session session;
  RequestHandle h = session.start(request(RequestKind::kWhole, {dir.file("missing.safetensors")}));
  EXPECT_THROW(h.wait(), NotFoundError);
  RequestHandle c = session.start(request(RequestKind::kCached, {dir.file("missing.safetensors")}));
  EXPECT_THROW(c.next(), NotFoundError);
}

}  // namespace
}  // namespace pinload
