// Tests of checkpoint resolution: single files, sharded indexes, folders,
// diffusers pipelines and variants, over real files in a temporary folder.
#include "pinload/checkpoint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "fault_env.h"
#include "pinload/env.h"
#include "pinload/error.h"
#include "test_files.h"

namespace pinload {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;
using testing::TensorSpec;

// Writes a safetensors file holding U8 tensors of the given names (2 bytes each).
void write_tensors(const std::string& path, const std::vector<std::string>& names) {
  std::vector<TensorSpec> specs;
  for (const std::string& name : names) specs.push_back({name, "U8", {2}});
  std::mt19937_64 rng(names.size());
  testing::write_file(path, testing::make_image(specs, rng).bytes());
}

void write_text(const std::string& path, const std::string& text) {
  testing::write_file(path, std::vector<std::uint8_t>(text.begin(), text.end()));
}

// A transformers-style index: {"metadata": {...}, "weight_map": {tensor: shard}}.
void write_index(const std::string& path, const std::vector<std::pair<std::string, std::string>>& weight_map) {
  std::string text = "{\"metadata\":{\"total_size\":0},\"weight_map\":{";
  for (std::size_t i = 0; i < weight_map.size(); ++i) {
    text += (i ? "," : "") + std::string("\"") + weight_map[i].first + "\":\"" + weight_map[i].second + "\"";
  }
  write_text(path, text + "}}");
}

std::vector<std::string> names_of(const Checkpoint& c) {
  std::vector<std::string> out;
  for (const CheckpointFile& f : c.files) {
    for (const TensorInfo& t : f.header.tensors) out.push_back(f.name_prefix + t.name);
  }
  return out;
}

std::vector<std::string> paths_of(const Checkpoint& c) {
  std::vector<std::string> out;
  for (const CheckpointFile& f : c.files) out.push_back(f.path);
  return out;
}

// Runs `fn`, which must throw ErrorType; returns the error for more checks.
template <typename ErrorType, typename Fn>
ErrorType expect_error(Fn fn) {
  try {
    fn();
  } catch (const ErrorType& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw the wrong error: " << e.what();
    return ErrorType("wrong error");
  }
  ADD_FAILURE() << "nothing thrown";
  return ErrorType("nothing thrown");
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class CheckpointTest : public ::testing::Test {
 protected:
  std::string file(const std::string& name) const { return dir_.file(name); }
  std::string mkdir(const std::string& name) const {
    fs::create_directories(dir_.path() / name);
    return file(name);
  }
  Checkpoint open(const std::vector<std::string>& paths, const ResolveOptions& options = {}) const {
    return open_checkpoint(default_env(), paths, options);
  }

  TempDir dir_;
};

// ---------------------------------------------------------------------------
// read_checkpoint_file

TEST_F(CheckpointTest, ReadsOneFile) {
  write_tensors(file("m.safetensors"), {"b", "a"});
  const CheckpointFile f = read_checkpoint_file(default_env(), file("m.safetensors"));
  EXPECT_EQ(f.path, file("m.safetensors"));
  EXPECT_EQ(f.name_prefix, "");
  EXPECT_EQ(f.stat.size, fs::file_size(file("m.safetensors")));
  EXPECT_EQ(f.header.file_size, f.stat.size);
  ASSERT_EQ(f.header.tensors.size(), 2u);
  EXPECT_EQ(f.header.tensors[0].name, "b");  // file order
  EXPECT_EQ(f.header.tensors[1].name, "a");
  EXPECT_EQ(f.header.data_size(), 4u);
}

TEST_F(CheckpointTest, ReadOfAMissingFileIsNotFound) {
  const auto e = expect_error<NotFoundError>([&] { read_checkpoint_file(default_env(), file("nope.safetensors")); });
  EXPECT_EQ(e.context().file, file("nope.safetensors"));
}

TEST_F(CheckpointTest, ReadOfABadFileNamesIt) {
  write_text(file("bad.safetensors"), std::string("\x02\0\0\0\0\0\0\0{]", 10));
  const auto e = expect_error<InvalidFileError>([&] { read_checkpoint_file(default_env(), file("bad.safetensors")); });
  EXPECT_EQ(e.context().file, file("bad.safetensors"));
  EXPECT_TRUE(contains(e.what(), file("bad.safetensors") + ": ")) << e.what();
}

TEST_F(CheckpointTest, ReadOfATinyFileIsInvalid) {
  write_text(file("tiny.safetensors"), "abc");
  const auto e = expect_error<InvalidFileError>([&] { read_checkpoint_file(default_env(), file("tiny.safetensors")); });
  EXPECT_EQ(e.context().file, file("tiny.safetensors"));
  EXPECT_TRUE(contains(e.message(), "too short")) << e.what();
}

TEST_F(CheckpointTest, ReadOfATruncatedDataSectionIsInvalid) {
  write_tensors(file("m.safetensors"), {"a", "b"});
  fs::resize_file(file("m.safetensors"), fs::file_size(file("m.safetensors")) - 1);
  const auto e = expect_error<InvalidFileError>([&] { read_checkpoint_file(default_env(), file("m.safetensors")); });
  EXPECT_EQ(e.context().file, file("m.safetensors"));
  EXPECT_EQ(e.context().tensor, "b");
}

TEST_F(CheckpointTest, ReadErrorIsAnIoErrorNamingTheFile) {
  write_tensors(file("m.safetensors"), {"a"});
  testing::FaultEnv env(testing::Faults{.fail_read_at = 2});  // the header read
  const auto e = expect_error<IoError>([&] { read_checkpoint_file(&env, file("m.safetensors")); });
  EXPECT_EQ(e.context().file, file("m.safetensors"));
  EXPECT_EQ(env.open_fds(), 0);
}

TEST_F(CheckpointTest, ReadsThroughShortReadsAndEintr) {
  write_tensors(file("m.safetensors"), {"a", "b", "c"});
  testing::FaultEnv env(testing::Faults{.short_read_bytes = 3, .eintr_every_other = true});
  const CheckpointFile f = read_checkpoint_file(&env, file("m.safetensors"));
  EXPECT_EQ(f.header.tensors.size(), 3u);
  EXPECT_EQ(env.open_fds(), 0);
}

// ---------------------------------------------------------------------------
// Single files and several paths

TEST_F(CheckpointTest, OpensAFile) {
  write_tensors(file("m.safetensors"), {"x", "y"});
  const Checkpoint c = open({file("m.safetensors")});
  EXPECT_EQ(paths_of(c), std::vector<std::string>{file("m.safetensors")});
  EXPECT_EQ(c.files[0].name_prefix, "");
  EXPECT_TRUE(c.index_files.empty());
  EXPECT_EQ(c.tensor_count(), 2u);
  EXPECT_EQ(c.data_bytes(), 4u);
}

TEST_F(CheckpointTest, OpensSeveralFilesInTheOrderGiven) {
  write_tensors(file("b.safetensors"), {"b1"});
  write_tensors(file("a.safetensors"), {"a1", "a2"});
  const Checkpoint c = open({file("b.safetensors"), file("a.safetensors")});
  EXPECT_EQ(paths_of(c), (std::vector<std::string>{file("b.safetensors"), file("a.safetensors")}));
  EXPECT_EQ(names_of(c), (std::vector<std::string>{"b1", "a1", "a2"}));
  EXPECT_EQ(c.tensor_count(), 3u);
  EXPECT_EQ(c.data_bytes(), 6u);
}

TEST_F(CheckpointTest, DuplicateTensorAcrossTwoFilesIsInvalid) {
  write_tensors(file("a.safetensors"), {"shared", "a"});
  write_tensors(file("b.safetensors"), {"b", "shared"});
  const auto e = expect_error<InvalidFileError>([&] { open({file("a.safetensors"), file("b.safetensors")}); });
  EXPECT_EQ(e.context().file, file("b.safetensors"));
  EXPECT_EQ(e.context().tensor, "shared");
  EXPECT_TRUE(contains(e.message(), file("a.safetensors"))) << e.what();
}

TEST_F(CheckpointTest, SameFileTwiceIsADuplicate) {
  write_tensors(file("a.safetensors"), {"a"});
  EXPECT_THROW(open({file("a.safetensors"), file("a.safetensors")}), InvalidFileError);
}

TEST_F(CheckpointTest, NoPathIsInvalid) {
  EXPECT_THROW(open({}), InvalidArgumentError);
}

TEST_F(CheckpointTest, MissingPathIsNotFound) {
  const auto e = expect_error<NotFoundError>([&] { open({file("missing")}); });
  EXPECT_EQ(e.context().file, file("missing"));
}

TEST_F(CheckpointTest, BadFileAmongGoodOnesIsNamed) {
  write_tensors(file("a.safetensors"), {"a"});
  write_text(file("b.safetensors"), "not a safetensors file");
  const auto e = expect_error<InvalidFileError>([&] { open({file("a.safetensors"), file("b.safetensors")}); });
  EXPECT_EQ(e.context().file, file("b.safetensors"));
}

// ---------------------------------------------------------------------------
// Sharded checkpoints

class ShardedTest : public CheckpointTest {
 protected:
  void SetUp() override {
    write_tensors(file("model-00001-of-00002.safetensors"), {"a", "b"});
    write_tensors(file("model-00002-of-00002.safetensors"), {"c"});
  }
  std::string index() const { return file("model.safetensors.index.json"); }
  static constexpr char kShard1[] = "model-00001-of-00002.safetensors";
  static constexpr char kShard2[] = "model-00002-of-00002.safetensors";
};

TEST_F(ShardedTest, IndexThatAgreesLoadsEveryShard) {
  write_index(index(), {{"c", kShard2}, {"a", kShard1}, {"b", kShard1}});
  const Checkpoint c = open({index()});
  EXPECT_EQ(paths_of(c), (std::vector<std::string>{file(kShard1), file(kShard2)}));
  EXPECT_EQ(names_of(c), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(c.index_files, std::vector<std::string>{index()});
  EXPECT_EQ(c.tensor_count(), 3u);
}

TEST_F(ShardedTest, FolderWithAnIndexUsesIt) {
  write_index(index(), {{"a", kShard1}, {"b", kShard1}, {"c", kShard2}});
  write_tensors(file("stray.safetensors"), {"stray"});  // not in the index: ignored
  const Checkpoint c = open({dir_.path().string()});
  EXPECT_EQ(names_of(c), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(c.index_files.size(), 1u);
}

TEST_F(ShardedTest, IndexNamingATensorNotInTheShardIsInvalid) {
  write_index(index(), {{"a", kShard1}, {"b", kShard1}, {"c", kShard2}, {"ghost", kShard2}});
  const auto e = expect_error<InvalidFileError>([&] { open({index()}); });
  EXPECT_EQ(e.context().file, index());
  EXPECT_EQ(e.context().tensor, "ghost");
  EXPECT_TRUE(contains(e.message(), "does not hold")) << e.what();
}

TEST_F(ShardedTest, ShardTensorMissingFromWeightMapIsInvalid) {
  write_index(index(), {{"a", kShard1}, {"c", kShard2}});
  const auto e = expect_error<InvalidFileError>([&] { open({index()}); });
  EXPECT_EQ(e.context().file, index());
  EXPECT_EQ(e.context().tensor, "b");
  EXPECT_TRUE(contains(e.message(), "missing from weight_map")) << e.what();
}

TEST_F(ShardedTest, WeightMapPointingAtTheWrongShardIsInvalid) {
  write_index(index(), {{"a", kShard1}, {"b", kShard2}, {"c", kShard2}});
  const auto e = expect_error<InvalidFileError>([&] { open({index()}); });
  EXPECT_EQ(e.context().file, index());
  EXPECT_EQ(e.context().tensor, "b");
  EXPECT_TRUE(contains(e.message(), "weight_map puts the tensor in")) << e.what();
}

TEST_F(ShardedTest, MissingShardIsNotFound) {
  write_index(index(), {{"a", kShard1}, {"b", kShard1}, {"c", kShard2}, {"d", "model-00003-of-00003.safetensors"}});
  const auto e = expect_error<NotFoundError>([&] { open({index()}); });
  EXPECT_EQ(e.context().file, file("model-00003-of-00003.safetensors"));
}

TEST_F(ShardedTest, IndexWithoutWeightMapIsInvalid) {
  write_text(index(), "{\"metadata\":{}}");
  const auto e = expect_error<InvalidFileError>([&] { open({index()}); });
  EXPECT_EQ(e.context().file, index());
  EXPECT_TRUE(contains(e.message(), "weight_map")) << e.what();
}

TEST_F(ShardedTest, IndexThatIsNotJsonIsInvalid) {
  write_text(index(), "{\"weight_map\":");
  const auto e = expect_error<InvalidFileError>([&] { open({index()}); });
  EXPECT_EQ(e.context().file, index());
}

TEST_F(ShardedTest, IndexWithDuplicateTensorIsInvalid) {
  write_index(index(), {{"a", kShard1}, {"b", kShard1}, {"c", kShard2}, {"a", kShard1}});
  const auto e = expect_error<InvalidFileError>([&] { open({index()}); });
  EXPECT_EQ(e.context().file, index());
  EXPECT_TRUE(contains(e.message(), "duplicate key 'a'")) << e.what();
}

TEST_F(ShardedTest, IndexWithAShardOutsideItsFolderIsInvalid) {
  for (const std::string shard : {"../model-00001-of-00002.safetensors", "/etc/passwd", ""}) {
    SCOPED_TRACE(shard);
    write_index(index(), {{"a", shard}});
    const auto e = expect_error<InvalidFileError>([&] { open({index()}); });
    EXPECT_EQ(e.context().file, index());
    EXPECT_EQ(e.context().tensor, "a");
  }
}

TEST_F(ShardedTest, ShardTensorsCollidingWithAnotherPathAreDuplicates) {
  write_index(index(), {{"a", kShard1}, {"b", kShard1}, {"c", kShard2}});
  write_tensors(file("extra.safetensors"), {"c"});
  const auto e = expect_error<InvalidFileError>([&] { open({index(), file("extra.safetensors")}); });
  EXPECT_EQ(e.context().tensor, "c");
}

TEST_F(CheckpointTest, FolderWithTwoIndexesIsAmbiguous) {
  write_tensors(file("a.safetensors"), {"a"});
  write_index(file("a.safetensors.index.json"), {{"a", "a.safetensors"}});
  write_index(file("b.safetensors.index.json"), {{"a", "a.safetensors"}});
  const auto e = expect_error<InvalidFileError>([&] { open({dir_.path().string()}); });
  EXPECT_EQ(e.context().file, dir_.path().string());
}

TEST_F(CheckpointTest, FolderOfPlainFilesLoadsThemSortedByName) {
  write_tensors(file("b.safetensors"), {"b"});
  write_tensors(file("a.safetensors"), {"a"});
  write_text(file("config.json.bak"), "{}");
  const Checkpoint c = open({dir_.path().string()});
  EXPECT_EQ(paths_of(c), (std::vector<std::string>{file("a.safetensors"), file("b.safetensors")}));
}

TEST_F(CheckpointTest, FolderWithoutWeightsIsNotFound) {
  write_text(file("config.json"), "{}");
  const auto e = expect_error<NotFoundError>([&] { open({dir_.path().string()}); });
  EXPECT_EQ(e.context().file, dir_.path().string());
}

// Folders are stat'ed and listed through the Env, like every other OS call.
class FolderEnv : public EnvWrapper {
 public:
  FolderEnv() : EnvWrapper(default_env()) {}
  int stat_path(const std::string& path, FileStat* out) override {
    ++stats;
    return stat_error != 0 ? stat_error : EnvWrapper::stat_path(path, out);
  }
  int list_folder(const std::string& path, std::vector<FolderEntry>* out) override {
    ++lists;
    if (list_error != 0) return list_error;
    const int rc = EnvWrapper::list_folder(path, out);
    std::erase_if(*out, [&](const FolderEntry& e) { return e.name == hidden; });
    return rc;
  }
  int stat_error = 0;
  int list_error = 0;
  std::string hidden;
  int stats = 0;
  int lists = 0;
};

TEST_F(CheckpointTest, FolderIsListedThroughTheEnv) {
  write_tensors(file("a.safetensors"), {"a"});
  write_tensors(file("b.safetensors"), {"b"});
  FolderEnv env;
  env.hidden = "b.safetensors";
  const Checkpoint c = open_checkpoint(&env, {dir_.path().string()}, {});
  EXPECT_EQ(paths_of(c), std::vector<std::string>{file("a.safetensors")});  // the Env's listing, not the disk's
  EXPECT_GE(env.stats, 1);
  EXPECT_EQ(env.lists, 1);
}

TEST_F(CheckpointTest, FolderThatCannotBeListedIsAnIoErrorNamingIt) {
  write_tensors(file("a.safetensors"), {"a"});
  FolderEnv env;
  env.list_error = -EACCES;
  const auto e = expect_error<IoError>([&] { open_checkpoint(&env, {dir_.path().string()}, {}); });
  EXPECT_EQ(e.context().file, dir_.path().string());
  EXPECT_TRUE(contains(e.message(), "cannot list folder")) << e.what();
}

TEST_F(CheckpointTest, PathThatCannotBeStatedIsAnIoErrorNamingIt) {
  write_tensors(file("a.safetensors"), {"a"});
  FolderEnv env;
  env.stat_error = -ELOOP;
  const auto e = expect_error<IoError>([&] { open_checkpoint(&env, {file("a.safetensors")}, {}); });
  EXPECT_EQ(e.context().file, file("a.safetensors"));
  EXPECT_TRUE(contains(e.message(), "cannot stat")) << e.what();
}

TEST_F(CheckpointTest, ListingFollowsLinksAndSkipsDanglingOnes) {
  write_tensors(file("a.safetensors"), {"a"});
  mkdir("sub");
  write_tensors(file("sub/x.safetensors"), {"x"});
  fs::create_symlink(file("sub/x.safetensors"), file("b.safetensors"));
  fs::create_symlink(file("gone.safetensors"), file("c.safetensors"));
  fs::create_directory_symlink(file("sub"), file("link"));
  std::vector<FolderEntry> entries;
  ASSERT_EQ(default_env()->list_folder(dir_.path().string(), &entries), 0);
  std::map<std::string, FileType> types;
  for (const FolderEntry& e : entries) types[e.name] = e.type;
  EXPECT_EQ(types, (std::map<std::string, FileType>{{"a.safetensors", FileType::kRegular},
                                                    {"b.safetensors", FileType::kRegular},
                                                    {"c.safetensors", FileType::kSymlink},
                                                    {"link", FileType::kDirectory},
                                                    {"sub", FileType::kDirectory}}));
  const Checkpoint c = open({dir_.path().string()});
  EXPECT_EQ(paths_of(c), (std::vector<std::string>{file("a.safetensors"), file("b.safetensors")}));
  EXPECT_EQ(default_env()->list_folder(file("a.safetensors"), &entries), -ENOTDIR);
}

// ---------------------------------------------------------------------------
// Variants

TEST_F(CheckpointTest, PlainFileIsChosenByDefault) {
  write_tensors(file("diffusion_pytorch_model.safetensors"), {"plain"});
  write_tensors(file("diffusion_pytorch_model.fp16.safetensors"), {"half"});
  const Checkpoint c = open({dir_.path().string()});
  EXPECT_EQ(paths_of(c), std::vector<std::string>{file("diffusion_pytorch_model.safetensors")});
  EXPECT_EQ(names_of(c), std::vector<std::string>{"plain"});
}

TEST_F(CheckpointTest, VariantFileIsChosenWhenAskedFor) {
  write_tensors(file("diffusion_pytorch_model.safetensors"), {"plain"});
  write_tensors(file("diffusion_pytorch_model.fp16.safetensors"), {"half"});
  write_tensors(file("diffusion_pytorch_model.bf16.safetensors"), {"brain"});
  const Checkpoint c = open({dir_.path().string()}, ResolveOptions{.variant = "fp16"});
  EXPECT_EQ(paths_of(c), std::vector<std::string>{file("diffusion_pytorch_model.fp16.safetensors")});
  EXPECT_EQ(names_of(c), std::vector<std::string>{"half"});
}

TEST_F(CheckpointTest, OnlyAVariantAndNoneRequestedIsNotFoundNamingIt) {
  write_tensors(file("diffusion_pytorch_model.fp16.safetensors"), {"half"});
  const auto e = expect_error<NotFoundError>([&] { open({dir_.path().string()}); });
  EXPECT_EQ(e.context().file, dir_.path().string());
  EXPECT_TRUE(contains(e.message(), "fp16")) << e.what();
}

TEST_F(CheckpointTest, RequestedVariantMissingIsNotFoundNamingIt) {
  write_tensors(file("model.safetensors"), {"plain"});
  write_tensors(file("model.bf16.safetensors"), {"brain"});
  const auto e = expect_error<NotFoundError>([&] { open({dir_.path().string()}, ResolveOptions{.variant = "fp16"}); });
  EXPECT_TRUE(contains(e.message(), "'fp16'")) << e.what();
  EXPECT_TRUE(contains(e.message(), "bf16")) << e.what();
  EXPECT_TRUE(contains(e.message(), "(no variant)")) << e.what();
}

TEST_F(CheckpointTest, ShardedVariantUsesItsIndex) {
  // transformers' names: model.fp16-0000N-of-0000M.safetensors and
  // model.safetensors.index.fp16.json.
  write_tensors(file("model.fp16-00001-of-00002.safetensors"), {"a"});
  write_tensors(file("model.fp16-00002-of-00002.safetensors"), {"b"});
  write_index(file("model.safetensors.index.fp16.json"),
              {{"a", "model.fp16-00001-of-00002.safetensors"}, {"b", "model.fp16-00002-of-00002.safetensors"}});
  const Checkpoint c = open({dir_.path().string()}, ResolveOptions{.variant = "fp16"});
  EXPECT_EQ(names_of(c), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(c.index_files, std::vector<std::string>{file("model.safetensors.index.fp16.json")});
}

TEST_F(CheckpointTest, ShardedVariantIsNotTakenForPlainShards) {
  write_tensors(file("model.fp16-00001-of-00002.safetensors"), {"a"});
  write_tensors(file("model.fp16-00002-of-00002.safetensors"), {"b"});
  write_index(file("model.safetensors.index.fp16.json"),
              {{"a", "model.fp16-00001-of-00002.safetensors"}, {"b", "model.fp16-00002-of-00002.safetensors"}});
  const auto e = expect_error<NotFoundError>([&] { open({dir_.path().string()}); });
  EXPECT_TRUE(contains(e.message(), "fp16")) << e.what();
}

TEST_F(CheckpointTest, PlainShardsHaveNoVariant) {
  write_tensors(file("model-00001-of-00002.safetensors"), {"a"});
  write_tensors(file("model-00002-of-00002.safetensors"), {"b"});
  const Checkpoint c = open({dir_.path().string()});
  EXPECT_EQ(names_of(c), (std::vector<std::string>{"a", "b"}));
  EXPECT_THROW(open({dir_.path().string()}, ResolveOptions{.variant = "fp16"}), NotFoundError);
}

// ---------------------------------------------------------------------------
// Diffusers pipelines

class PipelineTest : public CheckpointTest {
 protected:
  void SetUp() override {
    write_text(file("model_index.json"), "{\"_class_name\":\"StableDiffusionXLPipeline\"}");
    mkdir("unet");
    write_tensors(file("unet/diffusion_pytorch_model.safetensors"), {"conv.weight", "w"});
    write_tensors(file("unet/diffusion_pytorch_model.fp16.safetensors"), {"w16"});
    mkdir("text_encoder");
    write_tensors(file("text_encoder/model.safetensors"), {"w"});
    write_tensors(file("text_encoder/model.fp16.safetensors"), {"w16"});
    mkdir("text_encoder_2");
    write_tensors(file("text_encoder_2/model-00001-of-00002.safetensors"), {"w"});
    write_tensors(file("text_encoder_2/model-00002-of-00002.safetensors"), {"v"});
    write_index(file("text_encoder_2/model.safetensors.index.json"),
                {{"w", "model-00001-of-00002.safetensors"}, {"v", "model-00002-of-00002.safetensors"}});
    write_tensors(file("text_encoder_2/model.fp16.safetensors"), {"w16"});
    mkdir("tokenizer");
    write_text(file("tokenizer/vocab.json"), "{}");
    write_text(file("tokenizer/merges.txt"), "");
    mkdir("scheduler");
    write_text(file("scheduler/scheduler_config.json"), "{}");
  }
};

TEST_F(PipelineTest, ComponentsArePrefixed) {
  const Checkpoint c = open({dir_.path().string()});
  std::vector<std::string> prefixes;
  for (const CheckpointFile& f : c.files) prefixes.push_back(f.name_prefix);
  EXPECT_EQ(prefixes, (std::vector<std::string>{"text_encoder/", "text_encoder_2/", "text_encoder_2/", "unet/"}));
  EXPECT_EQ(paths_of(c), (std::vector<std::string>{file("text_encoder/model.safetensors"),
                                                   file("text_encoder_2/model-00001-of-00002.safetensors"),
                                                   file("text_encoder_2/model-00002-of-00002.safetensors"),
                                                   file("unet/diffusion_pytorch_model.safetensors")}));
  EXPECT_EQ(names_of(c), (std::vector<std::string>{"text_encoder/w", "text_encoder_2/w", "text_encoder_2/v",
                                                   "unet/conv.weight", "unet/w"}));
  // Headers keep the names as the files spell them.
  EXPECT_NE(c.files[0].header.find("w"), nullptr);
  EXPECT_EQ(c.index_files, std::vector<std::string>{file("text_encoder_2/model.safetensors.index.json")});
  EXPECT_EQ(c.tensor_count(), 5u);
}

TEST_F(PipelineTest, VariantAppliesToEveryComponent) {
  const Checkpoint c = open({dir_.path().string()}, ResolveOptions{.variant = "fp16"});
  EXPECT_EQ(names_of(c), (std::vector<std::string>{"text_encoder/w16", "text_encoder_2/w16", "unet/w16"}));
}

TEST_F(PipelineTest, ComponentWithoutTheVariantIsNotFound) {
  fs::remove(file("unet/diffusion_pytorch_model.fp16.safetensors"));
  const auto e = expect_error<NotFoundError>([&] { open({dir_.path().string()}, ResolveOptions{.variant = "fp16"}); });
  EXPECT_EQ(e.context().file, file("unet"));
  EXPECT_TRUE(contains(e.message(), "fp16")) << e.what();
}

TEST_F(PipelineTest, ComponentFolderAloneHasNoPrefix) {
  const Checkpoint c = open({file("unet")});
  EXPECT_EQ(names_of(c), (std::vector<std::string>{"conv.weight", "w"}));
  EXPECT_EQ(c.files[0].name_prefix, "");
}

TEST_F(PipelineTest, PipelineWithoutWeightsIsNotFound) {
  for (const char* component : {"unet", "text_encoder", "text_encoder_2"}) fs::remove_all(file(component));
  const auto e = expect_error<NotFoundError>([&] { open({dir_.path().string()}); });
  EXPECT_EQ(e.context().file, dir_.path().string());
}

TEST_F(PipelineTest, BadComponentFileIsNamed) {
  write_text(file("unet/diffusion_pytorch_model.safetensors"), "garbage!garbage!");
  const auto e = expect_error<InvalidFileError>([&] { open({dir_.path().string()}); });
  EXPECT_EQ(e.context().file, file("unet/diffusion_pytorch_model.safetensors"));
}

}  // namespace
}  // namespace pinload
