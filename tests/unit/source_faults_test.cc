// The byte-source fault table (tests/support/source_faults.h) on local files:
// read direct, buffered with pread, and copied from their mappings. The same
// table runs on remote objects in tests/remote/test_source_faults.py.
#include <gtest/gtest.h>

#include <random>
#include <tuple>

#include "file_check.h"
#include "load/sha256.h"
#include "source_faults.h"
#include "test_files.h"

namespace pinload::testing {
namespace {

enum class Reads { kDirect, kBuffered, kMapped };

const char* reads_name(Reads r) {
  return r == Reads::kDirect ? "direct" : r == Reads::kBuffered ? "buffered" : "mapped";
}

LoadOptions options_for(Reads reads) {
  LoadOptions o;
  o.threads = 4;
  o.block_size = 16u << 10;
  o.zero_copy = ZeroCopy::kOff;  // a zero-copy load hands out mappings, not reads
  switch (reads) {
    case Reads::kDirect:  // O_DIRECT where the filesystem takes it, never counted as cached
      o.direct = DirectIo::kAuto;
      o.resident_threshold = 2.0;
      o.cached_read = CachedRead::kPread;
      break;
    case Reads::kBuffered:
      o.direct = DirectIo::kOff;
      o.cached_read = CachedRead::kPread;
      break;
    case Reads::kMapped:  // always counted as cached, so always mapped
      o.direct = DirectIo::kOff;
      o.resident_threshold = 0.0;
      o.cached_read = CachedRead::kMap;
      break;
  }
  return o;
}

// The digests of every tensor, from the independent reader (file_check.h).
std::map<std::string, std::string> independent_digests(const std::string& path, const FileImage& image) {
  const std::vector<char> file = slurp(path);
  const std::uint64_t data_begin = file.size() - image.data.size();
  std::map<std::string, std::string> out;
  for (const Layout& t : layout_of(image)) {
    detail::Sha256 sha;
    sha.update(file.data() + data_begin + t.begin, t.end - t.begin);
    out[t.name] = sha.final_hex();
  }
  return out;
}

class SourceFaultsTest : public ::testing::TestWithParam<std::tuple<Reads, std::size_t>> {};

TEST_P(SourceFaultsTest, TypedErrorNoLeakOrTheFilesBytes) {
  const auto [reads, index] = GetParam();
  const SourceFault& fault = source_faults().at(index);
  TempDir dir;
  std::mt19937_64 rng(41);
  const std::string path = dir.file("m.safetensors");
  const FileImage image = write_random_checkpoint(path, rng, 32, 1u << 16);
  ASSERT_GT(image.data.size(), 8 * options_for(reads).block_size) << "several chunks per file";
  const FaultOutcome outcome = load_with_fault(path, options_for(reads), fault);
  EXPECT_EQ(judge(outcome, fault, path, independent_digests(path, image)), "") << fault.name << ", " << reads_name(reads);
  if (fault.kind == SourceFaultKind::kReadFails || fault.kind == SourceFaultKind::kOpenFails) {
    EXPECT_GT(outcome.injected, 0u);
  }
  if (reads == Reads::kMapped && fault.kind == SourceFaultKind::kNone) {
    EXPECT_GT(outcome.mapped_copies, 0u) << "the mapped rows copy from the mapping";
  }
  if (fault.kind == SourceFaultKind::kMappingFails && reads == Reads::kMapped) {
    EXPECT_GT(outcome.refused_copies, 0u);
    EXPECT_GT(outcome.reads, 0u) << "refused ranges are read instead";
  }
}

// A judge that passes everything would pass the table: it must also fail.
TEST(SourceFaultsJudge, FindsWhatIsWrong) {
  const SourceFault& middle = source_faults().at(2);
  ASSERT_EQ(middle.kind, SourceFaultKind::kReadFails);
  FaultOutcome o;
  o.failed = true;
  o.injected = 1;
  o.code = ErrorCode::kIo;
  o.context = ErrorContext{"/m", {}, 100, 200};
  o.target_byte = 150;
  EXPECT_EQ(judge(o, middle, "/m", {}), "");
  FaultOutcome wrong_range = o;
  wrong_range.target_byte = 250;
  EXPECT_NE(judge(wrong_range, middle, "/m", {}), "");
  FaultOutcome wrong_file = o;
  wrong_file.context.file = "/other";
  EXPECT_NE(judge(wrong_file, middle, "/m", {}), "");
  FaultOutcome leaked = o;
  leaked.fds_after = leaked.fds_before + 1;
  EXPECT_NE(judge(leaked, middle, "/m", {}), "");
  FaultOutcome held = o;
  held.pool_in_use_after = 4096;
  EXPECT_NE(judge(held, middle, "/m", {}), "");
  FaultOutcome succeeded;
  EXPECT_NE(judge(succeeded, middle, "/m", {}), "");
  const SourceFault& clean = source_faults().at(0);
  succeeded.digests = {{"a", "1"}};
  EXPECT_EQ(judge(succeeded, clean, "/m", {{"a", "1"}}), "");
  EXPECT_NE(judge(succeeded, clean, "/m", {{"a", "2"}}), "");
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<Reads, std::size_t>>& info) {
  std::string name = std::string(reads_name(std::get<0>(info.param))) + "_" + source_faults().at(std::get<1>(info.param)).name;
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Table, SourceFaultsTest,
                         ::testing::Combine(::testing::Values(Reads::kDirect, Reads::kBuffered, Reads::kMapped),
                                            ::testing::Range<std::size_t>(0, source_faults().size())),
                         case_name);

}  // namespace
}  // namespace pinload::testing
