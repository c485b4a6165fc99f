// The write half of the Env (open_write, pwrite through write_full, fsync,
// rename) under faults, for every writer: a manifest and a template
// (write_file_atomically: Note [Atomic writes] in env.h) and a converted
// checkpoint (convert_checkpoint). A table of write faults runs against each:
// a failed open, write, fsync or rename is a typed error naming the file,
// leaves the target as it was (here: an older version of it) and no
// temporary beside it, and no descriptor open; short writes and EINTR are
// retried and change nothing in what is written.
#include <gtest/gtest.h>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fault_env.h"
#include "os/read_full.h"
#include "pinload/checkpoint.h"
#include "pinload/convert.h"
#include "pinload/error.h"
#include "pinload/io_template.h"
#include "pinload/manifest.h"
#include "test_files.h"

namespace pinload::testing {
namespace {

struct WriteFault {
  std::string name;
  Faults faults;
  bool fails;
};

std::vector<WriteFault> write_fault_table() {
  return {
      {"none", Faults{}, false},
      {"short_writes_and_eintr", Faults{.eintr_every_other = true, .short_write_bytes = 7}, false},
      {"open_for_write_fails", Faults{.refuse_open_write = true}, true},
      {"first_write_fails", Faults{.fail_write_at = 1}, true},
      {"a_later_write_fails", Faults{.fail_write_at = 3, .short_write_bytes = 5}, true},
      {"fsync_fails", Faults{.refuse_sync = true}, true},
      {"rename_fails", Faults{.refuse_rename = true}, true},
  };
}

// A writer: writes `target` (whose folder holds the checkpoint `input`) through `env`.
struct Writer {
  std::string name;
  std::string target_name;
  std::function<void(Env* env, const std::string& input, const std::string& target)> write;
};

std::vector<Writer> writers() {
  return {
      {"manifest", "model.manifest.json",
       [](Env* env, const std::string& input, const std::string& target) {
         save_manifest(make_manifest({input}), target, env);
       }},
      {"template", "model.pltemplate",
       [](Env* env, const std::string& input, const std::string& target) {
         save_template(template_files_of(open_checkpoint(default_env(), {input})), target, env);
       }},
      {"convert", "model.fp8.safetensors",
       [](Env* env, const std::string& input, const std::string& target) {
         ConvertOptions options;
         options.threads = 2;
         (void)convert_checkpoint(input, target, options, env);
       }},
  };
}

std::vector<std::string> folder_names(const std::string& folder) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(folder)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class WriteFaultsTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(WriteFaultsTest, FailsTypedAndLeavesNothingHalfWritten) {
  const Writer writer = writers()[static_cast<std::size_t>(std::get<0>(GetParam()))];
  const WriteFault fault = write_fault_table()[static_cast<std::size_t>(std::get<1>(GetParam()))];
  TempDir dir;
  const std::string input = dir.file("model.safetensors");
  std::mt19937_64 rng(7);
  write_file(input, make_image({{"a.weight", "F32", {64, 48}}, {"b.bias", "F32", {48}}, {"c.weight", "BF16", {32, 32}}},
                               rng)
                        .bytes());
  // What a clean write gives, written beside (the reference for a write that survives its faults).
  const std::string clean = dir.file("clean." + writer.target_name);
  writer.write(default_env(), input, clean);
  const std::vector<std::uint8_t> expected = read_file(clean);
  std::filesystem::remove(clean);
  // An older version at the target, which a failed write must leave as it was.
  const std::string target = dir.file(writer.target_name);
  const std::vector<std::uint8_t> old = {'o', 'l', 'd'};
  write_file(target, old);
  const std::vector<std::string> before = folder_names(dir.path().string());

  FaultEnv env(fault.faults);
  if (fault.fails) {
    try {
      writer.write(&env, input, target);
      FAIL() << "the write succeeded";
    } catch (const Error& e) {
      EXPECT_TRUE(e.code() == ErrorCode::kIo || e.code() == ErrorCode::kNotFound) << e.what();
      EXPECT_NE(std::string(e.what()).find(writer.target_name), std::string::npos) << e.what();
    }
    EXPECT_EQ(read_file(target), old);
  } else {
    writer.write(&env, input, target);
    EXPECT_EQ(read_file(target), expected);
    if (fault.faults.short_write_bytes != 0) {
      EXPECT_GT(env.writes(), expected.size() / 7);
    }
  }
  EXPECT_EQ(folder_names(dir.path().string()), before);  // no temporary left beside it
  EXPECT_EQ(env.open_fds(), 0);
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
  return writers()[static_cast<std::size_t>(std::get<0>(info.param))].name + "_" +
         write_fault_table()[static_cast<std::size_t>(std::get<1>(info.param))].name;
}

INSTANTIATE_TEST_SUITE_P(Writers, WriteFaultsTest,
                         ::testing::Combine(::testing::Range(0, 3), ::testing::Range(0, 7)), case_name);

// write_full: EINTR, EAGAIN and short writes are retried; a write of nothing is EIO.
TEST(WriteFullTest, RetriesAndReportsWhatWasWritten) {
  class ZeroAfterEnv : public EnvWrapper {
   public:
    using EnvWrapper::EnvWrapper;
    std::int64_t pwrite(int fd, const void* buffer, std::size_t bytes, std::uint64_t offset) override {
      if (++calls == 1) return -EAGAIN;
      if (offset >= 10) return 0;
      return EnvWrapper::pwrite(fd, buffer, std::min<std::size_t>(bytes, 3), offset);
    }
    int calls = 0;
  } env(default_env());
  TempDir dir;
  const std::string path = dir.file("out");
  const int fd = env.open_write(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  const std::string text = "0123456789abcdef";
  const WriteResult r = write_full(&env, fd, text.data(), text.size(), 0);
  EXPECT_EQ(r.bytes, 12u);  // 3 bytes at a time, up to the first write at or past offset 10
  EXPECT_EQ(r.error, EIO);
  env.close(fd);
  const std::vector<std::uint8_t> got = read_file(path);
  EXPECT_EQ(std::string(got.begin(), got.end()), text.substr(0, 12));
}

}  // namespace
}  // namespace pinload::testing
