// pinload/byte_source.h: the bytes of one file, wherever they are.
//
// Note [Byte sources]
// Every reader of a checkpoint's bytes reads through a ByteSource: a load's
// chunk executor, the sharded loader, conversion on load, `pinload convert`,
// manifests, verified loads, the warmer, the node store's fill, and header
// reads. A source reads a range of one file into memory, whole, or throws a
// typed error naming the file and the range. open_byte_source is the one
// place that decides which source a path gets:
//   - a local file: pread(2) through the Env, with O_DIRECT where the options
//     ask for it and the file is not cached (Note [Direct I/O] in loader.h),
//     buffered from the first refusal on; a file in the page cache is also
//     mapped, and copy_mapped copies from the mapping (Note [Mapped reads]);
//   - an s3:// or http(s):// object: ranged GETs on the remote client's
//     pooled connections (Note [Remote reads] in src/remote/remote_client.h),
//     written through to the object cache where there is one; a cached copy
//     is a local file.
// Retries (EINTR, EAGAIN and short reads: os/read_full.h), the refusal of
// O_DIRECT and the fallbacks from a mapping live inside the sources; their
// callers see bytes or an error. What does not read through a source: a
// zero-copy load, which hands out the file's own mapping (Note [Zero-copy
// loads] in loader.h), and reads of text that is not a checkpoint's (a
// manifest, a template, sysfs and /proc, the store's key over a client's
// descriptor, the object cache checking its own entries), which call
// read_full directly.
//
// A source holds descriptors and a mapping only while open: reads open it,
// close() lets them go (Note [Files in flight] in io/read_session.h), and a
// later read opens it again, checking that the file is still the version it
// was opened for (Note [One version per load] in checkpoint.h).
//
// Wrapping: LoadOptions::wrap_source (and ShardLoadOptions') wraps every
// source a load opens. Tests subclass ByteSourceWrapper to inject faults
// into local, mapped and remote reads alike.
//
// Thread safety: read() and copy_mapped() may be called from many threads at
// once; open() and close() not while a read runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "pinload/env.h"
#include "pinload/file_identity.h"
#include "pinload/remote.h"

namespace pinload {

enum class DirectIo { kAuto, kOn, kOff };

// How a file already in the page cache is copied into its block: Note
// [Mapped reads] in loader.h. kAuto measures both and takes the faster, chunk
// by chunk.
enum class CachedRead { kAuto, kMap, kPread };

inline constexpr double kDefaultResidentThreshold = 0.5;

class ByteSource {
 public:
  virtual ~ByteSource() = default;

  // The file read: a local path, a remote URL, or a remote object's cached copy.
  virtual const std::string& path() const = 0;
  // Opens the descriptors and the mapping reads need, if not open. Throws
  // NotFoundError, IoError (a replaced file included) or InvalidFileError.
  virtual void open() = 0;
  // Lets them go; a later read opens them again.
  virtual void close() = 0;
  // Reads exactly [offset, offset + bytes) into `dest`. `capacity` (at least
  // `bytes`) is how much of `dest` may be written: a direct read asks for
  // whole aligned lengths. Throws IoError naming path() and the range that
  // failed, a file that ended early included.
  virtual void read(std::uint64_t offset, std::uint64_t bytes, std::byte* dest, std::uint64_t capacity) = 0;
  // Copies [offset, offset + bytes) from the file's mapping. False where the
  // source has none or the mapping cannot serve the range (a failed
  // populate, a SIGBUS): the caller then read()s it.
  virtual bool copy_mapped(std::uint64_t offset, std::uint64_t bytes, std::byte* dest) {
    (void)offset, (void)bytes, (void)dest;
    return false;
  }
  // Whether reads go around the page cache (O_DIRECT, not refused yet).
  virtual bool direct() const { return false; }
  // Whether the open source has a mapping for copy_mapped.
  virtual bool mapped() const { return false; }
  // Reads worth running at once: a remote object's connections; 0 for a
  // local file (the load's threads decide).
  virtual unsigned connections() const { return 0; }
  // A local file on NFS, SMB/CIFS, Ceph, Lustre or FUSE (Note [Network
  // filesystems] in remote.h): read buffered, with many readers.
  virtual bool network_filesystem() const { return false; }
};

// Forwards every call to the source it owns. Subclass it and override a
// call to inject a fault.
class ByteSourceWrapper : public ByteSource {
 public:
  explicit ByteSourceWrapper(std::unique_ptr<ByteSource> target) : target_(std::move(target)) {}
  ByteSource* target() const { return target_.get(); }

  const std::string& path() const override { return target_->path(); }
  void open() override { target_->open(); }
  void close() override { target_->close(); }
  void read(std::uint64_t offset, std::uint64_t bytes, std::byte* dest, std::uint64_t capacity) override {
    target_->read(offset, bytes, dest, capacity);
  }
  bool copy_mapped(std::uint64_t offset, std::uint64_t bytes, std::byte* dest) override {
    return target_->copy_mapped(offset, bytes, dest);
  }
  bool direct() const override { return target_->direct(); }
  bool mapped() const override { return target_->mapped(); }
  unsigned connections() const override { return target_->connections(); }
  bool network_filesystem() const override { return target_->network_filesystem(); }

 private:
  std::unique_ptr<ByteSource> target_;
};

// Returns the source a load reads through: `source` itself, or a wrapper
// that owns it.
using WrapSource = std::function<std::unique_ptr<ByteSource>(std::unique_ptr<ByteSource> source)>;

// How open_byte_source's local files are read (the fields of ReadOptions of
// the same names) and its remote objects fetched.
struct SourceOptions {
  DirectIo direct = DirectIo::kOff;
  CachedRead cached_read = CachedRead::kPread;  // kPread: never mapped
  double resident_threshold = kDefaultResidentThreshold;
  RemoteOptions remote;
};

// What the header read learned of a file: where it is and which version.
struct SourceFile {
  std::string path;
  FileStat stat;        // a local file's; a remote object's size and mtime
  std::string version;  // a remote object's ETag or version id (CheckpointFile::version)
  std::uint64_t data_offset = 0;  // where the tensor data starts: the object cache keeps bytes from there
};

// The source of `file` (Note [Byte sources]). Every open of a local file
// checks the identity of file.stat, and a remote object is read at its
// version. A remote object's cache is asked for a copy, and a local file is
// opened once to learn its filesystem; nothing stays open. Throws as
// ByteSource::open.
std::unique_ptr<ByteSource> open_byte_source(Env* env, const SourceFile& file, const SourceOptions& options);

}  // namespace pinload
