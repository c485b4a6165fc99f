// pinload/file_identity.h: "is this still the same file?"
//
// A file's identity is the device and inode that name it, with its size,
// modification and change times and the inode's generation: a rename over the
// path (a new inode), a rewrite in place (a new mtime, and a new ctime even
// where the mtime is set back), a truncation (a new size) or a deleted file's
// inode number reused (a new ctime and generation) each change it. pinload compares
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
  // 0 where unknown (an identity recorded without them, as an I/O template's),
  // and then not compared: FileStat's fields of the same names.
  std::int64_t ctime_ns = 0;
  std::uint64_t generation = 0;

  // The identity in a stat from Env::stat.
  static FileIdentity of(const FileStat& st) noexcept {
    return FileIdentity{st.device, st.inode, st.size, st.mtime_ns, st.ctime_ns, st.generation};
  }

  bool operator==(const FileIdentity& o) const noexcept {
    return device == o.device && inode == o.inode && size == o.size && mtime_ns == o.mtime_ns &&
           (ctime_ns == 0 || o.ctime_ns == 0 || ctime_ns == o.ctime_ns) &&
           (generation == 0 || o.generation == 0 || generation == o.generation);
  }

  // "device 8:1 inode 1234, 4096 bytes, mtime 1700000000.000000001, ctime
  // 1700000000.000000002, generation 7", for messages.
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
