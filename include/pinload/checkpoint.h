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
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

struct Checkpoint {
  std::vector<CheckpointFile> files;  // load order
  std::vector<std::string> index_files;  // the index.json files that were read
  std::uint64_t data_bytes() const;      // sum of the files' data sections
  std::uint64_t tensor_count() const;
};

struct ResolveOptions {
  std::string variant;  // "" = the plain files; "fp16" = *.fp16.safetensors
  RemoteOptions remote;  // s3:// and http(s):// paths, and their loads
};

// Reads and validates one file's header through `env`. Throws InvalidFileError,
// NotFoundError or IoError naming the file.
CheckpointFile read_checkpoint_file(Env* env, const std::string& path);

// Resolves every path (see above) and reads every header. Tensor names (after
// prefixing) must be unique across the result. Throws on the first problem.
Checkpoint open_checkpoint(Env* env, const std::vector<std::string>& paths,
                           const ResolveOptions& options = {});

}  // namespace pinload
