// The byte-source fault table (tests/support/source_faults.h) on local files:
// read direct, buffered with pread, and copied from their mappings; the
// faults injected into the source (FaultSource) and below it (FaultEnv). The
// same table runs on remote objects in tests/remote/test_source_faults.py.
#include <gtest/gtest.h>

#include <random>
#include <tuple>

#include "fault_env.h"
#include "file_check.h"
#include "base/sha256.h"
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

// The table's checkpoint: 32 tensors, several chunks of every row's block size.
struct TableModel {
  TempDir dir;
  std::string path = dir.file("m.safetensors");
  FileImage image;
  TableModel() {
    std::mt19937_64 rng(41);
    image = write_random_checkpoint(path, rng, 32, 1u << 16);
  }
};

class SourceFaultsTest : public ::testing::TestWithParam<std::tuple<Reads, std::size_t>> {};

TEST_P(SourceFaultsTest, TypedErrorNoLeakOrTheFilesBytes) {
  const auto [reads, index] = GetParam();
  const SourceFault& fault = source_faults().at(index);
  const TableModel model;
  const std::string& path = model.path;
  const FileImage& image = model.image;
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

// The direct rows read direct, where the filesystem allows it.
TEST(SourceFaultsDirect, TheCleanDirectRowReadsDirect) {
  const SourceFault& clean = source_faults().at(0);
  ASSERT_EQ(clean.kind, SourceFaultKind::kNone);
  const TableModel model;
  const std::string& path = model.path;
  if (!direct_io_works(path)) GTEST_SKIP() << "this filesystem refuses O_DIRECT";
  const FaultOutcome outcome = load_with_fault(path, options_for(Reads::kDirect), clean);
  EXPECT_GT(outcome.direct_reads, 0u);
  EXPECT_EQ(outcome.direct_reads, outcome.reads);
}

// The same table with each fault injected below the source, into the OS
// calls it makes (FaultEnv): the sources' own error paths, fallbacks and
// cleanup. A failing read is the file cut short at the target byte; a failing
// open, every open refused; a mapping that serves nothing, every populate
// failing.
class SourceFaultsBelowTest : public ::testing::TestWithParam<std::tuple<Reads, std::size_t>> {};

TEST_P(SourceFaultsBelowTest, TypedErrorNoLeakOrTheFilesBytes) {
  const auto [reads, index] = GetParam();
  const SourceFault& fault = source_faults().at(index);
  const TableModel model;
  const std::string& path = model.path;
  const FileImage& image = model.image;
  Faults faults;
  switch (fault.kind) {
    case SourceFaultKind::kNone: break;
    case SourceFaultKind::kReadFails: faults.truncate_to = fault_target_byte(path, options_for(reads), fault.where); break;
    case SourceFaultKind::kOpenFails: faults.refuse_open = true; break;
    case SourceFaultKind::kMappingFails: faults.populate_errno = EIO; break;
  }
  FaultEnv env(faults);
  const SourceFault passthrough{"passthrough", SourceFaultKind::kNone, fault.where};
  FaultOutcome outcome = load_with_fault(path, options_for(reads), passthrough, &env);
  outcome.injected = fault.kind == SourceFaultKind::kNone ? 0 : 1;  // by the env
  outcome.cut_at_target = true;
  EXPECT_EQ(judge(outcome, fault, path, independent_digests(path, image)), "") << fault.name << ", " << reads_name(reads);
  EXPECT_EQ(env.open_fds(), 0);
  EXPECT_EQ(env.file_mapped_bytes(), 0);
  if (fault.kind == SourceFaultKind::kMappingFails && reads == Reads::kMapped) {
    EXPECT_GT(env.populates(), 0u);
    EXPECT_GT(outcome.reads, 0u) << "what the mapping could not serve was read";
  }
  if (reads == Reads::kDirect && fault.kind == SourceFaultKind::kNone && direct_io_works(path)) {
    EXPECT_GT(env.direct_opens(), 0u);
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
  FaultOutcome cut = o;
  cut.cut_at_target = true;
  cut.target_byte = 100;
  EXPECT_EQ(judge(cut, middle, "/m", {}), "");
  cut.target_byte = 150;
  EXPECT_NE(judge(cut, middle, "/m", {}), "") << "a range starting before the cut";
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
INSTANTIATE_TEST_SUITE_P(Table, SourceFaultsBelowTest,
                         ::testing::Combine(::testing::Values(Reads::kDirect, Reads::kBuffered, Reads::kMapped),
                                            ::testing::Range<std::size_t>(0, source_faults().size())),
                         case_name);

}  // namespace
}  // namespace pinload::testing
