// Internal: ranged reads of remote objects with libcurl.
//
// Note [Remote reads]
// A remote file is read like a local one: the plan cuts it into block_size
// chunks and the chunk executor's workers read them. A chunk is one ranged
// GET ("Range: bytes=a-b", "If-Match: <ETag>"), whose body libcurl's write
// callback copies straight into the chunk's place in its pool block: no file,
// no second buffer. `connections` workers (RemoteOptions) each hold a curl
// easy handle from the client's pool for the length of one range; a handle
// keeps its connection open (keep-alive) for the next range. The header is a
// first small range (8 bytes, whose Content-Range gives the object's size and
// whose ETag fixes the version read), then the N header bytes.
//
// Note [Remote faults]
// Every response is checked: a 206 whose Content-Range is not the range asked
// (or whose total is not the object's size, or '*' where that size is known, or
// which does not parse: the message says what is wrong with it), a body longer
// or shorter than it, or a 200 to a ranged request (a server that ignores
// Range) is an IoError at once, as are 4xx (404/410: NotFoundError; 412: the
// object changed since its header was read), TLS failures and an ETag or
// Last-Modified other than the one the header was read at. 500/502/503/504/429,
// connection failures, resets and stalls (under 1 KiB/s for low_speed_time_s)
// are retried `retries` times with exponential backoff; a reset mid-body asks
// again for the missing tail only (the bytes that arrived are kept), and a
// range that made progress starts its count of failures again, except for
// stalls: every stall of a range counts, so a server that stalls each range
// after a few bytes fails the range after retries + 1 stalls, not after the cap
// of 4 * (retries + 1) attempts (the bound on a load's time to failure in
// docs/remote.md). Errors name the URL (without credentials or query) and the
// byte range, quote a server's bytes escaped (Note [Printable text]); no
// message or log line holds a credential. An expected ETag with a control byte
// is refused before it is sent in If-Match.
//
// Note [Remote consistency]
// A load reads one version of each object. How depends on the validator the
// server sends (classify_validator in remote_url.h):
// - a strong ETag: every chunk is asked with If-Match, and an answer with
//   another ETag, or with none (which confirms nothing), is an error;
// - a coarse one (nginx's ETag is "<hex mtime in seconds>-<hex size>"; a weak
//   W/ ETag; Last-Modified alone): If-Match (not for W/, which never matches)
//   and the ETag and Last-Modified of every answer compared with the header's.
//   That tells versions apart only when they differ in size or modification
//   second, so the header is not trusted until the server's clock has passed
//   the object's modification second: read_remote_checkpoint_file waits for
//   that (settle_wait_ms: at most about 2 s, only for an object modified in
//   the last two seconds) and reads the header again. From then on, a file
//   written after the header was read has a later modification time, so
//   every chunk of another version fails the comparison. What stays invisible
//   is a file of the same size whose modification time falls in the same
//   second, renamed over the object after its header was read (written in
//   that second and renamed later, or copied with its times preserved);
// - none: nothing can tell versions apart: a warning says so.
// docs/remote.md states these promises per kind of server.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "pinload/remote.h"
#include "remote/remote_url.h"

namespace pinload::remote {

// One version of a remote object. Plain data.
struct ObjectInfo {
  std::string path;  // s3://bucket/key or the URL, as named
  std::uint64_t size = 0;
  std::string etag;  // "" when the server sends none
  std::int64_t mtime_ns = 0;  // Last-Modified; 0 when the server sends none
  std::int64_t date_s = 0;    // the server's clock (Date) when it answered; 0: none
  Validator validator() const { return classify_validator(etag, mtime_ns / 1'000'000'000); }
};

class ObjectCache;  // object_cache.h

struct Listing {
  std::vector<std::string> files;    // names directly under the prefix
  std::vector<std::string> folders;  // sub-prefixes' names, without '/'
};

// Thread safety: every method may be called from many threads at once; each
// call holds one pooled connection while it runs. Failure: throws IoError,
// NotFoundError or InvalidFileError naming the path and byte range.
class RemoteClient {
 public:
  RemoteClient(const RemoteOptions& options, S3Config s3);
  ~RemoteClient();
  RemoteClient(const RemoteClient&) = delete;
  RemoteClient& operator=(const RemoteClient&) = delete;

  // Reads the first min(want, size) bytes of `path` into `dest` (*got says
  // how many) and returns which object version they came from.
  ObjectInfo open(const std::string& path, std::byte* dest, std::uint64_t want, std::uint64_t* got);
  // Exactly [offset, offset + length) of `object`'s version into `dest`.
  void read(const ObjectInfo& object, std::uint64_t offset, std::uint64_t length, std::byte* dest);
  // A whole object of at most `limit` bytes.
  std::string read_small(const std::string& path, std::uint64_t limit, ObjectInfo* info = nullptr);
  // nullopt where the object does not exist.
  std::optional<ObjectInfo> stat(const std::string& path);
  // The objects and sub-prefixes directly under an S3 folder `path` (which
  // ends in '/'). Other schemes: InvalidFileError.
  Listing list(const std::string& path);

  const RemoteOptions& options() const { return options_; }
  // The write-through cache (Note [Remote cache]); null unless cache_dir is set.
  const ObjectCache* cache() const { return cache_.get(); }
  unsigned connections() const { return connections_; }
  // The curl handles that exist and those waiting in the pool. Between
  // requests every handle is pooled; each holds its connection and libcurl's
  // wake-up descriptors (kDescriptorsPerHandle at most).
  struct HandleCounts {
    std::size_t open = 0;
    std::size_t pooled = 0;
  };
  HandleCounts handle_counts();
  static constexpr int kDescriptorsPerHandle = 3;  // the connection, and a socket pair

  struct Handle;  // a pooled curl easy handle

 private:
  class Lease;
  struct Range;
  Handle* acquire();
  void release(Handle* h);
  // One ranged GET with retries (Note [Remote faults]); returns the object's
  // headers. `probe`: the object's size is unknown and may be below the range.
  ObjectInfo get_range(const std::string& path, std::uint64_t offset, std::uint64_t length, std::byte* dest,
                       const ObjectInfo* expect, bool probe, std::uint64_t* got);
  std::string request_url(const std::string& path) const;

  RemoteOptions options_;
  S3Config s3_;
  unsigned connections_;
  std::string ca_file_;
  std::shared_ptr<ObjectCache> cache_;
  std::mutex mu_;
  std::vector<Handle*> idle_;     // guarded by mu_
  std::size_t open_handles_ = 0;  // guarded by mu_
};

// The process's client for `options` under the AWS_* environment as it is
// now; clients are kept (with their open connections) for later loads.
std::shared_ptr<RemoteClient> client_for(const RemoteOptions& options);

}  // namespace pinload::remote
