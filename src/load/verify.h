// Internal: a load checked against a manifest or whole-file digests as its
// chunks land (Note [Verified loads] in pinload/manifest.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/sha256.h"
#include "pinload/checkpoint.h"
#include "pinload/manifest.h"
#include "pinload/pool.h"
#include "pinload/read_plan.h"

namespace pinload::detail {

// Whether `name` ("model.safetensors", "vae/model.safetensors") names the
// file at `path`: `path` is `name` or ends with '/' + name (manifest.cc).
bool file_named(std::string_view path, std::string_view name) noexcept;

// Whether a verified load of `checkpoint` checks some file's whole sha256 (a
// manifest entry without tensor digests, or a file_sha256 that names it):
// that file's tensors can only go out once it is hashed, at its end.
bool verify_checks_whole_files(const VerifyOptions& options, const Checkpoint& checkpoint);

class Verifier {
 public:
  // Checks every file's header against the manifest before any read
  // (IntegrityError), and refuses what this load cannot verify
  // (InvalidArgumentError): a whole-file digest in a `streaming` load (one
  // whose chunks land in staging blocks of their own) or of a remote file.
  // Reads the headers' bytes of files whose whole digest is checked.
  Verifier(Env* env, const VerifyOptions& options, const Checkpoint& checkpoint, const ReadPlan& plan,
           bool streaming);

  // Chunk `c` landed at `block_offset` in `block` (the file's block, or in a
  // streaming load the chunk's own): hashes what it completes. Called by the
  // readers, concurrently. Throws IntegrityError naming the file, the tensor
  // and the byte range that differ.
  void landed(const ReadChunk& c, const std::shared_ptr<Block>& block, std::size_t block_offset);

  // After the last chunk: throws IntegrityError for anything not verified.
  void finish();

 private:
  struct Piece {
    std::uint64_t begin = 0, end = 0;  // in the file
    std::string expected;
    std::string tensor;
    std::atomic<std::uint64_t> landed{0};  // bytes landed (the file's block) or copied (fragments)
    std::vector<std::byte> fragments;      // streaming: a piece cut by a chunk boundary, guarded by File::mu
  };
  struct File {
    std::string path;
    std::uint64_t size = 0;
    std::uint64_t read_begin = 0;
    std::size_t first_piece = 0, end_piece = 0;  // in pieces_, by begin
    // Whole-file digest (Note [Verified loads]): hashed in file order by one
    // reader at a time, from the file's block.
    std::string whole_expected;
    std::mutex mu;
    Sha256 whole;
    std::uint64_t next = 0;                          // hashed up to here
    std::map<std::uint64_t, std::uint64_t> pending;  // landed, not hashed: begin -> end
    bool hashing = false;
    bool whole_done = false;
    std::shared_ptr<Block> block;
  };

  void check_piece(const Piece& p, const File& f, const std::byte* bytes) const;
  void hash_in_order(File& f, const std::byte* file_base, std::uint64_t begin, std::uint64_t end,
                     const std::shared_ptr<Block>& block);
  void finish_whole(File& f);

  bool streaming_;
  std::deque<Piece> pieces_;
  std::vector<std::unique_ptr<File>> files_;
};

}  // namespace pinload::detail
