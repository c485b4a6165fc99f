// pinload/file_identity.h: "is this still the same file?"
//
// A file's identity is the device and inode that name it, with its size and
// modification time: a rename over the path (a new inode), a rewrite in place
// (a new mtime) or a truncation (a new size) each change it. pinload compares
// identities wherever it reopens, replays or reuses a file it has seen before:
// a load's reads against the header it parsed (Note [One version per load] in
// checkpoint.h), the model cache's entries, I/O templates and prefetches.
#pragma once

#include <cstdint>
#include <string>

#include "pinload/env.h"

namespace pinload {

struct FileIdentity {
  std::uint64_t device = 0;
  std::uint64_t inode = 0;
  std::uint64_t size = 0;
  std::int64_t mtime_ns = 0;

  // The identity in a stat from Env::stat.
  static FileIdentity of(const FileStat& st) noexcept { return FileIdentity{st.device, st.inode, st.size, st.mtime_ns}; }

  bool operator==(const FileIdentity&) const = default;

  // "device 8:1 inode 1234, 4096 bytes, mtime 1700000000.000000001", for messages.
  std::string describe() const;
};

// Checks that `now`, a stat of `path`, has the identity `expected`. Throws
// IoError naming `path` and both identities where it does not ("replaced or
// modified since its header was read").
void check_identity(const FileStat& now, const std::string& path, const FileIdentity& expected);
// The same for the open file `fd`, stat'ed through `env` (IoError where the
// stat fails).
void check_identity(Env* env, int fd, const std::string& path, const FileIdentity& expected);

}  // namespace pinload
