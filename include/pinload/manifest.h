// pinload/manifest.h: digests of a checkpoint's bytes, and loads checked
// against them (docs/manifest.md).
//
// A Manifest records, per file of a checkpoint: its size and SHA-256, the
// parts of its header that decide what its bytes mean (each tensor's dtype,
// shape and byte range, and the metadata), and each tensor's SHA-256 over its
// bytes, with the SHA-256 of each piece_bytes piece of a tensor larger than
// one piece. make_manifest writes one (`pinload manifest`,
// pinload.write_manifest); LoadOptions::verify checks a load against it, or
// against whole-file digests alone (the sha256 a model hub publishes).
//
// Note [Verified loads]
// Verification happens in flight, beside the reads, not in a second pass:
//   - Each tensor is cut into pieces of piece_bytes (1 MiB) from its first
//     byte, so that every piece belongs to one tensor (a mismatch names it,
//     with the piece's byte range) and no piece waits for a whole tensor.
//     A reader that lands a chunk hashes every piece that lies inside the
//     chunk right away, from the memory it has just written. A piece cut by a
//     chunk boundary (one per boundary at most) is hashed by whichever reader
//     completes it: from the file's block where the load keeps one, else
//     (streaming loads, whose staging blocks are burnt after their copy) from
//     a copy of its fragments of at most one piece. So readers hash in
//     parallel, in any order, and the last piece is hashed as its chunk lands.
//   - The header is checked before any read: every tensor of the manifest, no
//     other, each with the manifest's dtype, shape and range; the same
//     metadata and file size. A file of the load without a manifest entry is
//     an IntegrityError: nothing is left unchecked silently.
//   - A whole-file SHA-256 (a published digest, or a manifest entry without
//     tensors) is inherently sequential: each file is hashed in file order by
//     one reader at a time, as the arrived prefix of its sweep grows (the
//     header's bytes, read again first, then the data). The readers keep
//     reading meanwhile. It needs the file's block to stay until it is
//     hashed, so a load that streams through staging blocks (device loads
//     in kStreaming mode, staged conversions) refuses it with
//     InvalidArgumentError rather than skip it, as do remote files.
//   - Stored bytes are checked: a device load's before their copy, a
//     converting load's before their conversion. Verification turns zero-copy
//     handing-out off (a mapped file would never pass through a reader).
//   - A tensor is handed out (LoadHandle::next_ready, iter_tensors) only after
//     every piece of it has been verified, or with a whole-file digest at the
//     end of the load (HandOut::kStream, which keeps nothing, refuses those); a
//     load that fails returns nothing, and its blocks go back to the pool.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pinload/dtype.h"
#include "pinload/env.h"

namespace pinload {

inline constexpr int kManifestVersion = 1;
inline constexpr std::uint64_t kDefaultPieceBytes = 1u << 20;  // Note [Verified loads]

struct ManifestTensor {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0;  // absolute byte offsets in the file
  std::uint64_t end = 0;
  std::string sha256;               // lowercase hex, of bytes [begin, end)
  std::vector<std::string> pieces;  // of each piece, when there is more than one
};

struct ManifestFile {
  std::string name;  // relative to the checkpoint's root: "model-00001-of-00002.safetensors"
  std::uint64_t size = 0;
  std::string sha256;  // of the whole file; "" where unknown
  // Without tensors (has_tensors false) only the size and the whole-file
  // digest are checked.
  bool has_tensors = false;
  std::uint64_t data_offset = 0;  // where the data section starts
  std::vector<std::pair<std::string, std::string>> metadata;  // sorted by key
  std::vector<ManifestTensor> tensors;                        // sorted by begin
};

struct Manifest {
  std::uint64_t piece_bytes = kDefaultPieceBytes;
  std::vector<ManifestFile> files;

  // The entry for a file at `path` (local or remote): the entry whose name is
  // the longest '/'-bounded suffix of `path`; null where none is.
  const ManifestFile* find(std::string_view path) const noexcept;
};

struct ManifestOptions {
  std::string variant;  // as ResolveOptions::variant
  std::uint64_t piece_bytes = kDefaultPieceBytes;  // 4 KiB .. 1 GiB
  unsigned threads = 2;                            // hashing threads
};

// Reads every file of `paths` (files, indexes, folders; local only) and
// returns its manifest. Files are named relative to the deepest folder that
// holds them all. Throws pinload::Error (InvalidArgumentError for a remote
// path or options out of range).
Manifest make_manifest(const std::vector<std::string>& paths, const ManifestOptions& options = {},
                       Env* env = nullptr);

// The manifest as JSON (docs/manifest.md), and back. parse_manifest throws
// InvalidFileError naming `source` for anything that is not a manifest of
// version kManifestVersion with every field in range.
std::string manifest_to_json(const Manifest& manifest);
Manifest parse_manifest(std::string_view json, const std::string& source = "manifest");
// Writes and reads through `env` (null: the POSIX env); writes atomically
// (write_file_atomically: Note [Atomic writes] in env.h).
void save_manifest(const Manifest& manifest, const std::string& path, Env* env = nullptr);
Manifest load_manifest(const std::string& path, Env* env = nullptr);

// What a load checks: LoadOptions::verify (Note [Verified loads]).
struct VerifyOptions {
  std::shared_ptr<const Manifest> manifest;
  // Whole-file SHA-256 digests (lowercase or uppercase hex), each for the
  // file of the load whose path ends with '/' + name (or is name). A name
  // that matches no file of a load is an InvalidArgumentError.
  std::vector<std::pair<std::string, std::string>> file_sha256;

  bool active() const noexcept { return manifest != nullptr || !file_sha256.empty(); }
  // Throws InvalidArgumentError for a digest that is not 64 hex digits.
  void validate() const;
};

// Lowercase hex SHA-256 of `bytes` (OpenSSL).
std::string sha256_hex(const void* bytes, std::size_t size);

}  // namespace pinload
