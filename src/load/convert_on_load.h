// Internal: the conversions of one load with LoadOptions::dtype set (Note
// [Conversion on load] in convert.h), as plain data planned before any read,
// then executed by the reader threads (host) or the device (device loads).
//
// Thread safety: plan_conversions and the finish_* calls run on the load's
// thread; convert_chunk may run on many reader threads at once (each writes
// only the output bytes of the elements inside its own chunk).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "pinload/checkpoint.h"
#include "pinload/convert.h"
#include "pinload/device.h"
#include "pinload/env.h"
#include "pinload/pool.h"
#include "pinload/read_plan.h"

namespace pinload::detail {

// One tensor handed out in another dtype than stored.
struct TensorConversion {
  std::size_t file = 0;         // index into Checkpoint::files
  std::size_t tensor = 0;       // index into that file's header.tensors
  DType from = DType::kF32;
  DType to = DType::kF32;
  std::uint64_t in_begin = 0;   // absolute file offset of its first byte
  std::uint64_t elements = 0;
  std::uint64_t out_offset = 0; // in its file's output block / buffer
  float scale = 1.0f;           // per tensor
  std::vector<float> row_scales;          // per row (host copy)
  std::uint64_t row_elements = 0;

  std::uint64_t in_bytes() const noexcept { return elements * (dtype_bits(from) / 8); }
  std::uint64_t out_bytes() const noexcept { return elements * (dtype_bits(to) / 8); }
  ElementConversion conversion(std::uint64_t first, std::uint64_t count) const noexcept;
};

struct ConversionPlan {
  std::vector<TensorConversion> tensors;
  // Per file: indices into `tensors`, by file offset; the output bytes.
  std::vector<std::vector<std::size_t>> by_file;
  std::vector<std::uint64_t> out_bytes;
  // Per file, per header tensor: -1 kept as stored, -2 dropped (a scale or
  // marker used by a dequantised weight), else the index into `tensors`.
  std::vector<std::vector<std::int64_t>> role;

  bool empty() const noexcept { return tensors.empty(); }
};

inline constexpr std::int64_t kKeptTensor = -1;
inline constexpr std::int64_t kDroppedTensor = -2;

// Decides what converts, checks and reads the scales (a few bytes each,
// pread through `env`). Throws InvalidFileError naming the tensor for a bad
// or missing scale.
ConversionPlan plan_conversions(Env* env, const Checkpoint& checkpoint, const DTypeOptions& options);

// Host loads: converts the elements of planned tensors that lie wholly
// inside the chunk [c.offset, c.offset + c.valid) of its file, whose bytes
// are at `chunk_data`, into out_blocks[c.file].
void convert_chunk(const ConversionPlan& plan, const ReadChunk& c, const std::byte* chunk_data,
                   const std::vector<std::shared_ptr<Block>>& out_blocks);

// Host loads, after every chunk: the few elements that straddle two chunks,
// from each file's whole block (`file_blocks[i]` holds file bytes from
// plan_files[i].read_begin).
void convert_straddlers(const ConversionPlan& plan, const ReadPlan& read_plan,
                        const std::vector<std::shared_ptr<Block>>& file_blocks,
                        const std::vector<std::shared_ptr<Block>>& out_blocks);

// Device loads, after the copies: queues every conversion on `stream` from
// the files' data sections (`in`) to `out`, then waits for them.
void convert_on_device(const ConversionPlan& plan, const Checkpoint& checkpoint, Device& device, Stream& stream,
                       const std::vector<std::shared_ptr<DeviceBuffer>>& in,
                       const std::vector<std::shared_ptr<DeviceBuffer>>& out);

}  // namespace pinload::detail
