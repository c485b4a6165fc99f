// Internal: the files of a host load handed out as views of leased file
// mappings instead of being read (Note [Zero-copy loads] in loader.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <vector>

#include "io/leased_mapping.h"
#include "pinload/checkpoint.h"
#include "pinload/loader.h"
#include "pinload/pool.h"

namespace pinload::detail {

// Note [Keeping the page cache] (loader.h): whether a load of `bytes` reads
// its cold files through the page cache and leaves them there. The option,
// else PINLOAD_PAGE_CACHE, else the rule: `only_copy` (the page cache would
// hold the load's only host copy) and `bytes` at most kKeepFraction of the
// memory left (read from options.memory_root). Never throws.
bool keep_page_cache(const LoadOptions& options, Env* env, std::uint64_t bytes, bool only_copy);

// For each file of `checkpoint`, its mapping, or null where it is read into
// `pool` instead: the load's options, the pool's idle memory and the file's
// residency and keep_page_cache decide (the Notes), each asked through `env`.
// Called only for host loads without conversion. Never throws for a file it
// cannot map.
std::vector<std::shared_ptr<LeasedMapping>> choose_zero_copy(const LoadOptions& options, Env* env,
                                                             const Checkpoint& checkpoint, const Pool& pool);

// A file handed out whole from memory that holds all of it (a leased
// mapping, a node-store entry: store.h): its first byte, and a Block over it
// that keeps it alive. Null where the file is read instead.
struct MappedFile {
  const std::byte* data = nullptr;
  std::shared_ptr<Block> block;
};

// Faults the data sections of `mappings` in (MADV_POPULATE_READ) with
// `threads` threads, reading from the disk what the page cache lacks, so that
// the load returns with its bytes in memory. Throws CancelledError once
// `stop` is requested, IoError for a read error.
void populate_mapped(Env* env, const std::vector<MappedFile>& mappings, const Checkpoint& checkpoint, unsigned threads,
                     std::size_t block_size, std::stop_token stop);

// A host load of `checkpoint` with the files choose_zero_copy picks handed
// out as mappings and the others loaded by `read` (a checkpoint of just
// those, loaded as usual). Mapped tensors go to `hand_out` once in memory;
// `counters` gains their files and bytes. Returns nullopt, having done
// nothing, when no file is mapped; an empty state dict when
// `counters->stream`. Throws what `read` and populate_mapped throw.
std::optional<StateDict> load_zero_copy(const LoadOptions& options, Env* env, const Checkpoint& checkpoint, const Pool& pool,
                                        Loader::Counters* counters, std::stop_token stop,
                                        const std::function<void(std::vector<Tensor>)>& hand_out,
                                        const std::function<StateDict(const Checkpoint&)>& read);

// What load_zero_copy does once it has its mappings, for any MappedFile:
// populates them, hands their tensors out, loads the other files with `read`
// and returns every tensor in load order. *files_counter gains the mapped
// files.
StateDict hand_out_mapped(const LoadOptions& options, Env* env, const Checkpoint& checkpoint, std::vector<MappedFile> mapped,
                          std::atomic<std::uint64_t>* files_counter, Loader::Counters* counters, std::stop_token stop,
                          const std::function<void(std::vector<Tensor>)>& hand_out,
                          const std::function<StateDict(const Checkpoint&)>& read);

}  // namespace pinload::detail
