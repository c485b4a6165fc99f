// pinload/read_plan.h: what to read, as plain data.
//
// A plan lists, per file, the aligned byte range that lands in that file's
// pool block, and the chunks (block_size pieces of those ranges, smaller at a
// tapered end: Note [Tapered tail]) in the order
// worker threads should claim them. Building a plan does no I/O, so plans are
// tested on their own; threads only execute them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pinload/io_template.h"

namespace pinload {

struct FileRead {
  std::string path;
  std::uint64_t file_size = 0;
  std::uint64_t data_offset = 0;  // where the data section starts in the file
  std::uint32_t alignment = 1;    // offsets and lengths of direct reads
  bool direct = false;
  // Filled by make_read_plan:
  std::uint64_t read_begin = 0;  // data_offset rounded down to alignment
  std::uint64_t read_end = 0;    // file_size rounded up to alignment
  std::uint32_t chunk_count = 0; // chunks in the file's sweep
  std::uint64_t block_bytes() const noexcept { return read_end - read_begin; }
  // Where the data section starts inside the file's block.
  std::uint64_t data_in_block() const noexcept { return data_offset - read_begin; }
};

struct ReadChunk {
  std::uint32_t file = 0;     // index into ReadPlan::files
  std::uint32_t index = 0;    // position in the file's sweep: chunk `index` starts before chunk `index + 1`
  std::uint64_t offset = 0;   // in the file; lands at offset - read_begin in the block
  std::uint64_t length = 0;   // a multiple of the file's alignment
  std::uint64_t valid = 0;    // bytes that must arrive: length clipped at file_size
};

struct ReadPlan {
  std::vector<FileRead> files;
  std::vector<ReadChunk> chunks;  // claim order
  std::uint64_t total_bytes = 0;  // sum of ReadChunk::valid
};

struct PlanOptions {
  std::size_t block_size = 8u << 20;  // bytes per read call (Note [Block size] in loader.h)
  // Files read at the same time. Chunks of that many files are interleaved, so
  // each file is still swept sequentially.
  std::size_t files_in_flight = 1;
  // Note [Tapered tail]: a plan of more than 4 x taper_bytes cuts its last
  // taper_bytes (in claim order) into chunks of taper_block_size, the 2 x
  // taper_bytes before them into chunks twice that, and so on. 0: none.
  std::uint64_t taper_bytes = 0;
  std::size_t taper_block_size = 0;
};

// Note [Tapered tail]
// Whatever follows a load's last reads (dtype conversions, handing tensors
// out) overlaps no read. A disk that completes the reads in flight in bursts
// makes that tail the work of a whole burst: on this VM's virtio disk, strace
// of a 340 MB FP8 load showed 31 of its 32 direct reads of 8 MiB returning
// within 1 ms, and the last 10 together 45 ms later, after which their 80 MB
// were still to convert. Chunks that halve towards the end make each burst
// about half the one before, so its work overlaps the next burst's reads, and
// leave the last burst one chunk of taper_block_size per reader in flight.
// Regions round up to whole chunks of the plan. fp8-bench (512 MiB, 9
// rounds): FP8 -> bf16 took 6-10 ms more than reading the FP8 file as stored,
// against 23-26 ms untapered. ReadSession tapers only loads of more than 4 x
// taper_bytes (one read per small file stays one read) that end in direct
// reads into pool blocks: copies from a mapping pay per chunk (Note [Block
// size] in loader.h), and a streamed load's staging blocks are block_size
// whatever the read. A replayed I/O template keeps its recorded reads.

// Fills read_begin/read_end of every file and cuts them into chunks, tapered
// as `options` says (taper_tail).
ReadPlan make_read_plan(std::vector<FileRead> files, const PlanOptions& options);

// Note [Tapered tail]: cuts the end of a plan from make_read_plan as options'
// taper_bytes and taper_block_size say (nothing where they are 0).
void taper_tail(ReadPlan& plan, const PlanOptions& options);

// `plan` (from make_read_plan) with its chunks replaced by `reads`, a
// recorded I/O template's (io_template.h), in their order: only when they
// tile every file's aligned range exactly (each byte once, every offset and
// end aligned, nothing past read_end); else nullopt, since a template is
// never trusted. Sets each chunk's index (its rank in its file's sweep),
// valid, the files' chunk_count and total_bytes.
std::optional<ReadPlan> replay_plan(const ReadPlan& plan, std::span<const TemplateRead> reads);

}  // namespace pinload
