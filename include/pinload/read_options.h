// pinload/read_options.h: how the files of a load are opened and read.
//
// These are the io layer's options (the chunk executor, src/io/read_session.h):
// a Loader's LoadOptions (loader.h) carries them among its own fields and
// hands them down with LoadOptions::read_options(). The rationale of each
// choice is in loader.h's Notes: [Direct I/O], [Mapped reads], [Block size],
// [Direct reads in flight].
#pragma once

#include <cstddef>

#include "pinload/byte_source.h"
#include "pinload/remote.h"

namespace pinload {

// DirectIo, CachedRead and kDefaultResidentThreshold are in byte_source.h.

// Reader threads: LoadOptions::threads, and the other commands' --threads.
inline constexpr unsigned kDefaultThreads = 8;
inline constexpr unsigned kMaxThreads = 1024;
inline constexpr unsigned kDirectReadsInFlight = 32;  // Note [Direct reads in flight] in loader.h
inline constexpr std::size_t kDefaultBlockSize = 8u << 20;  // Note [Block size] in loader.h
inline constexpr std::size_t kTaperBlockSize = 1u << 20;    // Note [Tapered tail] in read_plan.h
inline constexpr std::size_t kMinBlockSize = 4u << 10;
inline constexpr std::size_t kMaxBlockSize = 1u << 30;
inline constexpr std::size_t kDefaultFilesInFlight = 2;

// How a session opens and reads its files. The fields mean what LoadOptions'
// fields of the same names mean; LoadOptions::validate() checks them.
struct ReadOptions {
  std::size_t block_size = kDefaultBlockSize;           // bytes per read call
  DirectIo direct = DirectIo::kAuto;                    // Note [Direct I/O] in loader.h
  std::size_t files_in_flight = kDefaultFilesInFlight;  // shards read at once, >= 1
  // A file at least this resident in the page cache is read buffered under
  // DirectIo::kAuto, and a buffered one is mapped unless CachedRead::kPread.
  double resident_threshold = kDefaultResidentThreshold;
  CachedRead cached_read = CachedRead::kAuto;
  RemoteOptions remote;  // s3:// and http(s):// files: connections, retries, cache
  // Wraps each file's source (Note [Byte sources] in byte_source.h); empty:
  // none. Tests inject faults with it.
  WrapSource wrap_source;
};

}  // namespace pinload
