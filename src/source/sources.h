// Internal: the byte sources behind open_byte_source (Note [Byte sources] in
// byte_source.h): a local file and a remote object.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "pinload/byte_source.h"
#include "pinload/env.h"
#include "pinload/file_identity.h"
#include "remote/object_cache.h"
#include "remote/remote_client.h"

namespace pinload::detail {

// Pool blocks are aligned to this; O_DIRECT needing more is not used.
inline constexpr std::uint32_t kFallbackDirectAlign = 4096;
// Probes of a file's page-cache residency (Env::resident_fraction).
inline constexpr int kResidencySamples = 64;

// Whether `fd` is on NFS, SMB/CIFS, Ceph, Lustre or a FUSE mount (Note
// [Network filesystems] in remote.h): read buffered, one reader per connection.
bool on_network_filesystem(Env* env, int fd, const std::string& path);

// A local file read with pread(2) through an Env: direct or buffered, and
// mapped where it is in the page cache (SourceOptions).
class LocalFileSource final : public ByteSource {
 public:
  // `expected`: the identity every open must find (null: the first open's,
  // which later opens must match). `borrowed_fd` (>= 0): an open descriptor
  // of the file, not owned, read for buffered reads instead of opening
  // `path` (the node store reads a client's file through the client's
  // descriptor, and reopens `path`, its /proc/self/fd link, only for
  // O_DIRECT).
  LocalFileSource(Env* env, std::string path, const FileIdentity* expected, const SourceOptions& options,
                  int borrowed_fd = -1);
  ~LocalFileSource() override;

  const std::string& path() const override { return path_; }
  void open() override;
  void close() override;
  void read(std::uint64_t offset, std::uint64_t bytes, std::byte* dest, std::uint64_t capacity) override;
  bool copy_mapped(std::uint64_t offset, std::uint64_t bytes, std::byte* dest) override;
  bool direct() const override { return direct_.load(std::memory_order_relaxed); }
  bool mapped() const override { return mapping_.load(std::memory_order_acquire) != nullptr; }
  bool network_filesystem() const override { return network_fs_; }

  // The stat of the open file (open() first).
  const FileStat& stat() const { return stat_; }
  // The buffered descriptor of the open file, for posix_fadvise (the warmer's
  // readahead and burn-after-reading); valid until close().
  int buffered_descriptor() const { return borrowed_fd_ >= 0 ? borrowed_fd_ : buffered_.get(); }
  // Learns whether the file is on a network filesystem (opens it once).
  void probe_filesystem();

 private:
  void open_locked();
  int buffered_fd();
  void map();
  void unmap();

  Env* env_;
  std::string path_;
  bool has_expected_;
  FileIdentity expected_;
  SourceOptions options_;
  int borrowed_fd_;
  bool network_fs_ = false;
  bool probed_ = false;  // network_fs_ is known
  std::mutex mu_;  // guards opening
  std::atomic<bool> open_{false};
  FileStat stat_;
  ScopedFd buffered_;
  ScopedFd direct_fd_;
  std::atomic<bool> direct_{false};
  std::atomic<const std::byte*> mapping_{nullptr};
  std::size_t mapping_bytes_ = 0;
};

// The two factories beside open_byte_source (byte_source.h), in the same one
// place (byte_source.cc), for reads before a file's identity is known:
//
// A local file, opened: its identity is this first open's, which later opens
// must match (a header read, an index, the warmer's files). Throws as
// ByteSource::open.
std::unique_ptr<LocalFileSource> open_local_file(Env* env, const std::string& path,
                                                 const SourceOptions& options = {});
// A remote object at the version `object` names (the header read's second
// range, the node store's fill): no object cache, which a load's source
// (open_byte_source) consults.
std::unique_ptr<ByteSource> open_remote_object(std::shared_ptr<remote::RemoteClient> client,
                                               remote::ObjectInfo object);

// An s3:// or http(s):// object read with ranged GETs at one version, each
// range written through to the object cache's writer where there is one.
class RemoteObjectSource final : public ByteSource {
 public:
  RemoteObjectSource(std::shared_ptr<remote::RemoteClient> client, remote::ObjectInfo object,
                     std::unique_ptr<remote::ObjectCache::Writer> cache_writer);
  ~RemoteObjectSource() override;

  const std::string& path() const override { return object_.path; }
  void open() override {}
  void close() override {}
  void read(std::uint64_t offset, std::uint64_t bytes, std::byte* dest, std::uint64_t capacity) override;
  unsigned connections() const override;

 private:
  std::shared_ptr<remote::RemoteClient> client_;
  remote::ObjectInfo object_;
  std::unique_ptr<remote::ObjectCache::Writer> cache_writer_;
};

}  // namespace pinload::detail
