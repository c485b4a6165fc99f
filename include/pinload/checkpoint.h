// pinload/checkpoint.h: what a path names, resolved into safetensors files.
//
// A path is one of
//   - a .safetensors file;
//   - a sharded index, "*.safetensors.index.json" (its "weight_map" must agree
//     with the shards' headers exactly);
//   - a folder holding either of those (a transformers model, a diffusers
//     component), optionally of a variant: "x.fp16.safetensors" or
//     "x.safetensors.index.fp16.json";
//   - a diffusers pipeline folder (with model_index.json), whose component
//     subfolders are resolved as above. Tensor names are then prefixed with
//     "<component>/" so that components cannot collide.
// Each may be remote (s3://, http(s)://: remote.h); an s3:// folder is listed.
//
// Note [One version per load]
// A header is read, and its file closed, long before the load reads the
// data (Note [Files in flight] in io/read_session.h). The file may be replaced
// meanwhile (a rename over the path, a rewrite in place). CheckpointFile::stat
// keeps the identity of the file whose header was parsed (file_identity.h:
// device, inode, size, mtime), and every later open for the data checks it,
// so a load reads one version of each file, or fails with IoError ("replaced
// or modified since its header was read"); it never pairs an old header with
// new bytes. (A writer that changes bytes in place without changing size or
// mtime cannot be detected by any reader that does not hold a lease.)
// pinload.torch.safe_open keeps its file open from the header to the data.
//
// Note [Special files]
// Only regular files are loaded. A FIFO, socket, character or block device
// named as a checkpoint (or by an index) is refused with InvalidFileError
// naming its type, before open() where the path is resolved and after it
// (from the open file's stat) everywhere; files are opened with O_NONBLOCK, so
// that a FIFO never blocks the open. Folders that cannot be listed (no read
// permission, a symlink loop) raise IoError naming the path.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "pinload/byte_source.h"
#include "pinload/env.h"
#include "pinload/remote.h"
#include "pinload/safetensors.h"

namespace pinload {

struct CheckpointFile {
  std::string path;
  std::string name_prefix;  // "" or "<component>/"
  FileStat stat;
  Header header;
  std::string version;  // remote objects: the ETag the header was read at
};

// What a byte source needs of the file: its path, the identity and version
// its header was read at, and where its data starts (Note [Byte sources]).
SourceFile source_file(const CheckpointFile& file);

struct Checkpoint {
  std::vector<CheckpointFile> files;  // load order
  std::vector<std::string> index_files;  // the index.json files that were read
  std::uint64_t data_bytes() const;      // sum of the files' data sections
  std::uint64_t tensor_count() const;
  // The files' "__metadata__", merged in load order (the first file wins a key).
  std::vector<std::pair<std::string, std::string>> metadata() const;
};

struct ResolveOptions {
  std::string variant;  // "" = the plain files; "fp16" = *.fp16.safetensors
  RemoteOptions remote;  // s3:// and http(s):// paths, and their loads
};

// Reads and validates one file's header through `env`; an s3:// or http(s)://
// object's with `remote` (its client, retries, cache). Throws
// InvalidFileError, NotFoundError or IoError naming the file.
CheckpointFile read_checkpoint_file(Env* env, const std::string& path, const RemoteOptions& remote = {});

// Resolves every path (see above) and reads every header. Tensor names (after
// prefixing) must be unique across the result. Throws on the first problem.
Checkpoint open_checkpoint(Env* env, const std::vector<std::string>& paths,
                           const ResolveOptions& options = {});

}  // namespace pinload
