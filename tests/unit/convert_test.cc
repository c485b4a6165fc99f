// The FP8 converter's failure paths and the device conversion contract
// (convert.h, Device::convert_async) on the CPU stand-in. Bit-exactness
// against torch is in tests/python/test_fp8.py.
#include "pinload/convert.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <filesystem>
#include <random>
#include <stdexcept>

#include "format/dtype_bits.h"
#include "format/dtype_convert.h"
#include "io/read_session.h"
#include "load/convert_on_load.h"
#include "pinload/device.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "pinload/prefetch.h"
#include "test_files.h"

namespace pinload {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

std::string bf16_checkpoint(const TempDir& dir, int layers) {
  std::mt19937_64 rng(7);
  std::vector<testing::TensorSpec> specs;
  for (int i = 0; i < layers; ++i) specs.push_back({"blocks." + std::to_string(i) + ".weight", "BF16", {64, 32}});
  testing::FileImage image = testing::make_image(specs, rng);
  // Finite bf16 values: clear each element's exponent top bit.
  for (std::size_t i = 1; i < image.data.size(); i += 2) image.data[i] &= 0xBF;
  const std::string path = dir.file("in.safetensors");
  testing::write_file(path, image.bytes());
  return path;
}

bool any_temp_in(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().find(".pinload-tmp-") != std::string::npos) return true;
  }
  return false;
}

TEST(ConvertTest, FailureMidConvertLeavesNoOutputAndNoTemporary) {
  TempDir dir;
  const std::string in = bf16_checkpoint(dir, 8);
  ConvertOptions options;
  options.threads = 2;
  std::atomic<int> written{0};  // called from every worker at once
  options.after_tensor = [&](const std::string&) {
    if (++written == 3) throw IoError("disk full (injected)");
  };
  EXPECT_THROW(convert_checkpoint(in, dir.file("out.safetensors"), options), IoError);
  EXPECT_FALSE(fs::exists(dir.file("out.safetensors")));
  EXPECT_FALSE(any_temp_in(dir.path()));
}

TEST(ConvertTest, ReplacesAnExistingOutputFileAtomically) {
  TempDir dir;
  const std::string in = bf16_checkpoint(dir, 2);
  testing::write_file(dir.file("out.safetensors"), {1, 2, 3});
  const ConvertStats stats = convert_checkpoint(in, dir.file("out.safetensors"));
  EXPECT_EQ(stats.tensors_quantized, 2u);
  EXPECT_EQ(fs::file_size(dir.file("out.safetensors")), stats.bytes_out);
  const StateDict sd = Loader().load({dir.file("out.safetensors")});
  EXPECT_EQ(sd.at("blocks.0.weight").dtype(), DType::kF8_E4M3);
  EXPECT_EQ(sd.at("blocks.0.weight_scale").dtype(), DType::kF32);
  EXPECT_EQ(sd.at("blocks.1.comfy_quant").dtype(), DType::kU8);
}

TEST(ConvertTest, RefusesTheInputAsOutputAndNonFp8Targets) {
  TempDir dir;
  const std::string in = bf16_checkpoint(dir, 1);
  EXPECT_THROW(convert_checkpoint(in, in), InvalidFileError);
  ConvertOptions bf16;
  bf16.to = DType::kBF16;
  EXPECT_THROW(convert_checkpoint(in, dir.file("o.safetensors"), bf16), InvalidFileError);
}

TEST(ConvertTest, KeepPatterns) {
  EXPECT_TRUE(keep_pattern_matches("time_embed", "unet.time_embed.0.weight"));
  EXPECT_TRUE(keep_pattern_matches("time_embed", "time_embed.weight"));
  EXPECT_FALSE(keep_pattern_matches("time_embed", "time_embedding.weight"));
  EXPECT_TRUE(keep_pattern_matches("vae/*", "vae/decoder.conv.weight"));
  EXPECT_TRUE(keep_pattern_matches("decoder.conv", "vae/decoder.conv.weight"));
  EXPECT_FALSE(keep_pattern_matches("", "a"));
}

// The converted output comes from the Loader's pool like the read blocks: a
// re-load after the state dict has gone makes no new OS reservation.
TEST(HostConvertTest, ReloadWithThePoolKeptReservesNothingNew) {
  TempDir dir;
  const std::string path = bf16_checkpoint(dir, 64);
  LoadOptions options;
  options.dtype.to = DType::kF32;
  const Loader loader(options);
  { StateDict sd = loader.load({path}); ASSERT_EQ(sd.size(), 64u); }
  const PoolStats first = loader.pool()->stats();
  EXPECT_GE(first.allocations, 2u);  // the file's block and the converted output
  for (int i = 0; i < 3; ++i) {
    StateDict sd = loader.load({path});
    EXPECT_EQ(sd[0].dtype(), DType::kF32);
  }
  const PoolStats after = loader.pool()->stats();
  EXPECT_EQ(after.os_reservations, first.os_reservations);
  EXPECT_EQ(after.reserved_bytes, first.reserved_bytes);
  EXPECT_EQ(after.free_list_hits - first.free_list_hits, after.allocations - first.allocations);
}

// An fp32 checkpoint of odd-sized tensors (so that elements straddle chunks)
// with finite random values; returns the file's data section.
std::vector<std::uint8_t> fp32_checkpoint(const std::string& path, int tensors) {
  std::mt19937_64 rng(11);
  std::vector<testing::TensorSpec> specs;
  specs.push_back({"head.bias", "BF16", {3}});  // the fp32 tensors start at an offset of 6
  for (int i = 0; i < tensors; ++i) specs.push_back({"t." + std::to_string(i) + ".weight", "F32", {257, static_cast<std::uint64_t>(129 + i)}});
  testing::FileImage image = testing::make_image(specs, rng);
  for (std::size_t i = 6 + 3; i < image.data.size(); i += 4) image.data[i] &= 0x3F;  // finite, |x| < 2
  testing::write_file(path, image.bytes());
  return image.data;
}

// Host conversions run on threads of their own, fed by the readers (Note
// [Converting beside the reads]): every element of a many-chunk load equals
// its own conversion, across chunk edges too.
TEST(HostConvertTest, ConversionsBesideTheReadsEqualElementwise) {
  TempDir dir;
  const std::string path = dir.file("f32.safetensors");
  const std::vector<std::uint8_t> data = fp32_checkpoint(path, 24);
  LoadOptions options;
  options.dtype.to = DType::kBF16;
  options.block_size = 64 * 1024;  // many chunks; tensors straddle them
  options.threads = 4;
  const Loader loader(options);
  const StateDict sd = loader.load({path});
  ASSERT_EQ(sd.size(), 25u);
  std::size_t at = 6;
  for (int i = 0; i < 24; ++i) {
    const Tensor& t = sd.at("t." + std::to_string(i) + ".weight");
    ASSERT_EQ(t.dtype(), DType::kBF16);
    const std::size_t n = 257u * static_cast<std::size_t>(129 + i);
    for (std::size_t k = 0; k < n; ++k) {
      float f = 0;
      std::memcpy(&f, data.data() + at + k * 4, 4);
      std::uint16_t got = 0;
      std::memcpy(&got, t.data() + k * 2, 2);
      ASSERT_EQ(got, bits::f32_to_bf16(f)) << t.name() << " element " << k;
    }
    at += n * 4;
  }
}

// Each of the n fp32 values at `src` converts to `t`'s bf16 element.
void expect_bf16_of(const Tensor& t, const std::uint8_t* src, std::size_t n) {
  ASSERT_EQ(t.dtype(), DType::kBF16) << t.name();
  ASSERT_EQ(t.nbytes(), n * 2) << t.name();
  for (std::size_t k = 0; k < n; ++k) {
    float f = 0;
    std::memcpy(&f, src + k * 4, 4);
    std::uint16_t got = 0;
    std::memcpy(&got, t.data() + k * 2, 2);
    ASSERT_EQ(got, bits::f32_to_bf16(f)) << t.name() << " element " << k;
  }
}

// fp32_checkpoint() of 96 tensors in a temporary directory.
struct Fp32File {
  static constexpr int kTensors = 96;
  TempDir dir;
  std::string path = dir.file("f32.safetensors");
  std::vector<std::uint8_t> data = fp32_checkpoint(path, kTensors);
};

// Each fp32 tensor of `file` in `sd` as its bf16 conversion.
void expect_bf16_weights(const StateDict& sd, const Fp32File& file) {
  std::size_t at = 6;
  for (int i = 0; i < Fp32File::kTensors; ++i) {
    const std::size_t n = 257u * static_cast<std::size_t>(129 + i);
    expect_bf16_of(sd.at("t." + std::to_string(i) + ".weight"), file.data.data() + at, n);
    at += n * 4;
  }
}

// Loads to bf16 in `block_size` chunks on two threads.
LoadOptions to_bf16(std::size_t block_size) {
  LoadOptions options;
  options.dtype.to = DType::kBF16;
  options.block_size = block_size;
  options.threads = 2;
  return options;
}

// A load whose conversions are most of its bytes streams its chunks through
// a ring of staging blocks (Note [Staged conversion], Note [Conversion
// ring]), with or without a budget: the pool holds the bf16 output and the
// ring, never the stored bytes whole; the kept tensor is copied; every
// element is right.
TEST(HostConvertTest, AConvertingLoadHoldsItsOutputAndItsRing) {
  TempDir dir;
  std::mt19937_64 rng(13);
  constexpr int kTensors = 96;
  constexpr std::size_t kElements = 256 * 1024;  // 1 MiB of fp32 each
  std::vector<testing::TensorSpec> specs;
  specs.push_back({"head.bias", "BF16", {3}});
  for (int i = 0; i < kTensors; ++i) specs.push_back({"t." + std::to_string(i) + ".weight", "F32", {256, 1024}});
  testing::FileImage image = testing::make_image(specs, rng);
  for (std::size_t i = 6 + 3; i < image.data.size(); i += 4) image.data[i] &= 0x3F;  // finite, |x| < 2
  const std::string path = dir.file("f32.safetensors");
  testing::write_file(path, image.bytes());
  const std::vector<std::uint8_t>& data = image.data;
  std::vector<std::uint16_t> expected(kElements * kTensors);
  for (std::size_t k = 0; k < expected.size(); ++k) {
    float f = 0;
    std::memcpy(&f, data.data() + 6 + k * 4, 4);
    expected[k] = bits::f32_to_bf16(f);
  }
  auto check = [&](const StateDict& sd) {
    ASSERT_EQ(sd.size(), kTensors + 1u);
    ASSERT_EQ(0, std::memcmp(sd.at("head.bias").data(), data.data(), 6));
    for (int i = 0; i < kTensors; ++i) {
      const Tensor& t = sd.at("t." + std::to_string(i) + ".weight");
      ASSERT_EQ(t.dtype(), DType::kBF16);
      ASSERT_EQ(t.nbytes(), kElements * 2);
      ASSERT_EQ(0, std::memcmp(t.data(), expected.data() + i * kElements, kElements * 2)) << t.name();
    }
  };
  LoadOptions options;
  options.dtype.to = DType::kBF16;
  options.threads = 2;
  options.block_size = 1u << 20;  // a ring of 16 MiB beside 96 MiB stored
  const std::size_t output = Pool::size_class(data.size() / 2 + 64 * (kTensors + 1));
  const std::size_t ring =
      detail::conversion_ring_chunks(options.block_size, 0, options.threads) * Pool::size_class(options.block_size);
  ASSERT_LT(output + ring, data.size());
  PoolOptions budget;
  budget.capacity_bytes = Pool::create_default()->own_reservation_for(output) + ring;
  for (const std::shared_ptr<Pool>& pool : {Pool::create_default(), Pool::create_default(budget)}) {
    const Loader loader(options, pool);
    for (int round = 0; round < 2; ++round) check(loader.load({path}));
    const PoolStats stats = pool->stats();
    EXPECT_LE(stats.peak_in_use_bytes, output + ring);
    EXPECT_EQ(stats.live_blocks, 0u);
  }
}

// The ring holds kConversionRingChunks chunks within kConversionRingBytes,
// at least two, two thirds of them being read at once: 16 reads of the
// default 8 MiB in flight and 8 chunks waiting for their conversion (Note
// [Conversion ring]; four chunks in all before, which left this VM's disk
// under-fed); over a network, a chunk per reader and two per converting
// thread, all of them may be read at once.
TEST(HostConvertTest, TheRingHoldsItsChunksWithinItsBytesOrEveryNetworkReader) {
  EXPECT_EQ(detail::conversion_ring_chunks(8u << 20, 0, 2), 24u);
  EXPECT_EQ(detail::conversion_ring_reads(8u << 20, 0), 16u);
  EXPECT_EQ(detail::conversion_ring_chunks(64u << 10, 0, 2), detail::kConversionRingChunks);
  EXPECT_EQ(detail::conversion_ring_reads(64u << 10, 0), detail::kConversionRingReads);
  EXPECT_EQ(detail::conversion_ring_chunks(32u << 20, 0, 2), detail::kConversionRingBytes / (32u << 20));
  EXPECT_EQ(detail::conversion_ring_reads(32u << 20, 0), 4u);
  EXPECT_EQ(detail::conversion_ring_chunks(detail::kConversionRingBytes, 0, 2), 2u);
  EXPECT_EQ(detail::conversion_ring_reads(detail::kConversionRingBytes, 0), 2u);
  EXPECT_EQ(detail::conversion_ring_chunks(8u << 20, 16, 2), 20u);
  EXPECT_EQ(detail::conversion_ring_reads(8u << 20, 16), SIZE_MAX);
}

// Note [Load stages]: a staged load counts every chunk read and converted,
// the reads' span, and conversions that end after the first read; a plain
// load counts its reads and no conversion.
TEST(HostConvertTest, LoadsCountTheirStages) {
  const Fp32File file;
  detail::LoadStages& stages = detail::load_stages();
  stages.reset();
  const std::uint64_t start = detail::LoadStages::now();
  const StateDict sd = Loader(to_bf16(1u << 20)).load({file.path});
  const std::uint64_t end = detail::LoadStages::now();
  expect_bf16_weights(sd, file);
  const std::uint64_t chunks = (file.data.size() + (1u << 20) - 1) >> 20;
  EXPECT_GE(stages.chunks.load(), chunks);
  EXPECT_EQ(stages.converted.load(), stages.chunks.load());
  EXPECT_GT(stages.read.load(), 0u);
  EXPECT_GT(stages.convert.load(), 0u);
  EXPECT_GT(stages.plan.load(), 0u);
  EXPECT_LE(start, stages.first_read_start.load());
  EXPECT_LT(stages.first_read_start.load(), stages.last_read_end.load());
  EXPECT_LE(stages.last_read_end.load(), end);
  EXPECT_LT(stages.first_read_start.load(), stages.last_convert_end.load());
  EXPECT_LE(stages.last_convert_end.load(), end);

  stages.reset();
  LoadOptions plain;
  plain.block_size = 1u << 20;
  plain.zero_copy = ZeroCopy::kOff;  // read, not mapped (Note [Zero-copy loads])
  (void)Loader(plain).load({file.path});
  EXPECT_GE(stages.chunks.load(), chunks);
  EXPECT_EQ(stages.converted.load(), 0u);
  EXPECT_EQ(stages.convert.load(), 0u);
}

// A budget with room for the output and a few staging blocks, fewer than
// the chunks a staged load admits at most, bounds them: the load holds no
// more (under WhenFull::kFail, one more failed it). With room for the
// output and no staging block, the load fails at once, naming the file.
TEST(HostConvertTest, AStagedLoadAdmitsTheChunksItsBudgetHolds) {
  const Fp32File file;
  const std::string& path = file.path;
  const std::vector<std::uint8_t>& data = file.data;
  const LoadOptions options = to_bf16(1u << 20);
  PoolOptions budget;
  budget.slab_bytes = 4u << 20;  // a slab holds four 1 MiB staging blocks
  const std::size_t output = Pool::create_default(budget)->own_reservation_for(data.size() / 2 + 64 * (Fp32File::kTensors + 1));
  budget.capacity_bytes = output + budget.slab_bytes + (1u << 20);  // the rest holds no 2 MiB reservation
  {
    const Loader loader(options, Pool::create_default(budget));
    {
      const std::shared_ptr<Block> out = loader.pool()->allocate(data.size() / 2);
      ASSERT_EQ(loader.pool()->blocks_available(options.block_size), 4u);
    }
    for (int round = 0; round < 2; ++round) {
      const StateDict sd = loader.load({path});
      expect_bf16_weights(sd, file);
    }
    EXPECT_LE(loader.pool()->stats().peak_in_use_bytes, output + 4 * options.block_size);
  }
  budget.capacity_bytes = output + (1u << 20);
  const Loader loader(options, Pool::create_default(budget));
  try {
    (void)loader.load({path});
    FAIL() << "a budget without room for a staging block loaded";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.context().file, path);
    EXPECT_NE(std::string(e.what()).find("staging block"), std::string::npos) << e.what();
  }
  EXPECT_EQ(loader.pool()->stats().live_blocks, 0u);
}

// Conversions of a few bytes among many kept ones, and a load adopting a
// prefetch, read whole files and convert out of them, across chunk edges too.
TEST(HostConvertTest, MostlyKeptAndAdoptedLoadsConvertOutOfWholeFiles) {
  TempDir dir;
  std::mt19937_64 rng(12);
  std::vector<testing::TensorSpec> specs;
  specs.push_back({"kept.weight", "BF16", {1024, 1023}});  // ~2 MiB, as stored
  for (int i = 0; i < 6; ++i) specs.push_back({"t." + std::to_string(i) + ".weight", "F32", {61, static_cast<std::uint64_t>(67 + i)}});
  testing::FileImage image = testing::make_image(specs, rng);
  const std::size_t kept_bytes = 1024u * 1023u * 2;
  for (std::size_t i = kept_bytes + 3; i < image.data.size(); i += 4) image.data[i] &= 0x3F;
  const std::string path = dir.file("mixed.safetensors");
  testing::write_file(path, image.bytes());
  LoadOptions options;
  options.dtype.to = DType::kBF16;
  options.block_size = 4096;  // the fp32 tensors straddle chunks
  const Loader loader(options);
  auto check = [&](const StateDict& sd) {
    ASSERT_EQ(sd.size(), 7u);
    ASSERT_EQ(0, std::memcmp(sd.at("kept.weight").data(), image.data.data(), kept_bytes));
    std::size_t at = kept_bytes;
    for (int i = 0; i < 6; ++i) {
      const std::size_t n = 61u * static_cast<std::size_t>(67 + i);
      expect_bf16_of(sd.at("t." + std::to_string(i) + ".weight"), image.data.data() + at, n);
      at += n * 4;
    }
  };
  check(loader.load({path}));
  EXPECT_GE(loader.pool()->stats().peak_in_use_bytes, image.data.size());  // the whole file, in one block
  // A prefetch read whole files: the load adopting it converts out of them.
  const std::string f32 = dir.file("f32.safetensors");
  const std::vector<std::uint8_t> data = fp32_checkpoint(f32, 8);
  Prefetch p = prefetch(loader, {f32});
  p.wait();
  const StateDict sd = loader.load(p);
  ASSERT_EQ(sd.size(), 9u);
  std::size_t at = 6;
  for (int i = 0; i < 8; ++i) {
    const std::size_t n = 257u * static_cast<std::size_t>(129 + i);
    expect_bf16_of(sd.at("t." + std::to_string(i) + ".weight"), data.data() + at, n);
    at += n * 4;
  }
}

// Reads fail once the load is under way: a typed error naming the file,
// after the conversions queued have drained; the pool is intact for the
// next load, whose values are right.
TEST(HostConvertTest, AFailedReadEndsTheLoadAfterItsConversionsDrain) {
  class FailingEnv : public EnvWrapper {
   public:
    using EnvWrapper::EnvWrapper;
    std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
      if (offset >= (256u << 10) && bytes >= 4096) return -EIO;
      return EnvWrapper::pread(fd, buffer, bytes, offset);
    }
  } failing(default_env());
  TempDir dir;
  const std::string path = dir.file("f32.safetensors");
  const std::vector<std::uint8_t> data = fp32_checkpoint(path, 24);
  LoadOptions options;
  options.dtype.to = DType::kBF16;
  options.block_size = 64 * 1024;
  options.direct = DirectIo::kOff;
  options.cached_read = CachedRead::kPread;
  options.zero_copy = ZeroCopy::kOff;
  const std::shared_ptr<Pool> pool = Pool::create_default();
  try {
    (void)Loader(options, pool, &failing).load({path});
    FAIL() << "the load succeeded";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool->stats().live_blocks, 0u);
  const StateDict sd = Loader(options, pool).load({path});
  const Tensor& t = sd.at("t.23.weight");
  const std::size_t n = 257u * 152u, at = data.size() - n * 4;
  for (std::size_t k = 0; k < n; k += 97) {
    float f = 0;
    std::memcpy(&f, data.data() + at + k * 4, 4);
    std::uint16_t got = 0;
    std::memcpy(&got, t.data() + k * 2, 2);
    ASSERT_EQ(got, bits::f32_to_bf16(f)) << "element " << k;
  }
}

// Long runs are written with non-temporal stores (Note [Streaming stores] in
// dtype_convert.cc), from any output alignment: the same values as element
// by element conversions (short runs, plain stores), and nothing written
// outside the output range.
TEST(HostConvertTest, StreamedRunsEqualElementwiseAtEveryAlignment) {
  std::mt19937_64 rng(18);
  constexpr std::size_t kElements = 300000;  // > 256 KiB of 16-bit output
  std::vector<std::uint8_t> src(kElements * 4);
  for (auto& b : src) b = static_cast<std::uint8_t>(rng());
  for (std::size_t i = 3; i < src.size(); i += 4) src[i] &= 0x7F;  // fewer NaN fp32
  const std::vector<ElementConversion> cases = {{DType::kF8_E4M3, DType::kBF16, kElements, 0.5f},
                                                {DType::kF8_E5M2, DType::kF16, kElements, 2.0f},
                                                {DType::kF8_E4M3, DType::kF32, kElements, 0.25f},
                                                {DType::kF32, DType::kBF16, kElements},
                                                {DType::kBF16, DType::kF32, kElements},
                                                {DType::kF16, DType::kBF16, kElements}};
  for (const ElementConversion& c : cases) {
    const std::size_t in = dtype_bits(c.from) / 8, out = dtype_bits(c.to) / 8;
    std::vector<std::uint8_t> want(kElements * out);
    for (std::size_t i = 0; i < kElements; ++i) {
      ElementConversion one = c;
      one.elements = 1;
      convert_elements(one, src.data() + i * in, want.data() + i * out);
    }
    for (std::size_t shift : {0, 1, 2, 6, 62}) {
      std::vector<std::uint8_t> got(kElements * out + 128, 0xEE);
      convert_elements(c, src.data(), got.data() + shift);
      ASSERT_EQ(0, std::memcmp(got.data() + shift, want.data(), want.size()))
          << dtype_name(c.from) << "->" << dtype_name(c.to) << " at shift " << shift;
      for (std::size_t i = 0; i < shift; ++i) ASSERT_EQ(got[i], 0xEE);
      for (std::size_t i = shift + want.size(); i < got.size(); ++i) ASSERT_EQ(got[i], 0xEE);
    }
  }
}

// The stand-in's conversions run in stream order, after the copy before them.
TEST(DeviceConvertTest, SimConvertsAfterTheCopyOnItsStream) {
  std::unique_ptr<Device> device = make_sim_device(SimDeviceOptions{.copy_delay = std::chrono::milliseconds(20)});
  Stream stream = device->create_stream();
  std::vector<std::uint8_t> fp8(256);
  for (int i = 0; i < 256; ++i) fp8[i] = static_cast<std::uint8_t>(i);
  auto in = device->allocate(256);
  auto out = device->allocate(256 * 2);
  device->copy_to_device_async(*in, 0, fp8.data(), fp8.size(), stream);
  ElementConversion c{DType::kF8_E4M3, DType::kBF16, 256, 2.0f};
  device->convert_async(*out, 0, *in, 0, c, stream);
  std::vector<std::uint16_t> got(256);
  device->copy_to_host(got.data(), *out, 0, 512);
  std::vector<std::uint16_t> want(256);
  convert_elements(c, fp8.data(), want.data());
  EXPECT_EQ(got, want);
  EXPECT_EQ(got[0x38], bits::f32_to_bf16(2.0f));  // 0x38 is 1.0 in e4m3fn
}

// Note [Device conversion pipeline]: a tensor's conversion runs once its own
// copies are done, while later copies are still going. The copies of the
// int tensor stored after the two converted ones are held until a conversion
// has begun: a pipeline that converted only after every copy would time out.
TEST(DeviceConvertTest, SimLoadConvertsWhileLaterCopiesRun) {
  TempDir dir;
  std::mt19937_64 rng(5);
  testing::FileImage image = testing::make_image(
      {{"a.weight", "F32", {64, 1024}}, {"b.weight", "F32", {64, 1024}}, {"c.index", "I32", {256, 1024}}}, rng);
  for (std::size_t i = 3; i < 2 * 64 * 1024 * 4; i += 4) image.data[i] &= 0x7F;  // finite-ish floats
  const std::string path = dir.file("m.safetensors");
  testing::write_file(path, image.bytes());

  std::mutex mu;
  std::condition_variable cv;
  bool converting = false;
  int copies = 0;
  bool held_too_long = false;
  SimDeviceOptions sim;
  sim.before_convert = [&](std::uint64_t) {
    std::lock_guard lock(mu);
    converting = true;
    cv.notify_all();
  };
  sim.before_copy = [&](std::size_t) {
    std::unique_lock lock(mu);
    // The first 5 chunks of 128 KiB cover the header, a and b (512 KiB).
    if (++copies <= 6) return;
    if (!cv.wait_for(lock, std::chrono::seconds(10), [&] { return converting; })) held_too_long = true;
  };
  std::unique_ptr<Device> device = make_sim_device(std::move(sim));
  LoadOptions options;
  options.threads = 1;  // chunks submitted in file order
  options.block_size = 128u << 10;
  options.direct = DirectIo::kOff;
  options.target.device = device.get();
  options.target.copy.streams = 1;  // copies start in submission order
  options.dtype.to = DType::kBF16;
  StateDict on_device = Loader(options).load({path});
  EXPECT_FALSE(held_too_long) << "no conversion began before the last copies";
  EXPECT_GT(copies, 6);

  // The values: as the host path converts them (tested against torch).
  LoadOptions host;
  host.dtype.to = DType::kBF16;
  host.direct = DirectIo::kOff;
  StateDict on_host = Loader(host).load({path});
  for (const char* name : {"a.weight", "b.weight", "c.index"}) {
    const Tensor& d = on_device.at(name);
    const Tensor& h = on_host.at(name);
    ASSERT_EQ(d.dtype(), h.dtype()) << name;
    std::vector<std::byte> got(d.nbytes());
    device->copy_to_host(got.data(), *d.device_buffer(), d.device_offset(), got.size());
    EXPECT_EQ(0, std::memcmp(got.data(), h.data(), got.size())) << name;
  }
  EXPECT_EQ(on_device.at("a.weight").dtype(), DType::kBF16);
}

// Device::wait orders a stream behind another stream's event.
TEST(DeviceConvertTest, SimStreamWaitsForAnEventOfAnotherStream) {
  std::unique_ptr<Device> device = make_sim_device(SimDeviceOptions{.copy_delay = std::chrono::milliseconds(50)});
  Stream copies = device->create_stream();
  Stream work = device->create_stream();
  std::vector<std::uint8_t> fp8(4096, 0x38);  // 1.0
  auto in = device->allocate(fp8.size());
  auto out = device->allocate(fp8.size() * 2);
  device->copy_to_device_async(*in, 0, fp8.data(), fp8.size(), copies);
  device->wait(work, device->record(copies));  // the event may go at once
  device->convert_async(*out, 0, *in, 0, {DType::kF8_E4M3, DType::kBF16, fp8.size(), 1.0f}, work);
  work.synchronize();
  std::vector<std::uint16_t> got(fp8.size());
  device->copy_to_host(got.data(), *out, 0, got.size() * 2);
  EXPECT_EQ(got, std::vector<std::uint16_t>(fp8.size(), bits::f32_to_bf16(1.0f)));
  EXPECT_THROW(device->wait(work, Event()), InvalidArgumentError);
}

TEST(DeviceConvertTest, RangesAndPairsAreChecked) {
  std::unique_ptr<Device> device = make_sim_device();
  Stream stream = device->create_stream();
  auto in = device->allocate(64);
  auto out = device->allocate(64);
  EXPECT_THROW(device->convert_async(*out, 0, *in, 0, {DType::kF8_E4M3, DType::kBF16, 64}, stream),
               InvalidArgumentError);  // 128 output bytes
  EXPECT_THROW(device->convert_async(*out, 0, *in, 0, {DType::kBF16, DType::kF8_E4M3, 4}, stream),
               InvalidArgumentError);  // not a load conversion
  std::unique_ptr<Device> other = make_sim_device();
  auto foreign = other->allocate(64);
  EXPECT_THROW(device->convert_async(*out, 0, *foreign, 0, {DType::kF8_E4M3, DType::kBF16, 4}, stream),
               InvalidArgumentError);
}

TEST(DeviceConvertTest, FailedConversionFailsTheStream) {
  // A conversion queued after a failed copy is skipped; the stream reports the failure.
  std::unique_ptr<Device> device = make_sim_device(
      SimDeviceOptions{.before_copy = [](std::size_t) { throw std::runtime_error("injected copy failure"); }});
  Stream stream = device->create_stream();
  std::vector<std::uint8_t> src(16, 0x38);
  auto in = device->allocate(16);
  auto out = device->allocate(32);
  device->copy_to_device_async(*in, 0, src.data(), 16, stream);
  EXPECT_THROW(
      {
        device->convert_async(*out, 0, *in, 0, {DType::kF8_E4M3, DType::kBF16, 16}, stream);
        stream.synchronize();
      },
      DeviceError);
}

}  // namespace
}  // namespace pinload
