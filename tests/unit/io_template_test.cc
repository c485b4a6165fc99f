// I/O templates (pinload/io_template.h): recorded from real loads, stored and
// read back, invalidated when a file changes, never trusted when corrupt, and
// replayed as a prefetch plan in their recorded order.
#include "pinload/io_template.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "fault_env.h"
#include "file_check.h"
#include "base/log.h"
#include "pinload/checkpoint.h"
#include "pinload/loader.h"
#include "pinload/prefetch.h"
#include "test_files.h"

namespace pinload {
namespace {

namespace fs = std::filesystem;
using testing::FileImage;
using testing::TempDir;

constexpr std::size_t KiB = 1024;

// Captures pinload's log lines while alive.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) {
    sink_->set_pattern("%l %v");
    log::logger().sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& sinks = log::logger().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  std::string text() const { return out_.str(); }
  bool warned() const { return out_.str().find("warning ") != std::string::npos; }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

// Records the offsets of every pread, in order, per path.
class RecordingEnv : public testing::PathTrackingEnv {
 public:
  RecordingEnv() : PathTrackingEnv(default_env()) {}
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    const std::int64_t n = PathTrackingEnv::pread(fd, buffer, bytes, offset);
    std::lock_guard lock(mu_);
    offsets_.emplace_back(path_of(fd), offset);
    return n;
  }
  std::vector<std::pair<std::string, std::uint64_t>> offsets() const {
    std::lock_guard lock(mu_);
    return offsets_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, std::uint64_t>> offsets_;
};

LoadOptions small_blocks(unsigned threads = 4) {
  LoadOptions o;
  o.threads = threads;
  o.block_size = 16 * KiB;
  o.direct = DirectIo::kOff;
  o.cached_read = CachedRead::kPread;  // reads are recorded at the Env's pread
  return o;
}

struct Fixture {
  TempDir dir;
  std::string a = dir.file("a.safetensors");
  std::string b = dir.file("b.safetensors");
  FileImage image_a, image_b;
  Fixture() {
    std::mt19937_64 rng(5);
    image_a = testing::write_random_checkpoint(a, rng, 12, 20'000, "a.");
    image_b = testing::write_random_checkpoint(b, rng, 7, 9'000, "b.");
  }
  // A template recorded from a real load of both files.
  IoTemplate record(unsigned threads = 4) const {
    IoTemplate t;
    Loader loader(small_blocks(threads));
    LoadRequest request;
    request.record = &t;
    loader.load({a, b}, request);
    return t;
  }
};

TEST(IoTemplate, RecordedLoadCoversEveryFileOnce) {
  Fixture fx;
  const IoTemplate t = fx.record();
  ASSERT_EQ(t.files.size(), 2u);
  EXPECT_EQ(t.files[0].path, fx.a);
  EXPECT_EQ(t.files[1].path, fx.b);
  for (const TemplateFile& f : t.files) {
    EXPECT_EQ(f.size, fs::file_size(f.path));
    EXPECT_NE(f.inode, 0u);
  }
  const TemplateReads* host = t.find(kHostDestination);
  ASSERT_NE(host, nullptr);
  // Per file, the reads tile one range that ends at or past the file's end.
  for (std::uint32_t file = 0; file < 2; ++file) {
    std::vector<TemplateRead> reads;
    for (const TemplateRead& r : host->reads) {
      if (r.file == file) reads.push_back(r);
    }
    ASSERT_FALSE(reads.empty());
    std::sort(reads.begin(), reads.end(), [](auto& x, auto& y) { return x.offset < y.offset; });
    for (std::size_t i = 1; i < reads.size(); ++i) EXPECT_EQ(reads[i].offset, reads[i - 1].offset + reads[i - 1].length);
    EXPECT_GE(reads.back().offset + reads.back().length, t.files[file].size);
    EXPECT_LE(reads.front().offset, 8 + (file == 0 ? fx.image_a : fx.image_b).header_json.size());
  }
}

TEST(IoTemplate, SerializedRoundTripIsExact) {
  Fixture fx;
  IoTemplate t = fx.record();
  t.set(TemplateReads{"sim", {{1, 0, 4096}, {0, 4096, 8192}}});
  const std::vector<std::uint8_t> bytes = serialize_template(t);
  std::string why;
  const std::optional<IoTemplate> back = parse_template(bytes, &why);
  ASSERT_TRUE(back) << why;
  EXPECT_EQ(back->files, t.files);
  ASSERT_EQ(back->destinations.size(), 2u);
  for (const TemplateReads& d : t.destinations) {
    ASSERT_NE(back->find(d.destination), nullptr) << d.destination;
    EXPECT_EQ(back->find(d.destination)->reads, d.reads);
  }
  // Through a file, with the identity check.
  const std::string file = template_path({fx.a, fx.b}, fx.dir.file("templates"));
  save_template(t, file);
  LogCapture log;
  const std::optional<IoTemplate> loaded = load_template(file);
  ASSERT_TRUE(loaded);
  EXPECT_EQ(serialize_template(*loaded), bytes);
  EXPECT_FALSE(log.warned()) << log.text();
}

// Note [Template versions]: readers make version 2; without them the bytes
// are version 1's, which older pinloads read.
TEST(IoTemplate, ReadersMakeVersionTwoWithoutThemVersionOne) {
  IoTemplate t;
  t.files = {TemplateFile{"/m/a", "", 10000, 1, 2, 3}};
  t.set(TemplateReads{"page-cache", {{0, 0, 4096}, {0, 4096, 4096}}});
  const std::vector<std::uint8_t> v1 = serialize_template(t);
  EXPECT_EQ(v1[8], 1);
  // files: 4 + (4 + 4 + 4 + 32); dests: 4 + (4 + 10 + 8 + 2 * 20): version 1's layout exactly.
  EXPECT_EQ(v1.size(), 20u + (4 + 4 + 4 + 4 + 32) + (4 + 4 + 10 + 8 + 2 * 20) + 8);
  t.readers = {TemplateReader{41, "dd", "/usr/bin/dd"}, TemplateReader{42, "python3", ""}};
  t.destinations[0].reads[1].reader = 1;
  t.destinations[0].reads[0].reader = 0;
  t.set(TemplateReads{"host", {{0, 0, 100}}});  // a read without a reader is kept as one
  const std::vector<std::uint8_t> v2 = serialize_template(t);
  EXPECT_EQ(v2[8], 2);
  std::string why;
  const std::optional<IoTemplate> back = parse_template(v2, &why);
  ASSERT_TRUE(back) << why;
  EXPECT_EQ(back->readers, t.readers);
  EXPECT_EQ(back->find("page-cache")->reads, t.find("page-cache")->reads);
  EXPECT_EQ(back->find("host")->reads[0].reader, kNoReader);
  EXPECT_EQ(serialize_template(*back), v2);
  // A reader index past the readers is refused.
  IoTemplate bad = t;
  bad.destinations[0].reads[0].reader = 2;
  EXPECT_FALSE(parse_template(serialize_template(bad), &why));
  EXPECT_NE(why.find("reader 2 of 2"), std::string::npos) << why;
  // Version 2 without readers is not canonical (it would not round-trip): refused.
  std::vector<std::uint8_t> no_readers = v1;
  no_readers[8] = 2;
  const std::size_t dests_at = 20 + (4 + 4 + 4 + 4 + 32);
  no_readers.insert(no_readers.begin() + static_cast<std::ptrdiff_t>(dests_at), {0, 0, 0, 0});
  for (std::size_t i = 0; i < 2; ++i) {  // 4 more bytes per read, reader kNoReader
    const std::size_t end_of_read = dests_at + 4 + (4 + 4 + 10 + 8) + (i + 1) * 20 + i * 4;
    no_readers.insert(no_readers.begin() + static_cast<std::ptrdiff_t>(end_of_read), {0xff, 0xff, 0xff, 0xff});
  }
  const std::uint64_t payload = no_readers.size() - 28;
  for (int i = 0; i < 8; ++i) no_readers[12 + i] = static_cast<std::uint8_t>(payload >> (8 * i));
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i + 8 < no_readers.size(); ++i) h = (h ^ no_readers[i]) * 0x100000001b3ull;
  for (int i = 0; i < 8; ++i) no_readers[no_readers.size() - 8 + i] = static_cast<std::uint8_t>(h >> (8 * i));
  EXPECT_FALSE(parse_template(no_readers, &why));
  EXPECT_NE(why.find("without readers"), std::string::npos) << why;
}

TEST(IoTemplate, MissingTemplateIsNothingWithoutAWarning) {
  TempDir dir;
  LogCapture log;
  EXPECT_FALSE(load_template(dir.file("none.pltemplate")));
  EXPECT_FALSE(log.warned()) << log.text();
}

TEST(IoTemplate, PathsAreStableAndKeyedByThePaths) {
  EXPECT_EQ(template_path({"/m/x"}, "/d"), template_path({"/m/x"}, "/d"));
  EXPECT_EQ(template_path({"/m/x"}, "/d"), template_path({"/m/./x"}, "/d"));
  EXPECT_NE(template_path({"/m/x"}, "/d"), template_path({"/m/y"}, "/d"));
  EXPECT_NE(template_path({"/m/x", "/m/y"}, "/d"), template_path({"/m/y", "/m/x"}, "/d"));
  EXPECT_EQ(fs::path(template_path({"/m/x"}, "/d")).parent_path(), fs::path("/d"));
  const char* old = std::getenv("PINLOAD_CACHE_DIR");
  const std::string saved = old ? old : "";
  ::setenv("PINLOAD_CACHE_DIR", "/some/cache", 1);
  EXPECT_EQ(default_template_dir(), "/some/cache/templates");
  EXPECT_EQ(fs::path(template_path({"/m/x"})).parent_path(), fs::path("/some/cache/templates"));
  if (old) {
    ::setenv("PINLOAD_CACHE_DIR", saved.c_str(), 1);
  } else {
    ::unsetenv("PINLOAD_CACHE_DIR");
  }
}

// ---- invalidation ----

enum class Change { kRewrittenSameSize, kGrown, kReplaced, kTouched, kRemoved };

class TemplateInvalidation : public ::testing::TestWithParam<Change> {};

TEST_P(TemplateInvalidation, AnyFileChangeIgnoresTheTemplateWithAWarning) {
  Fixture fx;
  const std::string file = fx.dir.file("t.pltemplate");
  save_template(fx.record(), file);
  ASSERT_TRUE(load_template(file));
  const auto later = fs::last_write_time(fx.b) + std::chrono::seconds(5);
  switch (GetParam()) {
    case Change::kRewrittenSameSize: {
      std::vector<std::uint8_t> bytes = testing::read_file(fx.b);
      bytes.back() ^= 1;
      testing::write_file(fx.b, bytes);
      fs::last_write_time(fx.b, later);  // a coarse clock must still see it
      break;
    }
    case Change::kGrown: {
      std::vector<std::uint8_t> bytes = testing::read_file(fx.b);
      bytes.push_back(0);
      testing::write_file(fx.b, bytes);
      break;
    }
    case Change::kReplaced: {  // same bytes, same mtime, a new inode
      const auto mtime = fs::last_write_time(fx.b);
      const std::string tmp = fx.dir.file("copy");
      fs::copy_file(fx.b, tmp);
      fs::last_write_time(tmp, mtime);
      fs::rename(tmp, fx.b);
      break;
    }
    case Change::kTouched:
      fs::last_write_time(fx.b, later);
      break;
    case Change::kRemoved:
      fs::remove(fx.b);
      break;
  }
  LogCapture log;
  EXPECT_FALSE(load_template(file));
  EXPECT_TRUE(log.warned()) << log.text();
  EXPECT_NE(log.text().find(fx.b), std::string::npos) << log.text();
}

INSTANTIATE_TEST_SUITE_P(Changes, TemplateInvalidation,
                         ::testing::Values(Change::kRewrittenSameSize, Change::kGrown, Change::kReplaced,
                                           Change::kTouched, Change::kRemoved));

// ---- corrupt template files ----

void put_u32(std::vector<std::uint8_t>& b, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
}
void put_u64(std::vector<std::uint8_t>& b, std::size_t at, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) b[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
}
// Recomputes the trailing checksum, so that a test reaches the checks behind it.
void reseal(std::vector<std::uint8_t>& b) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i + 8 < b.size(); ++i) {
    h ^= b[i];
    h *= 0x100000001b3ull;
  }
  put_u64(b, b.size() - 8, h);
}

// A one-file template with a known layout: the first read's fields sit at
// fixed offsets from the end.
struct Known {
  TempDir dir;
  std::string model = dir.file("m.safetensors");
  std::string file = dir.file("t.pltemplate");
  std::uint64_t size = 0;
  std::vector<std::uint8_t> bytes;
  Known() {
    std::mt19937_64 rng(9);
    testing::write_random_checkpoint(model, rng, 5, 3000);
    size = fs::file_size(model);
    IoTemplate t;
    LoadOptions o = small_blocks(1);
    LoadRequest request;
    request.record = &t;
    Loader(o).load({model}, request);
    // Keep one read only, so the last 28 bytes before the checksum are it.
    t.destinations[0].reads.resize(1);
    bytes = serialize_template(t);
  }
  std::size_t read_at() const { return bytes.size() - 8 - 20; }  // u32 file, u64 offset, u64 length
};

struct Corruption {
  const char* name;
  std::function<void(Known&)> apply;
};

class CorruptTemplate : public ::testing::TestWithParam<Corruption> {};

TEST_P(CorruptTemplate, IsIgnoredWithAWarning) {
  Known k;
  GetParam().apply(k);
  testing::write_file(k.file, k.bytes);
  LogCapture log;
  EXPECT_FALSE(load_template(k.file));
  EXPECT_TRUE(log.warned()) << log.text();
  EXPECT_FALSE(parse_template(k.bytes));
}

const Corruption kCorruptions[] = {
    {"empty", [](Known& k) { k.bytes.clear(); }},
    {"magic_only", [](Known& k) { k.bytes.resize(8); }},
    {"truncated_header", [](Known& k) { k.bytes.resize(19); }},
    {"truncated_half", [](Known& k) { k.bytes.resize(k.bytes.size() / 2); }},
    {"truncated_checksum", [](Known& k) { k.bytes.resize(k.bytes.size() - 1); }},
    {"truncated_resealed", [](Known& k) {
       k.bytes.resize(k.bytes.size() - 12);
       put_u64(k.bytes, 12, k.bytes.size() - 28);
       reseal(k.bytes);
     }},
    {"empty_payload", [](Known& k) {  // found by template_fuzz: counts missing, checksum right
       k.bytes.resize(28);
       put_u64(k.bytes, 12, 0);
       reseal(k.bytes);
     }},
    {"file_of_nearly_2_64_bytes", [](Known& k) {  // found by template_fuzz: offset arithmetic overflowed
       put_u64(k.bytes, 20 + 4 + 4 + k.model.size() + 4, ~0ull - 10000);
       reseal(k.bytes);
     }},
    {"trailing_byte", [](Known& k) { k.bytes.push_back(0); }},
    {"wrong_magic", [](Known& k) { k.bytes[0] = 'X'; reseal(k.bytes); }},
    {"wrong_version", [](Known& k) { put_u32(k.bytes, 8, kTemplateVersion + 1); reseal(k.bytes); }},
    {"version_zero", [](Known& k) { put_u32(k.bytes, 8, 0); reseal(k.bytes); }},
    {"payload_size_lies", [](Known& k) { put_u64(k.bytes, 12, 1ull << 40); reseal(k.bytes); }},
    {"bit_flip_in_payload", [](Known& k) { k.bytes[k.bytes.size() / 2] ^= 0x10; }},
    {"bit_flip_in_checksum", [](Known& k) { k.bytes.back() ^= 0x80; }},
    {"huge_file_count", [](Known& k) { put_u32(k.bytes, 20, 0xFFFFFFFFu); reseal(k.bytes); }},
    {"huge_path_length", [](Known& k) { put_u32(k.bytes, 24, 0x7FFFFFFFu); reseal(k.bytes); }},
    {"read_of_missing_file", [](Known& k) { put_u32(k.bytes, k.read_at(), 1); reseal(k.bytes); }},
    {"read_beyond_the_file", [](Known& k) { put_u64(k.bytes, k.read_at() + 4, k.size + 4096); reseal(k.bytes); }},
    {"read_length_overflows", [](Known& k) { put_u64(k.bytes, k.read_at() + 12, ~0ull - 100); reseal(k.bytes); }},
    {"read_past_the_alignment", [](Known& k) {
       put_u64(k.bytes, k.read_at() + 12, k.size + kTemplateMaxAlign + 1);
       reseal(k.bytes);
     }},
    {"zero_length_read", [](Known& k) { put_u64(k.bytes, k.read_at() + 12, 0); reseal(k.bytes); }},
    {"huge_read_count", [](Known& k) { put_u64(k.bytes, k.read_at() - 8, 1ull << 60); reseal(k.bytes); }},
};

INSTANTIATE_TEST_SUITE_P(Table, CorruptTemplate, ::testing::ValuesIn(kCorruptions),
                         [](const auto& p) { return std::string(p.param.name); });

TEST(CorruptTemplateSweep, EveryBitFlipAndEveryTruncationIsRejected) {
  Known k;
  // FNV-1a changes with any single changed byte, so no flip gets through.
  for (std::size_t at = 0; at < k.bytes.size(); ++at) {
    for (int bit = 0; bit < 8; ++bit) {
      std::vector<std::uint8_t> b = k.bytes;
      b[at] ^= static_cast<std::uint8_t>(1u << bit);
      ASSERT_FALSE(parse_template(b)) << "flip at byte " << at << " bit " << bit;
    }
  }
  for (std::size_t n = 0; n < k.bytes.size(); ++n) {
    ASSERT_FALSE(parse_template(std::span(k.bytes.data(), n))) << "cut to " << n;
  }
  ASSERT_TRUE(parse_template(k.bytes));
}

// ---- replay ----

// With one reader thread, a prefetch from a template reads in the template's
// order: here the reverse of the recorded one.
TEST(TemplateReplay, PrefetchReadsInTheRecordedOrder) {
  Fixture fx;
  IoTemplate t = fx.record(1);
  TemplateReads reversed = *t.find(kHostDestination);
  std::reverse(reversed.reads.begin(), reversed.reads.end());
  t.set(reversed);
  RecordingEnv env;
  Loader loader(small_blocks(1), nullptr, &env);
  Prefetch p = prefetch(loader, t);
  p.wait();
  const StateDict sd = loader.load(p);
  testing::expect_matches_file(sd, fx.a, fx.image_a);
  testing::expect_matches_file(sd, fx.b, fx.image_b);
  // Data reads (the ones at recorded offsets), in order.
  std::vector<std::pair<std::string, std::uint64_t>> data_reads;
  std::size_t next = 0;
  for (const auto& [path, offset] : env.offsets()) {
    if (next < reversed.reads.size() && t.files[reversed.reads[next].file].path == path &&
        reversed.reads[next].offset == offset) {
      ++next;
    }
  }
  EXPECT_EQ(next, reversed.reads.size()) << "the prefetch did not follow the template's order";
}

TEST(TemplateReplay, TemplateStartedPrefetchLoadsByteExactWithPrefixes) {
  Fixture fx;
  IoTemplate t = fx.record();
  t.files[1].name_prefix = "other/";
  Loader loader(small_blocks());
  Prefetch p = prefetch(loader, t);
  const StateDict sd = loader.load(p);
  testing::expect_matches_file(sd, fx.a, fx.image_a);
  testing::expect_matches_file(sd, fx.b, fx.image_b, "other/");
}

// Ready tensors (Note [Ready tensors]) follow a replayed, reversed plan too.
TEST(TemplateReplay, AsynchronousLoadOfAReversedTemplateHandsOutEveryTensor) {
  Fixture fx;
  IoTemplate t = fx.record(1);
  TemplateReads reversed = *t.find(kHostDestination);
  std::reverse(reversed.reads.begin(), reversed.reads.end());
  t.set(reversed);
  Loader loader(small_blocks(2));
  Prefetch p = prefetch(loader, t);
  p.wait();
  LoadHandle handle = loader.load_async(std::move(p));
  std::size_t handed_out = 0;
  for (std::vector<Tensor> ready; !(ready = handle.next_ready()).empty();) handed_out += ready.size();
  const StateDict sd = handle.wait();
  EXPECT_EQ(handed_out, sd.size());
  testing::expect_matches_file(sd, fx.a, fx.image_a);
  testing::expect_matches_file(sd, fx.b, fx.image_b);
}

TEST(TemplateReplay, ReadsThatDoNotTileTheFileFallBackToTheDefaultPlan) {
  Fixture fx;
  IoTemplate t = fx.record();
  TemplateReads broken = *t.find(kHostDestination);
  broken.reads.pop_back();  // a hole
  t.set(broken);
  Loader loader(small_blocks());
  LogCapture log;
  Prefetch p = prefetch(loader, {fx.a, fx.b}, &t);
  p.wait();
  const StateDict sd = loader.load({fx.a, fx.b}, LoadRequest{{}, &p});
  EXPECT_TRUE(log.warned()) << log.text();
  testing::expect_matches_file(sd, fx.a, fx.image_a);
  testing::expect_matches_file(sd, fx.b, fx.image_b);
}

TEST(TemplateReplay, TemplateOfOtherFilesIsIgnored) {
  Fixture fx;
  IoTemplate t = fx.record();
  std::swap(t.files[0], t.files[1]);
  Loader loader(small_blocks());
  LogCapture log;
  Prefetch p = prefetch(loader, {fx.a, fx.b}, &t);
  p.wait();
  const StateDict sd = loader.load({fx.a, fx.b}, LoadRequest{{}, &p});
  EXPECT_TRUE(log.warned()) << log.text();
  testing::expect_matches_file(sd, fx.a, fx.image_a);
}

}  // namespace
}  // namespace pinload
