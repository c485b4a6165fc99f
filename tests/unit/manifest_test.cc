// Tests of manifests and verified loads (pinload/manifest.h, Note [Verified
// loads]): digests compared with the test's own bytes, a corrupted byte named
// by its tensor in every load kind, published whole-file digests, nothing
// returned and no block kept after a failed verification.
#include "pinload/manifest.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "pinload/error.h"
#include "pinload/loader.h"
#include "pinload/prefetch.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::FileImage;
using testing::TempDir;
using testing::TensorSpec;

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

// Tensors of a few bytes to a few pieces, at an odd data offset: pieces that
// lie inside chunks and pieces cut by chunk boundaries.
const std::vector<TensorSpec>& specs() {
  static const std::vector<TensorSpec> s = {
      {"a", "U8", {1}},           {"b", "F32", {1025}},  {"big", "U8", {3 * MiB + 4097}},
      {"empty", "F32", {0, 3}},   {"c", "BF16", {6151}}, {"d", "F32", {300'001}},
      {"scalar", "F64", {}},      {"e", "U8", {70'001}}};
  return s;
}

FileImage write_model(const std::string& path, std::uint64_t seed = 7) {
  std::mt19937_64 rng(seed);
  FileImage image = testing::make_image(specs(), rng, 1, "{\"format\":\"pt\"}");
  testing::write_file(path, image.bytes());
  return image;
}

// Flips one byte at `offset` of the file.
void corrupt(const std::string& path, std::uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

std::uint64_t data_offset(const FileImage& image) { return 8 + image.header_json.size(); }

// The absolute range of tensor `name` in the test's own layout.
std::pair<std::uint64_t, std::uint64_t> range_of(const FileImage& image, const Manifest& m, const std::string& name) {
  for (const ManifestTensor& t : m.files.at(0).tensors) {
    if (t.name == name) return {t.begin, t.end};
  }
  ADD_FAILURE() << "no tensor " << name << " (data at " << data_offset(image) << ")";
  return {0, 0};
}

LoadOptions small_blocks(std::shared_ptr<const Manifest> manifest) {
  LoadOptions o;
  o.block_size = 64 * KiB;  // many chunk boundaries inside the 1 MiB pieces
  o.threads = 4;
  o.direct = DirectIo::kOff;
  o.verify.manifest = std::move(manifest);
  return o;
}

class ManifestTest : public ::testing::Test {
 protected:
  TempDir dir;
  std::string path = dir.file("model.safetensors");
  FileImage image = write_model(path);
};

TEST_F(ManifestTest, DigestsAreOfTheFilesBytesAndRoundTrip) {
  const Manifest m = make_manifest({path});
  ASSERT_EQ(m.files.size(), 1u);
  const ManifestFile& f = m.files[0];
  EXPECT_EQ(f.name, "model.safetensors");
  const std::vector<std::uint8_t> bytes = image.bytes();
  EXPECT_EQ(f.size, bytes.size());
  EXPECT_EQ(f.sha256, sha256_hex(bytes.data(), bytes.size()));
  EXPECT_EQ(f.data_offset, data_offset(image));
  ASSERT_EQ(f.tensors.size(), specs().size());
  for (const ManifestTensor& t : f.tensors) {
    EXPECT_EQ(t.sha256, sha256_hex(bytes.data() + t.begin, t.end - t.begin)) << t.name;
    const std::uint64_t n = t.end - t.begin;
    if (n <= m.piece_bytes) {
      EXPECT_TRUE(t.pieces.empty()) << t.name;
      continue;
    }
    ASSERT_EQ(t.pieces.size(), (n + m.piece_bytes - 1) / m.piece_bytes) << t.name;
    for (std::size_t k = 0; k < t.pieces.size(); ++k) {
      const std::uint64_t b = t.begin + k * m.piece_bytes, e = std::min(t.end, b + m.piece_bytes);
      EXPECT_EQ(t.pieces[k], sha256_hex(bytes.data() + b, e - b)) << t.name << " piece " << k;
    }
  }
  const std::string json = manifest_to_json(m);
  const Manifest back = parse_manifest(json);
  EXPECT_EQ(manifest_to_json(back), json);
  save_manifest(m, dir.file("m.json"));
  EXPECT_EQ(manifest_to_json(load_manifest(dir.file("m.json"))), json);
}

TEST_F(ManifestTest, FilesAreNamedWithinTheCheckpoint) {
  std::filesystem::create_directories(dir.path() / "unet");
  std::filesystem::create_directories(dir.path() / "vae");
  write_model(dir.file("unet/m.safetensors"), 1);
  write_model(dir.file("vae/m.safetensors"), 2);
  const Manifest m = make_manifest({dir.file("unet/m.safetensors"), dir.file("vae/m.safetensors")});
  ASSERT_EQ(m.files.size(), 2u);
  EXPECT_EQ(m.files[0].name, "unet/m.safetensors");
  EXPECT_EQ(m.files[1].name, "vae/m.safetensors");
  EXPECT_EQ(m.find("/elsewhere/vae/m.safetensors"), &m.files[1]);
  EXPECT_EQ(m.find("/elsewhere/xvae/m.safetensors"), nullptr);
  EXPECT_NE(m.files[0].sha256, m.files[1].sha256);
}

TEST_F(ManifestTest, ParseRefusesWhatIsNotAManifestOfThisVersion) {
  const std::string json = manifest_to_json(make_manifest({path}));
  EXPECT_THROW(parse_manifest("{}"), InvalidFileError);
  EXPECT_THROW(parse_manifest("not json"), InvalidFileError);
  std::string other = json;
  other.replace(other.find("\"version\": 1"), 12, "\"version\": 2");
  try {
    parse_manifest(other, "m.json");
    FAIL();
  } catch (const InvalidFileError& e) {
    EXPECT_NE(std::string(e.what()).find("version 2"), std::string::npos) << e.what();
    EXPECT_EQ(e.context().file, "m.json");
  }
  std::string bad_digest = json;
  bad_digest.replace(bad_digest.find("\"sha256\": \"") + 11, 1, "g");
  EXPECT_THROW(parse_manifest(bad_digest), InvalidFileError);
}

// Every load kind verifies and returns the file's bytes.
TEST_F(ManifestTest, VerifiedLoadsOfEveryKindSucceed) {
  auto m = std::make_shared<const Manifest>(make_manifest({path}));
  const std::vector<std::uint8_t> bytes = image.bytes();
  {
    const StateDict sd = Loader(small_blocks(m)).load({path});
    for (const ManifestTensor& t : m->files[0].tensors) {
      const Tensor& x = sd.at(t.name);
      ASSERT_EQ(x.nbytes(), t.end - t.begin);
      EXPECT_EQ(std::memcmp(x.bytes().data(), bytes.data() + t.begin, x.nbytes()), 0) << t.name;
    }
  }
  LoadOptions o = small_blocks(m);
  o.verify.file_sha256 = {{"model.safetensors", m->files[0].sha256}};
  EXPECT_EQ(Loader(o).load({path}).size(), specs().size());
  LoadOptions c = small_blocks(m);
  c.dtype.to = DType::kBF16;
  EXPECT_EQ(Loader(c).load({path}).size(), specs().size());
  auto device = make_sim_device();
  for (DeviceMode mode : {DeviceMode::kCached, DeviceMode::kStreaming}) {
    LoadOptions d = small_blocks(m);
    d.target.device = device.get();
    d.target.mode = mode;
    d.target.staging_bytes = 1 * MiB;
    EXPECT_EQ(Loader(d).load({path}).size(), specs().size());
    d.dtype.to = DType::kF16;
    EXPECT_EQ(Loader(d).load({path}).size(), specs().size());
  }
}

// A corrupted byte fails every load kind with an IntegrityError naming its
// tensor and a byte range holding it; nothing is returned and the pool keeps
// no block.
TEST_F(ManifestTest, ACorruptedByteNamesItsTensorInEveryLoadKind) {
  auto m = std::make_shared<const Manifest>(make_manifest({path}));
  for (const std::string name : {"big", "d", "a", "scalar"}) {
    write_model(path);
    const auto [begin, end] = range_of(image, *m, name);
    const std::uint64_t at = name == "big" ? begin + 2 * MiB + 100 : begin + (end - begin) / 2;
    corrupt(path, at);
    auto device = make_sim_device();
    for (int kind = 0; kind < 6; ++kind) {
      SCOPED_TRACE(name + " kind " + std::to_string(kind));
      LoadOptions o = small_blocks(m);
      if (kind == 1) o.dtype.to = DType::kBF16;  // a converting load (staged: most bytes are floats? either way)
      if (kind == 2) o.direct = DirectIo::kAuto, o.resident_threshold = 2.0;  // O_DIRECT where it works
      if (kind >= 3) o.target.device = device.get(), o.target.staging_bytes = 1 * MiB;
      if (kind == 4) o.target.mode = DeviceMode::kStreaming;
      if (kind == 5) o.target.mode = DeviceMode::kStreaming, o.dtype.to = DType::kF16;
      Loader loader(o);
      try {
        (void)loader.load({path});
        FAIL() << "no error";
      } catch (const IntegrityError& e) {
        EXPECT_EQ(e.code(), ErrorCode::kIntegrity);
        EXPECT_EQ(e.context().file, path);
        EXPECT_EQ(e.context().tensor, name) << e.what();
        ASSERT_TRUE(e.context().begin && e.context().end);
        EXPECT_LE(*e.context().begin, at);
        EXPECT_GT(*e.context().end, at);
        EXPECT_GE(*e.context().begin, begin);
        EXPECT_LE(*e.context().end, end);
      }
      EXPECT_EQ(loader.pool()->stats().live_blocks, 0u);
      if (loader.staging_pool()) {
        EXPECT_EQ(loader.staging_pool()->stats().live_blocks, 0u);
      }
    }
  }
}

// Tensors handed out as they arrive are verified ones: the corrupted tensor
// never comes out, and the load ends with the IntegrityError.
TEST_F(ManifestTest, NoUnverifiedTensorIsHandedOut) {
  auto m = std::make_shared<const Manifest>(make_manifest({path}));
  corrupt(path, range_of(image, *m, "big").first + 5);
  Loader loader(small_blocks(m));
  LoadHandle h = loader.load_async({path});
  std::vector<std::string> seen;
  try {
    for (std::vector<Tensor> ready = h.next_ready(); !ready.empty(); ready = h.next_ready()) {
      for (const Tensor& t : ready) seen.push_back(t.name());
    }
    FAIL() << "no error";
  } catch (const IntegrityError& e) {
    EXPECT_EQ(e.context().tensor, "big");
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), "big"), 0);
  EXPECT_THROW((void)h.wait(), IntegrityError);
}

// With a whole-file digest, no tensor of the file is handed out before the
// whole file is hashed; a load that keeps nothing (HandOut::kStream) cannot
// wait for that and is refused.
TEST_F(ManifestTest, NoTensorBeforeItsFilesDigest) {
  const std::vector<std::uint8_t> bytes = image.bytes();
  LoadOptions o = small_blocks(nullptr);
  o.verify.file_sha256 = {{"model.safetensors", sha256_hex(bytes.data(), bytes.size())}};
  corrupt(path, bytes.size() - 1);  // the last byte: every other chunk arrives intact
  Loader loader(o);
  LoadHandle h = loader.load_async({path});
  std::size_t seen = 0;
  try {
    for (std::vector<Tensor> ready = h.next_ready(); !ready.empty(); ready = h.next_ready()) seen += ready.size();
    FAIL() << "no error";
  } catch (const IntegrityError& e) {
    EXPECT_TRUE(e.context().tensor.empty());
  }
  EXPECT_EQ(seen, 0u);
  LoadHandle streamed = loader.load_async({path}, HandOut::kStream);
  EXPECT_THROW((void)streamed.next_ready(), InvalidArgumentError);
}

// What a prefetch read is verified when the load adopts it, as its chunks
// are handed over, in both destination modes.
TEST_F(ManifestTest, AnAdoptedPrefetchIsVerified) {
  auto m = std::make_shared<const Manifest>(make_manifest({path}));
  EXPECT_EQ(Loader(small_blocks(m)).load({path}).size(), specs().size());
  corrupt(path, range_of(image, *m, "d").first + 11);
  auto device = make_sim_device();
  for (int streaming = 0; streaming < 2; ++streaming) {
    LoadOptions o = small_blocks(m);
    if (streaming) o.target.device = device.get(), o.target.mode = DeviceMode::kStreaming;
    Loader loader(o);
    Prefetch p = prefetch(loader, {path});
    p.wait();
    try {
      (void)loader.load(p);
      FAIL() << "no error";
    } catch (const IntegrityError& e) {
      EXPECT_EQ(e.context().tensor, "d");
    }
  }
}

// A published whole-file sha256: a wrong one, and a corrupted file against
// the right one, both fail naming the file and its whole range.
TEST_F(ManifestTest, PublishedFileDigests) {
  const std::vector<std::uint8_t> bytes = image.bytes();
  const std::string right = sha256_hex(bytes.data(), bytes.size());
  std::string wrong = right;
  wrong[10] = wrong[10] == '0' ? '1' : '0';
  LoadOptions o = small_blocks(nullptr);
  o.verify.file_sha256 = {{"model.safetensors", right}};
  EXPECT_EQ(Loader(o).load({path}).size(), specs().size());
  o.verify.file_sha256 = {{"model.safetensors", wrong}};
  for (int corrupted = 0; corrupted < 2; ++corrupted) {
    Loader loader(o);
    try {
      (void)loader.load({path});
      FAIL() << "no error";
    } catch (const IntegrityError& e) {
      EXPECT_EQ(e.context().file, path);
      EXPECT_TRUE(e.context().tensor.empty());
      EXPECT_EQ(e.context().begin, 0u);
      EXPECT_EQ(e.context().end, bytes.size());
    }
    EXPECT_EQ(loader.pool()->stats().live_blocks, 0u);
    if (corrupted == 0) {
      o.verify.file_sha256 = {{"model.safetensors", right}};
      corrupt(path, data_offset(image) + 3);  // in the data section
    }
  }
  // A manifest of file digests alone is checked the same way.
  auto only_file = std::make_shared<Manifest>();
  only_file->files.push_back(ManifestFile{.name = "model.safetensors", .size = bytes.size(), .sha256 = right});
  EXPECT_THROW(Loader(small_blocks(only_file)).load({path}), IntegrityError);
  write_model(path);
  EXPECT_EQ(Loader(small_blocks(only_file)).load({path}).size(), specs().size());
}

TEST_F(ManifestTest, WhatCannotBeVerifiedIsRefused) {
  const std::vector<std::uint8_t> bytes = image.bytes();
  auto device = make_sim_device();
  LoadOptions o = small_blocks(nullptr);
  o.target.device = device.get();
  o.target.mode = DeviceMode::kStreaming;
  o.verify.file_sha256 = {{"model.safetensors", sha256_hex(bytes.data(), bytes.size())}};
  EXPECT_THROW(Loader(o).load({path}), InvalidArgumentError);  // streaming: never silently unchecked
  o.target.mode = DeviceMode::kCached;
  EXPECT_EQ(Loader(o).load({path}).size(), specs().size());
  o.verify.file_sha256 = {{"other.safetensors", sha256_hex(bytes.data(), bytes.size())}};
  EXPECT_THROW(Loader(o).load({path}), InvalidArgumentError);  // names no file of the load
  o.verify.file_sha256 = {{"model.safetensors", "abc"}};
  EXPECT_THROW(Loader{o}, InvalidArgumentError);
}

TEST_F(ManifestTest, HeadersAreCheckedBeforeReading) {
  auto m = std::make_shared<Manifest>(make_manifest({path}));
  {
    auto other = std::make_shared<Manifest>(*m);
    other->files[0].tensors[2].shape = {1, 2};
    Loader loader(small_blocks(other));
    try {
      (void)loader.load({path});
      FAIL();
    } catch (const IntegrityError& e) {
      EXPECT_EQ(e.context().tensor, other->files[0].tensors[2].name);
      EXPECT_NE(std::string(e.what()).find("shape"), std::string::npos) << e.what();
    }
    EXPECT_EQ(loader.pool()->stats().allocations, 0u);  // failed before taking memory
  }
  {
    auto other = std::make_shared<Manifest>(*m);
    other->files[0].name = "another.safetensors";
    EXPECT_THROW(Loader(small_blocks(other)).load({path}), IntegrityError);  // a file the manifest lacks
  }
  {
    auto other = std::make_shared<Manifest>(*m);
    other->files[0].metadata = {{"format", "np"}};
    EXPECT_THROW(Loader(small_blocks(other)).load({path}), IntegrityError);
  }
}

}  // namespace
}  // namespace pinload
