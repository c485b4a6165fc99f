// Internal: what checkpoint resolution asks of where files live, local
// folders or remote object stores, so that one Resolver serves both.
//
// Thread safety: one Storage is used by one resolution at a time.
// Failure: throws NotFoundError, IoError or InvalidFileError naming the path.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pinload/checkpoint.h"
#include "pinload/env.h"

namespace pinload::detail {

enum class PathKind { kMissing, kFile, kFolder };

class Storage {
 public:
  virtual ~Storage() = default;
  virtual PathKind kind(const std::string& path) = 0;
  // Names of the files and of the folders directly in `folder`, sorted.
  virtual void list(const std::string& folder, std::vector<std::string>* files, std::vector<std::string>* folders) = 0;
  // A whole file of at most `limit` bytes.
  virtual std::string read_small(const std::string& path, std::uint64_t limit) = 0;
  virtual CheckpointFile read_header(const std::string& path) = 0;
  // `name` inside `folder`; the folder holding `path`.
  virtual std::string join(const std::string& folder, const std::string& name) const = 0;
  virtual std::string parent(const std::string& path) const = 0;
};

// The local filesystem through `env`: stat, listing and header reads.
std::unique_ptr<Storage> local_storage(Env* env);
// s3:// and http(s):// paths (remote.h).
std::unique_ptr<Storage> remote_storage(const RemoteOptions& options);

// read_checkpoint_file for remote paths: the header as two ranges, 8 bytes then N.
CheckpointFile read_remote_checkpoint_file(const RemoteOptions& options, const std::string& path);

}  // namespace pinload::detail
