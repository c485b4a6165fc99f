// Tests of rank-aware loading (pinload/shard.h): plans as data, and loads
// whose bytes are checked against slices cut from the written file images.
#include "pinload/shard.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <set>
#include <map>
#include <random>

#include "pinload/error.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::TempDir;
using testing::TensorSpec;

// A Llama-shaped pair of shards (hidden 64, intermediate 160, 2 layers).
struct Llama {
  TempDir dir;
  std::vector<std::string> paths;
  std::map<std::string, std::vector<std::uint8_t>> bytes;  // name -> its bytes, from the image
  std::map<std::string, std::pair<std::vector<std::uint64_t>, unsigned>> shape;  // name -> (shape, bits)

  Llama() {
    std::mt19937_64 rng(7);
    for (int layer = 0; layer < 2; ++layer) {
      const std::string p = "model.layers." + std::to_string(layer) + ".";
      std::vector<TensorSpec> specs = {
          {p + "input_layernorm.weight", "BF16", {64}},
          {p + "self_attn.q_proj.weight", "BF16", {64, 64}},
          {p + "self_attn.k_proj.weight", "BF16", {16, 64}},
          {p + "self_attn.v_proj.weight", "BF16", {16, 64}},
          {p + "self_attn.o_proj.weight", "BF16", {64, 64}},
          {p + "mlp.gate_proj.weight", "F32", {160, 64}},
          {p + "mlp.up_proj.weight", "BF16", {160, 64}},
          {p + "mlp.down_proj.weight", "BF16", {64, 160}},
      };
      if (layer == 0) specs.insert(specs.begin(), TensorSpec{"model.embed_tokens.weight", "BF16", {128, 64}});
      if (layer == 1) specs.push_back(TensorSpec{"model.norm.weight", "F32", {64}});
      testing::FileImage image = testing::make_image(specs, rng, 8);
      const std::string path = dir.file("model-0000" + std::to_string(layer + 1) + "-of-00002.safetensors");
      testing::write_file(path, image.bytes());
      paths.push_back(path);
      std::uint64_t at = 0;
      for (const TensorSpec& s : specs) {
        std::uint64_t n = testing::spec_bits(s.dtype);
        for (auto d : s.shape) n *= d;
        n /= 8;
        bytes[s.name].assign(image.data.begin() + static_cast<std::ptrdiff_t>(at),
                             image.data.begin() + static_cast<std::ptrdiff_t>(at + n));
        shape[s.name] = {s.shape, testing::spec_bits(s.dtype)};
        at += n;
      }
    }
  }
  std::uint64_t total() const {
    std::uint64_t n = 0;
    for (const auto& [k, v] : bytes) n += v.size();
    return n;
  }
  // The expected bytes of rank r of w's slice of `name` on `dim`.
  std::vector<std::uint8_t> slice(const std::string& name, int dim, int r, int w) const {
    const auto& [s, bits] = shape.at(name);
    const std::vector<std::uint8_t>& all = bytes.at(name);
    if (dim == kReplicated) return all;
    std::uint64_t outer = 1, inner = bits;
    for (int i = 0; i < dim; ++i) outer *= s[static_cast<std::size_t>(i)];
    for (std::size_t i = static_cast<std::size_t>(dim) + 1; i < s.size(); ++i) inner *= s[i];
    inner /= 8;
    const std::uint64_t n = s[static_cast<std::size_t>(dim)];
    const std::uint64_t b = n * static_cast<std::uint64_t>(r) / static_cast<std::uint64_t>(w);
    const std::uint64_t e = n * static_cast<std::uint64_t>(r + 1) / static_cast<std::uint64_t>(w);
    std::vector<std::uint8_t> out;
    for (std::uint64_t o = 0; o < outer; ++o)
      out.insert(out.end(), all.begin() + static_cast<std::ptrdiff_t>((o * n + b) * inner),
                 all.begin() + static_cast<std::ptrdiff_t>((o * n + e) * inner));
    return out;
  }
};

std::vector<ShardRule> tp_rules() {
  return {{R"(\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$)", 0},
          {R"(embed_tokens\.weight$)", 0},
          {R"(\.(o_proj|down_proj)\.weight$)", 1}};
}

int dim_of(const std::string& name) {
  if (name.find("o_proj") != std::string::npos || name.find("down_proj") != std::string::npos) return 1;
  if (name.find("norm") != std::string::npos) return kReplicated;
  return 0;
}

std::vector<std::uint8_t> bytes_of(const Tensor& t) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(t.data());
  return std::vector<std::uint8_t>(p, p + t.nbytes());
}

class ShardLoads : public ::testing::TestWithParam<std::tuple<bool, std::uint64_t>> {};

TEST_P(ShardLoads, SlicesEqualTheImagesSlices) {
  const auto [direct, batch_bytes] = GetParam();
  Llama m;
  const int world = 4;
  std::uint64_t read_sum = 0;
  for (int r = 0; r < world; ++r) {
    ShardSpec spec{r, world, ShardMode::kSlice, tp_rules(), 0};
    ShardLoadOptions o;
    o.threads = 3;
    o.direct = direct;
    o.batch_bytes = batch_bytes;
    o.block_size = 16384;
    ShardLoad load(m.paths, spec, o);
    if (batch_bytes != 0) {
      EXPECT_GT(load.plan().batches.size(), 2u);
    }
    std::size_t seen = 0;
    for (StateDict sd = load.next(); !sd.empty(); sd = load.next()) {
      for (const Tensor& t : sd) {
        ++seen;
        EXPECT_EQ(bytes_of(t), m.slice(t.name(), dim_of(t.name()), r, world)) << t.name() << " rank " << r;
        const int d = dim_of(t.name());
        std::vector<std::uint64_t> want = m.shape.at(t.name()).first;
        if (d != kReplicated) want[static_cast<std::size_t>(d)] /= world;
        EXPECT_EQ(t.shape(), want) << t.name();
      }
    }
    EXPECT_EQ(seen, m.bytes.size());
    EXPECT_TRUE(load.next().empty());
    EXPECT_EQ(load.bytes_read(), load.plan().read_bytes);
    read_sum += load.plan().read_bytes;
  }
  if (!direct) {
    // Buffered reads are exact: every split byte once, every replicated byte on each rank.
    std::uint64_t replicated = 0;
    for (const auto& [name, b] : m.bytes)
      if (dim_of(name) == kReplicated) replicated += b.size();
    EXPECT_EQ(read_sum, m.total() - replicated + world * replicated);
  }
}

INSTANTIATE_TEST_SUITE_P(DirectAndBatches, ShardLoads,
                         ::testing::Values(std::make_tuple(false, 0), std::make_tuple(true, 0),
                                           std::make_tuple(false, 20000), std::make_tuple(true, 20000)));

TEST(ShardPlan, DimZeroSliceIsOneRead) {
  Llama m;
  Checkpoint c = open_checkpoint(default_env(), m.paths);
  ShardPlan plan = make_shard_plan(c, ShardSpec{1, 4, ShardMode::kSlice, {{"q_proj", 0}}, 0}, {});
  std::size_t q = 0;
  for (const ShardTensor& t : plan.tensors) {
    if (t.name.find("q_proj") == std::string::npos) continue;
    ++q;
    EXPECT_EQ(t.begin, 16u);
    EXPECT_EQ(t.end, 32u);
  }
  EXPECT_EQ(q, 2u);
  // Each q slice is contiguous; buffered pieces that touch merge, so there are few reads.
  EXPECT_LE(plan.reads.size(), 8u);
}

TEST(ShardPlan, StridedPiecesMergeIntoAlignedReads) {
  Llama m;
  Checkpoint c = open_checkpoint(default_env(), m.paths);
  std::vector<FileRead> files;
  for (const CheckpointFile& f : c.files) {
    FileRead r;
    r.path = f.path;
    r.file_size = f.header.file_size;
    r.data_offset = f.header.data_offset();
    r.alignment = 4096;
    r.direct = true;
    files.push_back(r);
  }
  ShardPlan plan = make_shard_plan(c, ShardSpec{0, 2, ShardMode::kSlice, {{"down_proj", 1}}, 0}, files);
  for (const ShardRead& r : plan.reads) {
    EXPECT_EQ(r.offset % 4096, 0u);
    EXPECT_EQ(r.length % 4096, 0u);
    for (std::uint32_t k = 0; k < r.piece_count; ++k) {
      const ShardPiece& p = plan.pieces[r.first_piece + k];
      EXPECT_GE(p.file_offset, r.offset);
      EXPECT_LE(p.file_offset + p.length, r.offset + r.length);
    }
  }
  // down_proj rows are 320 bytes: 64 strided pieces of 160 per tensor, merged into a few reads.
  EXPECT_EQ(plan.pieces.size(), c.tensor_count() - 2 + 2 * 64);
  EXPECT_LT(plan.reads.size(), plan.pieces.size() / 4);
}

TEST(ShardShare, EveryReplicatedByteIsReadByOneRank) {
  Llama m;
  const int world = 4;
  Checkpoint c = open_checkpoint(default_env(), m.paths);
  std::map<std::string, int> owner;
  std::uint64_t sum = 0, max_rank = 0;
  for (int r = 0; r < world; ++r) {
    ShardPlan plan = make_shard_plan(c, ShardSpec{r, world, ShardMode::kShare, {}, 0}, {});
    for (const ShardTensor& t : plan.tensors) {
      ASSERT_GE(t.owner, 0) << t.name;
      if (r == 0) owner[t.name] = t.owner;
      EXPECT_EQ(owner[t.name], t.owner) << "ranks disagree on " << t.name;
      EXPECT_EQ(t.read, t.owner == r);
    }
    sum += plan.read_bytes;
    max_rank = std::max(max_rank, plan.read_bytes);
    StateDict sd = load_shard(m.paths, ShardSpec{r, world, ShardMode::kShare, {}, 0}, ShardLoadOptions{2, 1 << 20, false, 0, 0});
    for (const Tensor& t : sd) EXPECT_EQ(bytes_of(t), m.bytes.at(t.name()));
    EXPECT_EQ(sd.files(), m.paths);  // StateDict::at names them for a missing tensor
  }
  EXPECT_EQ(sum, m.total());
  // Owners by contiguous ranges: no rank reads much more than its quarter (plus a tensor).
  EXPECT_LE(max_rank, m.total() / world + 160 * 64 * 4);
}

TEST(ShardShare, WindowsSpreadEachWindowOverTheRanks) {
  Llama m;
  Checkpoint c = open_checkpoint(default_env(), m.paths);
  ShardPlan plan = make_shard_plan(c, ShardSpec{0, 2, ShardMode::kShare, tp_rules(), 8192}, {});
  std::map<std::uint32_t, std::set<int>> owners;
  for (const ShardTensor& t : plan.tensors) {
    if (t.dim == kReplicated) {
      owners[t.window].insert(t.owner);
    }
    else {
      EXPECT_TRUE(t.read);
    }
  }
  EXPECT_GE(owners.size(), 1u);
}

TEST(ShardSpecErrors, AreInvalidFileErrors) {
  Llama m;
  Checkpoint c = open_checkpoint(default_env(), m.paths);
  EXPECT_THROW(make_shard_plan(c, ShardSpec{4, 4, ShardMode::kSlice, {}, 0}, {}), InvalidFileError);
  EXPECT_THROW(make_shard_plan(c, ShardSpec{0, 4, ShardMode::kSlice, {{"([", 0}}, 0}, {}), InvalidFileError);
  try {
    make_shard_plan(c, ShardSpec{0, 4, ShardMode::kSlice, {{"norm", 1}}, 0}, {});
    FAIL() << "a split on a dimension the tensor lacks";
  } catch (const InvalidFileError& e) {
    EXPECT_NE(e.context().tensor.find("layernorm"), std::string::npos) << e.what();
  }
}

TEST(ShardLoadErrors, ATruncatedFileIsAnIoErrorNamingIt) {
  Llama m;
  // Small batches: those of the second file are read only once next() gets near them.
  ShardLoad load(m.paths, ShardSpec{0, 2, ShardMode::kSlice, tp_rules(), 0}, ShardLoadOptions{2, 1 << 20, false, 0, 4096});
  std::filesystem::resize_file(m.paths[1], 1000);  // after the headers were read
  try {
    for (StateDict sd = load.next(); !sd.empty(); sd = load.next()) {
    }
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.context().file, m.paths[1]);
  }
  EXPECT_TRUE(load.next().empty());
}

}  // namespace
}  // namespace pinload
