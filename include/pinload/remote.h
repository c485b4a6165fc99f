// pinload/remote.h: checkpoints on object storage and HTTP servers.
//
// Wherever pinload takes a path it also takes
//   s3://bucket/key            an object (a file or an index);
//   s3://bucket/prefix/        a folder: its objects are listed (ListObjectsV2);
//   http://host/path, https:// a file or an index.
// Chunks are ranged GETs of block_size over `connections` parallel
// connections, each written by libcurl straight into its pool block
// (Note [Remote reads] in src/remote/remote_client.h).
//
// S3 requests are signed with libcurl's CURLOPT_AWS_SIGV4. Credentials and
// endpoints come from where every AWS tool takes them: AWS_ACCESS_KEY_ID,
// AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN; AWS_REGION or AWS_DEFAULT_REGION;
// AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (S3-compatible stores, addressed
// path-style); AWS_PROFILE with ~/.aws/credentials and ~/.aws/config
// (AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE); none of them: anonymous.
// AWS_CA_BUNDLE names extra CA certificates.
//
// Note [Network filesystems]
// A NAS front end caps the bandwidth of each TCP connection, so a file on NFS,
// SMB/CIFS or a FUSE mount (fstatfs f_type) is read buffered under
// DirectIo::kAuto (O_DIRECT on NFS sends every read to the server
// unbatched) by at least `connections` reader threads. The mount must spread
// them over connections too: docs/remote.md has the recipe (nconnect=16,
// rsize=1M, threads >= connections).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace pinload {

inline constexpr unsigned kDefaultConnections = 16;

struct RemoteOptions {
  // Parallel connections (and reader threads) for remote files; 0: the
  // PINLOAD_CONNECTIONS environment variable, else kDefaultConnections.
  unsigned connections = 0;
  // TLS peer and host verification. false is an explicit opt-out, logged as
  // a warning on every client that uses it.
  bool verify_tls = true;
  std::string ca_file;  // "" = AWS_CA_BUNDLE, else the system's CAs
  // Attempts after the first for a range that fails with 5xx/429, a reset or
  // a stall (Note [Remote faults]); each waits retry_base_ms * 2^k, at most 2 s.
  unsigned retries = 5;
  unsigned retry_base_ms = 100;
  unsigned connect_timeout_s = 10;
  // A transfer slower than 1 KiB/s for this long is a stall: retried.
  unsigned low_speed_time_s = 10;
  // Optional write-through cache of remote objects ("" = off): Note [Remote
  // cache] in src/remote/object_cache.h.
  std::string cache_dir;
  std::uint64_t cache_bytes = 0;  // LRU budget; 0 = no limit

  bool operator==(const RemoteOptions&) const = default;
};

// Whether `path` names a remote object: "s3://", "http://" or "https://".
bool is_remote_path(std::string_view path) noexcept;

// Throws InvalidArgumentError naming `path` (without user information or
// query) where it starts with a URL scheme that pinload does not read
// ("gs://", "az://", ...: docs/remote.md), so that such a URL is not taken
// for a local path. Any other path: nothing.
void refuse_unread_scheme(std::string_view path);

// connections, else PINLOAD_CONNECTIONS, else kDefaultConnections; at least 1.
unsigned effective_connections(const RemoteOptions& options);

}  // namespace pinload
