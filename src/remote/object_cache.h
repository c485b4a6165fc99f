// Internal: the optional local write-through cache of remote objects.
//
// Note [Remote cache]
// With RemoteOptions::cache_dir set, each remote file a load reads is also
// written, range by range as its chunks arrive, to "<dir>/<key>.part-<pid>-<n>"
// (pwrite at the chunk's offset), so nothing is fetched twice. When every
// byte has arrived, the header bytes before the first chunk are fetched, the
// file is fsynced, its SHA-256 digests (one per kPieceBytes piece, hashed in
// parallel) are written to "<dir>/<key>.safetensors.sha256", and the file is
// renamed to "<dir>/<key>.safetensors": a crashed or failed load leaves only a
// .part file, never a torn cache entry. The key hashes the path, the ETag and
// the size, so an object that changes on the server misses. A later load still
// reads the header from the server (that is what says which version is
// current), then hashes the cached file and compares it with its recorded
// digests: an entry changed on local disk (or without digests) is dropped
// with a warning and the object is read from the server again. A verified
// entry is read like any local file (O_DIRECT under DirectIo::kAuto).
//
// A writer holds an exclusive flock on its .part file for as long as it
// writes, so a .part file whose lock can be taken belongs to a process that
// died (kill -9, a signal's default action): every new writer and every
// eviction removes those (a lock, not the pid in the name, so a reused pid
// cannot keep one alive). Entries are evicted oldest-used first (mtime,
// touched on each hit) once entries and live .part files together hold more
// than cache_bytes. A cache that cannot be written is logged and skipped; it
// never fails a load.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "pinload/env.h"
#include "remote/remote_client.h"

namespace pinload::remote {

// Thread safety: every method may be called from many threads.
class ObjectCache {
 public:
  ObjectCache(std::string dir, std::uint64_t budget_bytes);

  // The cached file holding `object`'s version, verified against its
  // recorded digests (read through `env`), or "" (touched for the LRU).
  std::string lookup(const ObjectInfo& object, Env* env) const;

  // Collects the bytes [first, object.size) of `object` as they arrive.
  class Writer {
   public:
    ~Writer();  // removes the .part file unless committed
    Writer(const Writer&) = delete;
    Writer& operator=(const Writer&) = delete;
    // Reads [offset, +bytes) of the object into `into` (the remote source's
    // own read, for the bytes before `first`); throws as RemoteClient::read.
    using ReadHead = std::function<void(std::uint64_t offset, std::uint64_t bytes, std::byte* into)>;
    // Writes [offset, +bytes); once every byte from `first` has arrived, the
    // header is fetched through `read_head` and the entry committed. Never throws.
    void write(std::uint64_t offset, const std::byte* data, std::uint64_t bytes, const ReadHead& read_head);

   private:
    friend class ObjectCache;
    Writer(const ObjectCache* cache, Env* env, ObjectInfo object, std::uint64_t first, std::string part,
           std::string final_path, int fd);
    void commit(const ReadHead& read_head);
    const ObjectCache* cache_;
    Env* env_;
    ObjectInfo object_;
    std::uint64_t first_;
    std::string part_, final_;
    int fd_;  // read-write, flock'ed
    std::atomic<std::uint64_t> arrived_{0};
    std::atomic<bool> failed_{false};
    bool committed_ = false;
  };
  // A writer for `object` that writes through `env` (its write half), or
  // null where the cache cannot be written.
  std::unique_ptr<Writer> begin(const ObjectInfo& object, std::uint64_t first, Env* env) const;

  // Digests are of kPieceBytes pieces, so that many threads hash one file.
  static constexpr std::uint64_t kPieceBytes = 64ull << 20;

 private:
  std::string key_path(const ObjectInfo& object) const;
  // Removes the .part files of dead writers; returns the bytes of live ones.
  std::uint64_t sweep() const;
  void evict(const std::string& keep) const;
  void drop(const std::string& entry) const;
  std::string dir_;
  std::uint64_t budget_;
};

}  // namespace pinload::remote
