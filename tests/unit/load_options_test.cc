// LoadOptions::validate (the one check of a load's options), the size parser
// (pinload/size.h) and the spellings of DirectIo and CachedRead.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <string>

#include "pinload/dtype.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "pinload/size.h"

namespace pinload {
namespace {

// The InvalidArgumentError `options` fails with ("" when it passes).
std::string failure(const LoadOptions& options) {
  try {
    options.validate();
    return "";
  } catch (const InvalidArgumentError& e) {
    return e.message();
  }
}

TEST(LoadOptionsValidate, DefaultsPass) {
  EXPECT_EQ(failure(LoadOptions{}), "");
  LoadOptions edges;
  edges.threads = kMaxThreads;
  edges.block_size = kMinBlockSize;
  edges.target.copy.streams = kMaxCopyStreams;
  edges.resident_threshold = 2.0;  // "never cached" (tests use it)
  EXPECT_EQ(failure(edges), "");
  edges.block_size = kMaxBlockSize;
  edges.threads = 1;
  edges.target.copy.streams = 1;
  EXPECT_EQ(failure(edges), "");
}

TEST(LoadOptionsValidate, EachOptionOutOfRangeIsNamedWithItsValue) {
  struct Case {
    void (*set)(LoadOptions&);
    const char* message;
  };
  const Case cases[] = {
      {[](LoadOptions& o) { o.threads = 0; }, "threads must be 1..1024, not 0"},
      {[](LoadOptions& o) { o.threads = 1025; }, "threads must be 1..1024, not 1025"},
      {[](LoadOptions& o) { o.block_size = 4095; }, "block_size must be 4 KiB..1 GiB, not 4095"},
      {[](LoadOptions& o) { o.block_size = (1u << 30) + 1; }, "block_size must be 4 KiB..1 GiB, not 1073741825"},
      {[](LoadOptions& o) { o.files_in_flight = 0; }, "files_in_flight must be >= 1, not 0"},
      {[](LoadOptions& o) { o.target.copy.streams = 0; }, "streams must be 1..64, not 0"},
      {[](LoadOptions& o) { o.target.copy.streams = 65; }, "streams must be 1..64, not 65"},
      {[](LoadOptions& o) { o.target.copy.chunk_bytes = 0; }, "chunk_bytes must be > 0, not 0"},
      {[](LoadOptions& o) { o.resident_threshold = -0.5; }, "resident_threshold must be >= 0, not -0.500000"},
      {[](LoadOptions& o) {
         o.target.mode = DeviceMode::kStreaming;
         o.target.staging_bytes = 0;
       },
       "staging_bytes must be > 0, not 0"},
  };
  for (const Case& c : cases) {
    LoadOptions o;
    c.set(o);
    EXPECT_EQ(failure(o), c.message);
  }
  LoadOptions nan;
  nan.resident_threshold = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NE(failure(nan).find("resident_threshold"), std::string::npos);
}

// The Loader checks instead of clamping: a value that fails validate() is an
// error, never silently raised to the minimum.
TEST(LoadOptionsValidate, KeepWithoutADtypeIsRefused) {
  LoadOptions o;
  o.dtype.keep = {"norm"};
  EXPECT_NE(failure(o).find("keep"), std::string::npos);
  o.dtype.keep.clear();
  o.dtype.keep_to = DType::kF32;
  EXPECT_NE(failure(o).find("keep"), std::string::npos);
  o.dtype.to = DType::kBF16;
  o.dtype.keep = {"norm"};
  EXPECT_EQ(failure(o), "");
}

TEST(LoadOptionsValidate, TheLoaderRefusesWhatFailsInsteadOfClamping) {
  LoadOptions o;
  o.threads = 0;
  EXPECT_THROW(Loader{o}, InvalidArgumentError);
  o = LoadOptions{};
  o.block_size = 512;
  EXPECT_THROW(Loader{o}, InvalidArgumentError);
  o = LoadOptions{};
  o.target.mode = DeviceMode::kStreaming;  // without a device
  try {
    Loader loader(o);
    ADD_FAILURE() << "streaming without a device accepted";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("staging_bytes"), std::string::npos) << e.what();
  }
}

TEST(LoadOptionsReadOptions, HandsTheReadersTheirFields) {
  const ReadOptions defaults = LoadOptions{}.read_options();
  EXPECT_EQ(defaults.block_size, kDefaultBlockSize);
  EXPECT_EQ(defaults.direct, DirectIo::kAuto);
  EXPECT_EQ(defaults.files_in_flight, kDefaultFilesInFlight);
  EXPECT_EQ(defaults.resident_threshold, kDefaultResidentThreshold);
  EXPECT_EQ(defaults.cached_read, CachedRead::kAuto);
  EXPECT_EQ(defaults.remote, RemoteOptions{});

  LoadOptions o;
  o.block_size = 64u << 10;
  o.direct = DirectIo::kOff;
  o.files_in_flight = 5;
  o.resident_threshold = 0.25;
  o.cached_read = CachedRead::kPread;
  o.resolve.remote.connections = 3;
  o.resolve.remote.cache_dir = "/tmp/cache";
  const ReadOptions r = o.read_options();
  EXPECT_EQ(r.block_size, 64u << 10);
  EXPECT_EQ(r.direct, DirectIo::kOff);
  EXPECT_EQ(r.files_in_flight, 5u);
  EXPECT_EQ(r.resident_threshold, 0.25);
  EXPECT_EQ(r.cached_read, CachedRead::kPread);
  EXPECT_EQ(r.remote, o.resolve.remote);
}

TEST(ParseSize, TheSpellingsItTakes) {
  EXPECT_EQ(parse_size("0"), 0u);
  EXPECT_EQ(parse_size("4096"), 4096u);
  for (const char* k : {"64K", "64k", "64KiB"}) EXPECT_EQ(parse_size(k), 64u << 10) << k;
  for (const char* m : {"8M", "8m", "8MiB"}) EXPECT_EQ(parse_size(m), 8u << 20) << m;
  for (const char* g : {"2G", "2g", "2GiB"}) EXPECT_EQ(parse_size(g), std::uint64_t{2} << 30) << g;
  EXPECT_EQ(parse_size("18446744073709551615"), std::numeric_limits<std::uint64_t>::max());
}

TEST(ParseSize, EverythingElseIsNotASize) {
  for (const char* bad : {"", "K", "x", "2Q", "-1", "+1", " 1", "1 ", "1 K", "1.5M", "1kib", "1KB", "0x10",
                          "18446744073709551616", "17179869184G", "16777216T"}) {
    EXPECT_FALSE(parse_size(bad).has_value()) << "'" << bad << "'";
  }
  try {
    parse_size_option("lots", "--block-size");
    ADD_FAILURE() << "no throw";
  } catch (const InvalidArgumentError& e) {
    EXPECT_EQ(e.message(), "--block-size: not a size: 'lots' (bytes, or a number with K, M or G)");
  }
}

TEST(Spellings, DirectAndCachedReadRoundTrip) {
  for (DirectIo d : {DirectIo::kAuto, DirectIo::kOn, DirectIo::kOff}) EXPECT_EQ(parse_direct_io(direct_io_name(d)), d);
  for (CachedRead c : {CachedRead::kAuto, CachedRead::kMap, CachedRead::kPread}) {
    EXPECT_EQ(parse_cached_read(cached_read_name(c)), c);
  }
  EXPECT_FALSE(parse_direct_io("yes").has_value());
  EXPECT_FALSE(parse_cached_read("mmap").has_value());
}

// One table of conversion dtype spellings (dtype.h), read by the CLI's --dtype
// and Python's dtype=.
TEST(ConversionDTypeSpellings, EverySpellingParsesAndNothingElse) {
  std::set<DType> seen;
  for (const DTypeSpelling& s : conversion_dtype_spellings()) {
    EXPECT_EQ(parse_conversion_dtype(s.text), s.dtype) << s.text;
    seen.insert(s.dtype);
  }
  EXPECT_EQ(seen, (std::set<DType>{DType::kBF16, DType::kF16, DType::kF32}));
  EXPECT_EQ(parse_conversion_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(parse_conversion_dtype("half"), DType::kF16);
  for (const char* bad : {"", "BFLOAT16", "f32", "F8_E4M3", "torch.float32", "int8"}) {
    EXPECT_EQ(parse_conversion_dtype(bad), std::nullopt) << bad;
  }
}

}  // namespace
}  // namespace pinload
