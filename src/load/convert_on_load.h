// Internal: the conversions of one load with LoadOptions::dtype set (Note
// [Conversion on load] in convert.h), as plain data planned before any read,
// then executed by converting threads fed by the readers (host) or the
// device (device loads).
//
// Thread safety: plan_conversions and the finish_* calls run on the load's
// thread; convert_chunk may run on many threads at once (each writes
// only the output bytes of the elements inside its own chunk).
#pragma once

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <thread>
#include <vector>

#include "pinload/checkpoint.h"
#include "pinload/convert.h"
#include "pinload/copy_engine.h"
#include "pinload/device.h"
#include "pinload/env.h"
#include "pinload/pool.h"
#include "pinload/read_plan.h"

namespace pinload::detail {

// One tensor handed out in another dtype than stored; or, in a staged load,
// a kept tensor whose bytes are copied as they are (`copy`).
struct TensorConversion {
  std::size_t file = 0;         // index into Checkpoint::files
  std::size_t tensor = 0;       // index into that file's header.tensors
  DType from = DType::kF32;
  DType to = DType::kF32;
  std::uint64_t in_begin = 0;   // absolute file offset of its first byte
  std::uint64_t elements = 0;   // bytes, for a copy
  std::uint64_t out_offset = 0; // in its file's output block / buffer
  bool copy = false;            // from == to: the stored bytes as they are
  float scale = 1.0f;           // per tensor
  std::vector<float> row_scales;          // per row (host copy)
  std::uint64_t row_elements = 0;

  // Bytes per element stored and handed out (1 for a copy: bytes as elements).
  unsigned in_unit() const noexcept { return copy ? 1 : dtype_bits(from) / 8; }
  unsigned out_unit() const noexcept { return copy ? 1 : dtype_bits(to) / 8; }
  std::uint64_t in_bytes() const noexcept { return elements * in_unit(); }
  std::uint64_t out_bytes() const noexcept { return elements * out_unit(); }
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
  // Read through staging blocks, every tensor handed out from the output
  // blocks (Note [Staged conversion] in convert_on_load.cc).
  bool staged = false;

  bool empty() const noexcept { return tensors.empty(); }
};

inline constexpr std::int64_t kKeptTensor = -1;
inline constexpr std::int64_t kDroppedTensor = -2;

// Decides what converts, checks and reads the scales (a few bytes each,
// pread through `env`). With `may_stage` (a host load reading afresh), a
// load whose conversions are most of its bytes is staged, its kept tensors
// planned as copies (Note [Staged conversion]). Throws InvalidFileError
// naming the tensor for a bad or missing scale.
// Whether `options` converts any tensor of `checkpoint`: an FP8 tensor, or a
// floating tensor whose target differs from its stored dtype (Note [A dtype
// that changes nothing] in convert_on_load.cc). Reads headers only; throws
// as plan_conversions does for a dtype it cannot convert to.
bool conversion_changes_anything(const Checkpoint& checkpoint, const DTypeOptions& options);

ConversionPlan plan_conversions(Env* env, const Checkpoint& checkpoint, const DTypeOptions& options,
                                bool may_stage = false);

// Note [Conversion ring] in convert_on_load.cc: what a staged load's ring of
// staging blocks holds at most (chunks read, being read or waiting for their
// conversion), and how many of them are being read at once.
inline constexpr std::size_t kConversionRingChunks = 24;
inline constexpr std::size_t kConversionRingBytes = std::size_t{192} << 20;
inline constexpr std::size_t kConversionRingReads = 16;

// The chunks of up to `chunk_bytes` a staged load holds at once:
// kConversionRingChunks within kConversionRingBytes, at least two; with
// `network_readers` (ReadSession::network_readers, 0 for local files), one
// chunk per reader and two per converting thread.
std::size_t conversion_ring_chunks(std::size_t chunk_bytes, unsigned network_readers, unsigned threads) noexcept;
// Of those, the chunks being read at once: two thirds of the ring's
// (kConversionRingReads of 8 MiB), at least one; with `network_readers`, no
// bound but the ring's.
std::size_t conversion_ring_reads(std::size_t chunk_bytes, unsigned network_readers) noexcept;

// Host loads: converts the elements of planned tensors that lie wholly
// inside the chunk [c.offset, c.offset + c.valid) of its file, whose bytes
// are at `chunk_data`, into out_blocks[c.file], faulting fresh output memory
// in through `env` first (Note [Page size of fresh memory]).
void convert_chunk(Env* env, const ConversionPlan& plan, const ReadChunk& c, const std::byte* chunk_data,
                   const std::vector<std::shared_ptr<Block>>& out_blocks);

// Host loads (Note [Converting beside the reads] in convert_on_load.cc):
// chunks handed over by the reader threads are converted by threads of
// their own, so that a reader issues its next read at once. In a staged
// load (Note [Staged conversion]) each chunk's staging block goes back to
// its pool once converted, readers pass admit() before each read, and
// finish() converts the elements across chunk edges from bytes kept at each
// edge.
//
// Thread safety: admit() and submit() may be called from many reader
// threads at once; finish() and the destructor on the load's thread.
class HostConversions {
 public:
  // `plan`, `read_plan` and `out_blocks` must outlive this object;
  // `threads` >= 1. Staged: at most `ring_chunks` (>= 1) chunks are
  // admitted and not yet converted at once, at most `ring_reads` (>= 1) of
  // them not yet read (Note [Conversion ring]).
  HostConversions(Env* env, const ConversionPlan& plan, const ReadPlan& read_plan,
                  const std::vector<std::shared_ptr<Block>>& out_blocks, unsigned threads,
                  std::size_t ring_chunks = SIZE_MAX, std::size_t ring_reads = SIZE_MAX);
  // Waits for the conversions queued (also after a failed load).
  ~HostConversions();
  HostConversions(const HostConversions&) = delete;
  HostConversions& operator=(const HostConversions&) = delete;

  // Staged: waits (until `stop`) while `ring_chunks` chunks are admitted and
  // not yet converted, or `ring_reads` not yet read; then admits one more.
  void admit(std::stop_token stop);
  // Queues chunk `c`, whose bytes are at `block->data() + offset`.
  void submit(const ReadChunk& c, std::shared_ptr<Block> block, std::size_t offset);
  // Waits until every chunk submitted is converted; rethrows the first
  // error of a conversion. Staged: then converts the elements across edges.
  void finish();

 private:
  struct Job {
    const ReadChunk* chunk;
    std::shared_ptr<Block> block;
    std::size_t offset;
    std::uint64_t submitted;  // LoadStages::now()
  };
  // A chunk's first and last bytes (up to 8 each), for elements across its
  // edges once its staging block has gone.
  struct Edges {
    std::array<std::byte, 8> head{}, tail{};
  };
  void run(std::stop_token stop);
  void wait();

  Env* env_;
  const ConversionPlan& plan_;
  const ReadPlan& read_plan_;
  const std::vector<std::shared_ptr<Block>>& out_blocks_;
  const std::size_t max_admitted_;  // staged
  const std::size_t max_reading_;   // staged
  std::vector<Edges> edges_;      // staged: per chunk of read_plan_
  std::mutex mu_;
  std::condition_variable_any ready_, drained_, room_;
  std::deque<Job> jobs_;
  std::size_t busy_ = 0;
  std::size_t admitted_ = 0;  // staged: read or being read, not yet converted
  std::size_t reading_ = 0;   // staged: admitted, not yet read
  std::exception_ptr error_;
  std::vector<std::jthread> threads_;
};

// Host loads, after every chunk: the few elements that straddle two chunks,
// from each file's whole block (`file_blocks[i]` holds file bytes from
// read_plan.files[i].read_begin). Staged loads: HostConversions::finish.
void convert_straddlers(const ConversionPlan& plan, const ReadPlan& read_plan,
                        const std::vector<std::shared_ptr<Block>>& file_blocks,
                        const std::vector<std::shared_ptr<Block>>& out_blocks);

// Device loads (Note [Device conversion pipeline] in convert_on_load.cc):
// each tensor's conversion is queued, on a conversion stream of its own, as
// soon as the copies of all its stored bytes have been submitted, behind
// events on the copy streams, so it runs while the later copies go on.
//
// Thread safety: copied() may be called from many reader threads at once;
// the constructor, finish() and the destructor on the load's thread.
class DeviceConversions {
 public:
  // `in[f]` holds file f's data section, `out[f]` its converted tensors;
  // both, `plan` and `engine` must outlive this object. Per-row scales are
  // queued for upload here. Throws DeviceError.
  DeviceConversions(const ConversionPlan& plan, const Checkpoint& checkpoint, Device& device, CopyEngine& engine,
                    std::vector<std::shared_ptr<DeviceBuffer>> in, std::vector<std::shared_ptr<DeviceBuffer>> out);
  // Waits for the conversions queued (never throws): the buffers stay valid
  // until the device is done with them, also when a load failed.
  ~DeviceConversions();
  DeviceConversions(const DeviceConversions&) = delete;
  DeviceConversions& operator=(const DeviceConversions&) = delete;

  // After the copy of file `file`'s data-section bytes [begin, end) (offsets
  // from the data section's start) has been submitted to the engine: queues
  // the conversions of the tensors whose stored bytes are now all submitted.
  // Throws DeviceError, InvalidFileError as Device::convert_async does.
  void copied(std::size_t file, std::uint64_t begin, std::uint64_t end);
  // After the last copy: queues any conversion not queued yet (none when
  // every byte was reported), then waits for all of them. Throws DeviceError.
  void finish();
  // How many conversions were queued before finish() (tests, logs).
  std::size_t queued_early() const noexcept { return queued_early_; }

 private:
  void launch(std::size_t k);  // under mu_

  const ConversionPlan& plan_;
  const Checkpoint& checkpoint_;
  Device& device_;
  CopyEngine& engine_;
  std::vector<std::shared_ptr<DeviceBuffer>> in_, out_;
  Stream stream_;
  std::vector<std::shared_ptr<DeviceBuffer>> row_scales_;  // per tensor, device copies (or null)
  std::mutex mu_;
  std::vector<std::uint64_t> missing_;  // per tensor: stored bytes not yet submitted
  std::vector<bool> launched_;
  std::size_t queued_early_ = 0;
  bool finished_ = false;
};

}  // namespace pinload::detail
