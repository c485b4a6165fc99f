// pinload/shard.h: rank-aware loading, where each rank of a tensor-parallel
// job reads only its share of a checkpoint.
//
// Two modes (Note [Shard modes]); both are plans of plain data built from the
// headers alone, executed by load_shard():
//   kSlice  each rank reads its slice of every tensor a rule splits, and the
//           whole of every other (replicated) tensor;
//   kShare  split tensors as in kSlice; each replicated tensor is read by one
//           rank only (its owner), which hands it to the others (the exchange
//           is the caller's: python/pinload/distributed.py broadcasts it
//           through the torch.distributed process group).
//
// Note [Shard modes]
// A rule says which dimension a tensor is split on, as vLLM's column-parallel
// (dim 0: q/k/v, gate/up, embeddings) and row-parallel (dim 1: o, down)
// layers do. Rank r of N takes rows [n*r/N, n*(r+1)/N) of that dimension (n
// its size; the usual case, n divisible by N, gives n/N each). A slice on
// dim 0 is one contiguous byte range; a slice on dim d > 0 is prod(shape[:d])
// strided pieces of (its rows) * prod(shape[d+1:]) elements. Pieces are read
// through aligned reads (the file's direct-I/O alignment), and reads whose
// aligned ranges touch, or are at most `max_gap` bytes apart, are merged up
// to block_size. A strided piece smaller than the alignment still costs an
// aligned read: a row-parallel slice of rows of under alignment*N bytes reads
// more than 1/N of its tensor (max_gap trades bytes for fewer reads).
// In kShare, each replicated tensor has one owner, the same on every rank.
// With window_bytes 0 the replicated bytes, in load order, are cut into N
// contiguous ranges of about equal bytes, and a tensor belongs to the rank
// whose range holds its first byte: each rank reads one sequential sweep of
// about 1/N. With window_bytes > 0 they are cut into windows of at most that
// many bytes (a larger tensor is a window of its own), and within a window
// the tensors go, largest first, to the rank with the fewest bytes so far,
// counted across windows, so the ranks stay balanced to within about one
// tensor. No byte is read twice across the ranks.
//
// Note [Shard batches]
// A plan is cut into batches of at most `batch_bytes` of destination memory
// (0: one batch; a tensor larger than that is a batch of its own); a kShare
// window starts a new batch. ShardLoad reads one batch ahead of the one
// handed out, so peak memory is about two batches plus what the caller keeps:
// this is how both modes honour a streaming budget.
#pragma once

#include <cstdint>
#include <memory>
#include <stop_token>
#include <string>
#include <vector>

#include "pinload/byte_source.h"
#include "pinload/checkpoint.h"
#include "pinload/dtype.h"
#include "pinload/env.h"
#include "pinload/pool.h"
#include "pinload/read_plan.h"
#include "pinload/state_dict.h"

namespace pinload {

inline constexpr int kReplicated = -1;

// Tensors whose full name matches `pattern` (std::regex_search, ECMAScript)
// are split on `dim`, or replicated with kReplicated. The first match wins;
// a tensor no rule matches is replicated.
struct ShardRule {
  std::string pattern;
  int dim = 0;
};

enum class ShardMode { kSlice, kShare };

struct ShardSpec {
  int rank = 0;
  int world_size = 1;
  ShardMode mode = ShardMode::kSlice;
  std::vector<ShardRule> rules;
  std::uint64_t window_bytes = 0;  // kShare: Note [Shard modes]
};

// One tensor of the checkpoint as the plan sees it, in load order.
struct ShardTensor {
  std::string name;            // with the file's name_prefix
  std::uint32_t file = 0;      // index into Checkpoint::files
  DType dtype = DType::kU8;
  std::vector<std::uint64_t> shape;  // of the whole tensor
  std::uint64_t file_offset = 0;     // of its first byte in the file
  int dim = kReplicated;             // split dimension
  std::uint64_t begin = 0, end = 0;  // this rank's rows of `dim`
  int owner = -1;       // kShare, replicated: the rank that reads it; else -1
  std::uint32_t window = 0;          // kShare: its window
  // Filled for the tensors this rank reads:
  bool read = false;
  std::uint32_t batch = 0;
  std::uint64_t dest_offset = 0;     // in its batch's block
  std::uint64_t nbytes = 0;          // of this rank's part
  std::vector<std::uint64_t> part_shape() const;
};

// A contiguous byte range of a file that lands at dest_offset of a batch.
struct ShardPiece {
  std::uint64_t file_offset = 0;
  std::uint64_t length = 0;
  std::uint64_t dest_offset = 0;
};

// One read call: [offset, offset + length) of a file (aligned for direct
// reads), serving pieces [first_piece, first_piece + piece_count).
struct ShardRead {
  std::uint32_t file = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::uint64_t valid = 0;  // length clipped at the file's end
  std::uint32_t first_piece = 0, piece_count = 0;
};

struct ShardBatch {
  std::uint64_t dest_bytes = 0;
  std::uint32_t first_read = 0, read_count = 0;
  std::vector<std::uint32_t> tensors;  // indices into ShardPlan::tensors, load order
};

struct ShardPlan {
  ShardSpec spec;
  std::vector<FileRead> files;       // path, size, alignment, direct
  std::vector<ShardTensor> tensors;  // every tensor of the checkpoint
  std::vector<ShardPiece> pieces;
  std::vector<ShardRead> reads;      // grouped by batch, then by file and offset
  std::vector<ShardBatch> batches;
  std::uint64_t read_bytes = 0;  // sum of ShardRead::valid: what this rank reads
  std::uint64_t dest_bytes = 0;  // sum of the batches' dest_bytes
};

struct ShardPlanOptions {
  std::size_t block_size = 8u << 20;  // the longest merged read
  std::uint64_t max_gap = 0;          // Note [Shard modes]
  std::uint64_t batch_bytes = 0;      // Note [Shard batches]
};

// Builds rank spec.rank's plan over `checkpoint`; `files` gives each file's
// alignment and whether it is read direct (same order as checkpoint.files;
// empty: buffered, alignment 1). No I/O. Throws InvalidFileError for a bad
// spec (rank outside [0, world_size), a rule's bad regex or a dimension the
// tensor lacks, a split of a sub-byte dtype on its last dimension).
ShardPlan make_shard_plan(const Checkpoint& checkpoint, const ShardSpec& spec, std::vector<FileRead> files,
                          const ShardPlanOptions& options = {});

struct ShardLoadOptions {
  unsigned threads = 8;
  std::size_t block_size = 8u << 20;
  bool direct = true;  // O_DIRECT where the file allows it and is not cached, else buffered
  std::uint64_t max_gap = 0;
  std::uint64_t batch_bytes = 0;
  // Wraps each file's source (Note [Byte sources] in byte_source.h).
  WrapSource wrap_source;
};

// Executes a shard plan, batch by batch (Note [Shard batches]). Owns its
// reader thread; destroying it stops the reads and joins. next() is called
// from one thread at a time.
class ShardLoad {
 public:
  // Opens the files of `paths` (as Loader::load takes them) and plans them
  // for `spec`. `pool` null: a pool of its own. Throws pinload::Error.
  ShardLoad(const std::vector<std::string>& paths, const ShardSpec& spec, const ShardLoadOptions& options = {},
            std::shared_ptr<Pool> pool = nullptr, Env* env = nullptr);
  ~ShardLoad();
  ShardLoad(const ShardLoad&) = delete;
  ShardLoad& operator=(const ShardLoad&) = delete;

  // The tensors of the next batch (this rank's parts, as ShardTensor::
  // part_shape), once read; empty after the last. Throws what the reads threw
  // (IoError naming the file and range), then hands out nothing more.
  StateDict next();
  const ShardPlan& plan() const noexcept;
  std::uint64_t bytes_read() const noexcept;  // so far, by this load

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// All of this rank's tensors at once: next() until empty, merged.
StateDict load_shard(const std::vector<std::string>& paths, const ShardSpec& spec,
                     const ShardLoadOptions& options = {}, std::shared_ptr<Pool> pool = nullptr,
                     Env* env = nullptr);

}  // namespace pinload
