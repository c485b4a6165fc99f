// pinload/io_template.h: the reads of a load, recorded once and replayed as
// the prefetch plan of later starts.
//
// An IoTemplate is plain data: the files a load read, with the identity they
// had (path, size, mtime, inode, device), and per destination ("host" or a
// device name such as "cuda:0") the reads it did, in the order they completed.
// A load records one (LoadRequest::record in loader.h); prefetch() replays one
// (prefetch.h). A template is never trusted: load_template() checks the file
// byte by byte and every file's identity, and returns nothing on any doubt.
//
// Byte layout of a template file (little-endian; version 1, or 2 when it
// names its readers: Note [Template versions]):
//   magic     8 bytes  "PLTMPL\0\1"
//   version   u32      1 or 2 (kTemplateVersion)
//   payload   u64      byte count of what follows, up to the checksum
//   files     u32 n, then n times:
//               u32 path length, path bytes, u32 prefix length, prefix bytes,
//               u64 size, i64 mtime_ns, u64 inode, u64 device
//   readers   (version 2 only) u32 r >= 1, then r times:
//               u32 pid, u32 comm length, comm bytes, u32 exe length, exe bytes
//   dests     u32 m, then m times:
//               u32 name length, name bytes, u64 k, then k times:
//                 u32 file, u64 offset, u64 length,
//                 (version 2 only) u32 reader (an index into readers, or kNoReader)
//   checksum  u64      FNV-1a 64 of every byte before it
// Every count is checked against the bytes left before anything is
// allocated; a file is at most kTemplateMaxFileSize bytes; a read must start
// inside its file and end at most kTemplateMaxAlign past its end (direct
// reads round up).
//
// Note [Template versions]
// Version 2 adds the readers: a template traced from processes that don't
// call pinload (pinload trace/agent, src/trace/) says which process made each
// read. A template without readers (pinload's own loads) is still written as
// version 1, byte for byte as before, so older pinloads keep replaying it;
// one with readers is written as version 2, which older pinloads ignore with
// a warning, as any template they cannot parse. Both versions parse. A
// version-2 file without readers is not canonical and is refused, so that
// parse and serialize round-trip exactly.
//
// Note [Template keys]
// A template file is named after the paths a service loads (template_path),
// not after the files' identity: when a file changes, the old template is
// found, its recorded identity disagrees, and it is ignored with a warning
// and overwritten by the next recording, instead of piling up stale files.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pinload/env.h"
#include "pinload/file_identity.h"

namespace pinload {

struct Checkpoint;

inline constexpr std::uint32_t kTemplateVersion = 2;  // the newest; 1 still parses and is written when it fits
inline constexpr std::uint32_t kNoReader = 0xffffffffu;
inline constexpr std::uint64_t kTemplateMaxAlign = 64u << 10;
inline constexpr std::uint64_t kTemplateMaxFileSize = 1ull << 62;
inline constexpr std::string_view kHostDestination = "host";

struct TemplateFile {
  std::string path;
  std::string name_prefix;  // "" or "<component>/" (checkpoint.h)
  std::uint64_t size = 0;
  std::int64_t mtime_ns = 0;
  std::uint64_t inode = 0;
  std::uint64_t device = 0;
  bool operator==(const TemplateFile&) const = default;
  FileIdentity identity() const noexcept { return FileIdentity{device, inode, size, mtime_ns}; }
};

// The process that made reads (a traced template's; pinload's own loads
// have none): its pid, its command name (/proc/<pid>/comm) and executable
// (/proc/<pid>/exe) as they were at its first recorded read; "" where the
// process could not be looked at (it had exited). The threads of a process
// are one reader.
struct TemplateReader {
  std::uint32_t pid = 0;
  std::string comm;
  std::string exe;
  bool operator==(const TemplateReader&) const = default;
};

struct TemplateRead {
  std::uint32_t file = 0;  // index into IoTemplate::files
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::uint32_t reader = kNoReader;  // index into IoTemplate::readers, or kNoReader
  bool operator==(const TemplateRead&) const = default;
};

struct TemplateReads {
  std::string destination;  // "host" or a device name
  std::vector<TemplateRead> reads;  // in the order they completed
};

struct IoTemplate {
  std::vector<TemplateFile> files;
  std::vector<TemplateReader> readers;  // empty for pinload's own loads
  std::vector<TemplateReads> destinations;

  // The reads recorded for `destination`, or nullptr.
  const TemplateReads* find(std::string_view destination) const;
  // Adds (or replaces) the reads of reads.destination.
  void set(TemplateReads reads);
};

// The files of `checkpoint` with their identity, and no reads.
IoTemplate template_files_of(const Checkpoint& checkpoint);

// The bytes of the layout above: version 1 when `t` has no readers, else 2.
// Every read's reader must be kNoReader or index t.readers.
std::vector<std::uint8_t> serialize_template(const IoTemplate& t);
// Parses those bytes. Never throws: nothing, with the reason in *why, for
// anything but a well-formed template of version 1 or 2.
std::optional<IoTemplate> parse_template(std::span<const std::uint8_t> bytes, std::string* why = nullptr);

// $PINLOAD_CACHE_DIR/templates, else $HOME/.cache/pinload/templates.
std::string default_template_dir();
// Where the template for loading `paths` lives (Note [Template keys]): `dir`
// ("" = default_template_dir()) / a hash of the absolute paths ".pltemplate".
std::string template_path(const std::vector<std::string>& paths, const std::string& dir = "");

// Writes `t` to `file` (creating its folder) through `env`'s
// write_file_atomically (Note [Atomic writes] in env.h), so readers never see
// half a template. Throws IoError naming `file`. `env` null: the POSIX env.
void save_template(const IoTemplate& t, const std::string& file, Env* env = nullptr);
// The template in `file`, or nothing when there is none (debug log), or when
// it is corrupt, truncated, of another version, or any of its files changed
// or vanished (a warning saying why). Never throws. `env` null: the POSIX env.
std::optional<IoTemplate> load_template(const std::string& file, Env* env = nullptr);

}  // namespace pinload
