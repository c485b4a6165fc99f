// Internal: the one retry loop around Env::pread, and the one around
// Env::pwrite (write_full).
//
// Every reader of a local file (the chunk executor, the sharded loader,
// conversions, manifests, the warmer, memory probes, header reads through
// pread_exact) reads through read_full, so EINTR, EAGAIN and short reads are
// handled in one place. Callers keep their own error messages: read_full
// reports what happened and throws nothing.
//
// Thread safety: as the Env's pread (any thread).
#pragma once

#include <cstddef>
#include <cstdint>

#include "pinload/env.h"

namespace pinload {

struct ReadResult {
  std::uint64_t bytes = 0;  // read into the buffer, from its start
  int error = 0;            // errno of the pread that failed (never EINTR or EAGAIN); 0: none
  bool ended = false;       // a pread returned 0: the file ended at offset + bytes
};

// Reads `need` bytes of `fd` at `offset` into `buffer`: preads again after
// EINTR, EAGAIN and short reads. Each pread asks for up to `ask` bytes (at
// least `need`: an O_DIRECT read asks for a whole aligned length; the buffer
// must hold `ask` bytes), less what has arrived. Returns once `need` bytes
// have arrived (`bytes` may then exceed it, up to `ask`), at the first error,
// at the end of the file, or, with `alignment` above 1 (O_DIRECT), after a
// short read that leaves the position off the alignment, where the caller
// goes on with a buffered descriptor.
ReadResult read_full(Env* env, int fd, void* buffer, std::uint64_t need, std::uint64_t offset,
                     std::uint64_t ask = 0, std::uint64_t alignment = 1);

struct WriteResult {
  std::uint64_t bytes = 0;  // written from the buffer's start
  int error = 0;            // errno of the pwrite that failed (never EINTR or EAGAIN); 0: none
};

// Writes `bytes` of `buffer` to `fd` at `offset`: pwrites again after EINTR,
// EAGAIN and short writes. A pwrite that writes nothing is ENOSPC's
// equivalent for a caller: error EIO. Every writer (the converter, the remote
// cache, write_file_atomically) writes through it.
WriteResult write_full(Env* env, int fd, const void* buffer, std::uint64_t bytes, std::uint64_t offset);

}  // namespace pinload
