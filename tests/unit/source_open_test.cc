// The one place that opens a byte source (Note [Byte sources] in
// byte_source.h), seen from its callers: a header read of a remote object
// is made with the caller's RemoteOptions, not the defaults.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>

#include "pinload/checkpoint.h"
#include "pinload/error.h"
#include "pinload/remote.h"
#include "test_files.h"

namespace pinload::testing {
namespace {

// No server listens on port 1 of the loopback: the header read fails at
// once. The caller's options say no retries and a cache folder, which the
// remote client made for them creates: with the defaults (5 retries from
// 100 ms) the read would take seconds and create no folder.
TEST(SourceOpenTest, RemoteHeaderReadTakesTheCallersRemoteOptions) {
  TempDir dir;
  RemoteOptions remote;
  remote.retries = 0;
  remote.connect_timeout_s = 2;
  remote.cache_dir = dir.file("remote-cache");
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW((void)read_checkpoint_file(default_env(), "http://127.0.0.1:1/model.safetensors", remote), Error);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(std::filesystem::is_directory(remote.cache_dir)) << "the header read did not use the caller's options";
  EXPECT_LT(took, std::chrono::milliseconds(1500)) << "the header read retried as the default options do";
}

}  // namespace
}  // namespace pinload::testing
