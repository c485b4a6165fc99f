// pinload::torch: to_torch aliases pool and device memory, maps every dtype
// torch has, and keeps the memory alive on its own.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "pinload/device.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "pinload/pool.h"
#include "pinload/torch.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::FileImage;
using testing::TempDir;
using testing::TensorSpec;

struct Expected {
  at::ScalarType dtype;
  std::vector<std::int64_t> sizes;
};

// Every dtype torch has, one tensor each (plus a scalar and an empty one).
std::vector<TensorSpec> torch_specs() {
  return {
      {"bool", "BOOL", {3, 2}},
      {"u8", "U8", {7}},
      {"i8", "I8", {2, 3}},
      {"i16", "I16", {5}},
      {"u16", "U16", {4, 1}},
      {"i32", "I32", {3}},
      {"u32", "U32", {2, 2}},
      {"i64", "I64", {3, 1, 2}},
      {"u64", "U64", {2}},
      {"f16", "F16", {9}},
      {"bf16", "BF16", {4, 4}},
      {"f32", "F32", {3, 5, 7}},
      {"f64", "F64", {2, 3}},
      {"c64", "C64", {3}},
      {"f8_e4m3", "F8_E4M3", {8, 2}},
      {"f8_e5m2", "F8_E5M2", {5}},
      {"f8_e8m0", "F8_E8M0", {6}},
      {"f8_e4m3fnuz", "F8_E4M3FNUZ", {3}},
      {"f8_e5m2fnuz", "F8_E5M2FNUZ", {3}},
      {"scalar", "F32", {}},
      {"empty", "BF16", {0, 4}},
  };
}

const std::map<std::string, at::ScalarType>& expected_dtypes() {
  static const std::map<std::string, at::ScalarType> m = {
      {"BOOL", at::kBool},
      {"U8", at::kByte},
      {"I8", at::kChar},
      {"I16", at::kShort},
      {"U16", at::kUInt16},
      {"I32", at::kInt},
      {"U32", at::kUInt32},
      {"I64", at::kLong},
      {"U64", at::kUInt64},
      {"F16", at::kHalf},
      {"BF16", at::kBFloat16},
      {"F32", at::kFloat},
      {"F64", at::kDouble},
      {"C64", at::kComplexFloat},
      {"F8_E4M3", at::ScalarType::Float8_e4m3fn},
      {"F8_E5M2", at::ScalarType::Float8_e5m2},
      {"F8_E8M0", at::ScalarType::Float8_e8m0fnu},
      {"F8_E4M3FNUZ", at::ScalarType::Float8_e4m3fnuz},
      {"F8_E5M2FNUZ", at::ScalarType::Float8_e5m2fnuz},
  };
  return m;
}

// Where each tensor's bytes are in image.data (make_image lays them out in order).
std::map<std::string, std::pair<std::size_t, std::size_t>> layout(const std::vector<TensorSpec>& specs) {
  std::map<std::string, std::pair<std::size_t, std::size_t>> out;
  std::size_t offset = 0;
  for (const TensorSpec& s : specs) {
    std::size_t numel = 1;
    for (auto d : s.shape) numel *= d;
    const std::size_t nbytes = numel * testing::spec_bits(s.dtype) / 8;
    out[s.name] = {offset, nbytes};
    offset += nbytes;
  }
  return out;
}

LoadOptions small_options() {
  LoadOptions options;
  options.threads = 2;
  options.block_size = 64 << 10;
  options.zero_copy = ZeroCopy::kOff;  // pool blocks and descriptors are counted: no file mappings
  return options;
}

// Checks dtype, shape and that the at::Tensor's bytes are the file's bytes.
void expect_matches(const at::Tensor& tensor, const TensorSpec& spec, const FileImage& image,
                    const std::pair<std::size_t, std::size_t>& where) {
  SCOPED_TRACE(spec.name);
  EXPECT_EQ(tensor.scalar_type(), expected_dtypes().at(spec.dtype));
  std::vector<std::int64_t> sizes(spec.shape.begin(), spec.shape.end());
  EXPECT_EQ(tensor.sizes().vec(), sizes);
  EXPECT_TRUE(tensor.is_contiguous());
  ASSERT_EQ(static_cast<std::size_t>(tensor.nbytes()), where.second);
  if (where.second == 0) return;
  const at::Tensor cpu = tensor.is_cpu() ? tensor : tensor.cpu();
  EXPECT_EQ(std::memcmp(cpu.data_ptr(), image.data.data() + where.first, where.second), 0);
}

class TorchAdapterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(20260);
    specs_ = torch_specs();
    image_ = testing::make_image(specs_, rng);
    path_ = dir_.file("model.safetensors");
    testing::write_file(path_, image_.bytes());
  }

  TempDir dir_;
  std::vector<TensorSpec> specs_;
  FileImage image_;
  std::string path_;
};

TEST_F(TorchAdapterTest, HostTensorsAliasThePoolWithEveryDtype) {
  Loader loader(small_options(), Pool::create_default());
  const StateDict sd = loader.load({path_});
  const auto where = layout(specs_);
  const auto tensors = to_torch(sd);
  ASSERT_EQ(tensors.size(), specs_.size());
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    const auto& [name, tensor] = tensors[i];
    EXPECT_EQ(name, specs_[i].name);  // file order
    EXPECT_TRUE(tensor.is_cpu());
    expect_matches(tensor, specs_[i], image_, where.at(name));
    if (tensor.numel() > 0) {
      EXPECT_EQ(tensor.data_ptr(), static_cast<const void*>(sd.at(name).data())) << name << ": copied";
    }
  }
  EXPECT_EQ(to_torch(sd.at("scalar")).dim(), 0);
  EXPECT_EQ(to_torch(sd.at("empty")).numel(), 0);
}

TEST_F(TorchAdapterTest, MapsAndOrderedDicts) {
  Loader loader(small_options(), Pool::create_default());
  const StateDict sd = loader.load({path_});
  const auto ordered = to_torch_ordered_dict(sd);
  ASSERT_EQ(ordered.size(), specs_.size());
  EXPECT_EQ(ordered.keys().front(), specs_.front().name);
  EXPECT_EQ(ordered["bf16"].scalar_type(), at::kBFloat16);
  const auto map = to_torch_map(sd);
  ASSERT_EQ(map.size(), specs_.size());
  EXPECT_EQ(map.at("f32").data_ptr(), static_cast<const void*>(sd.at("f32").data()));
}

TEST_F(TorchAdapterTest, TensorsOutliveTheStateDictAndTheLoader) {
  auto pool = Pool::create_default();
  at::Tensor kept;
  {
    Loader loader(small_options(), pool);
    StateDict sd = loader.load({path_});
    kept = to_torch(sd.at("f32"));
    EXPECT_EQ(pool->stats().live_blocks, 1u);
  }
  EXPECT_EQ(pool->stats().live_blocks, 1u);  // held by the at::Tensor alone
  const auto where = layout(specs_);
  expect_matches(kept, specs_[11], image_, where.at("f32"));
  at::Tensor view = kept.slice(0, 1, 2);  // a view shares the storage, and the block
  kept = at::Tensor();
  EXPECT_EQ(pool->stats().live_blocks, 1u);
  view = at::Tensor();
  EXPECT_EQ(pool->stats().live_blocks, 0u);
}

TEST_F(TorchAdapterTest, SubByteDtypesThrowNamingTheTensor) {
  std::mt19937_64 rng(7);
  const std::vector<TensorSpec> specs = {{"ok", "F32", {2}}, {"packed", "F4", {4, 2}}, {"six", "F6_E2M3", {4}}};
  const std::string path = dir_.file("f4.safetensors");
  testing::write_file(path, testing::make_image(specs, rng).bytes());
  Loader loader(small_options(), Pool::create_default());
  const StateDict sd = loader.load({path});
  EXPECT_NO_THROW(to_torch(sd.at("ok")));
  for (const char* name : {"packed", "six"}) {
    try {
      to_torch(sd.at(name));
      ADD_FAILURE() << name << ": no throw";
    } catch (const InvalidFileError& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(to_torch(sd), InvalidFileError);
  EXPECT_FALSE(torch_dtype(DType::kF4).has_value());
}

TEST_F(TorchAdapterTest, PlacementMustExist) {
  Loader loader(small_options(), Pool::create_default());
  const StateDict sd = loader.load({path_});
  EXPECT_THROW(to_torch(sd.at("f32"), TorchPlacement::kDevice), InvalidArgumentError);
  EXPECT_NO_THROW(to_torch(sd.at("f32"), TorchPlacement::kHost));
}

// The "sim" device's memory is host memory: a sim device tensor becomes a CPU
// tensor aliasing the DeviceBuffer (Note [Placement] in pinload/torch.h).
TEST_F(TorchAdapterTest, SimDeviceTensorsBecomeCpuTensorsAliasingTheBuffer) {
  if (cuda_available()) GTEST_SKIP() << "a visible GPU: covered by the CUDA test";
  auto device = make_sim_device();
  at::Tensor kept;
  const auto where = layout(specs_);
  {
    LoadOptions options = small_options();
    options.target.device = device.get();
    options.target.mode = DeviceMode::kStreaming;
    Loader loader(options);
    const StateDict sd = loader.load({path_});
    ASSERT_FALSE(sd.at("bf16").on_host());
    const auto tensors = to_torch(sd);
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      const auto& [name, tensor] = tensors[i];
      EXPECT_TRUE(tensor.is_cpu()) << name;
      expect_matches(tensor, specs_[i], image_, where.at(name));
      if (tensor.numel() > 0) {
        EXPECT_EQ(tensor.data_ptr(), sd.at(name).device_data()) << name;
      }
    }
    kept = to_torch(sd.at("bf16"));
    EXPECT_THROW(to_torch(sd.at("bf16"), TorchPlacement::kHost), InvalidArgumentError);
  }
  expect_matches(kept, specs_[10], image_, where.at("bf16"));  // the buffer outlives the load
}

TEST_F(TorchAdapterTest, CudaTensorsAliasTheDeviceBuffer) {
  std::string why;
  if (!cuda_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  if (!at::hasCUDA()) GTEST_SKIP() << "torch sees no CUDA device";
  auto device = open_cuda_device(0);
  if (torch_built_with_cuda()) device->set_allocator(torch_cuda_allocator(0));
  const auto where = layout(specs_);
  at::Tensor kept;
  {
    LoadOptions options = small_options();
    options.target.device = device.get();
    Loader loader(options);
    const StateDict sd = loader.load({path_});
    const auto tensors = to_torch(sd);
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      const auto& [name, tensor] = tensors[i];
      EXPECT_TRUE(tensor.is_cuda()) << name;
      EXPECT_EQ(tensor.device().index(), 0);
      expect_matches(tensor, specs_[i], image_, where.at(name));
      if (tensor.numel() > 0) {
        EXPECT_EQ(tensor.data_ptr(), sd.at(name).device_data()) << name;
      }
    }
    EXPECT_TRUE(to_torch(sd.at("f32"), TorchPlacement::kHost).is_cpu());  // cached mode keeps the host copy
    kept = to_torch(sd.at("f8_e4m3"));
  }
  expect_matches(kept, specs_[14], image_, where.at("f8_e4m3"));
}

}  // namespace
}  // namespace pinload
