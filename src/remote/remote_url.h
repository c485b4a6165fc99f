// Internal: remote paths, and the small text formats of S3 and HTTP, as plain
// functions (no I/O), so that each is tested on its own.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pinload::remote {

// What a remote path names. Copyable plain data.
struct Location {
  enum class Scheme { kS3, kHttp };
  Scheme scheme = Scheme::kHttp;
  std::string bucket;  // s3
  std::string key;     // s3: without the leading '/'; may end in '/'
  std::string url;     // http(s): canonical_url, what libcurl fetches
};

// nullopt where `path` is not remote; throws InvalidFileError for a remote
// path without a bucket or host, InvalidArgumentError for one that
// canonical_url refuses.
std::optional<Location> parse_location(std::string_view path);

// Note [Canonical URLs]
// A remote object is named by one string, parsed once, by the parser that
// fetches it: libcurl's URL API. Hand-cut parsing disagreed with it: the
// store keyed 'http://127.0.0.1:EVIL#@127.0.0.1:REAL/m' after its last '@'
// (REAL), while libcurl ends the host at '#' and fetched EVIL, so one user's
// object was stored under another's URL. canonical_url:
//   - parses with curl_url_set(CURLUPART_URL, CURLU_URLENCODE): spaces and
//     bytes outside ASCII in the path and query become %XX, as libcurl would
//     send them; control bytes and malformed URLs are refused;
//   - refuses user information (user:password@: credentials belong in a
//     presigned query or S3's environment), fragments (never sent, and the
//     place the host confusion above hides), schemes other than http(s) and
//     hosts libcurl cannot convert to IDNA (punycode);
//   - lowercases the scheme and the host name (IDNA names as punycode),
//     drops a default port (http://h:80/ is http://h/), resolves dot
//     segments and writes an empty path as '/', all by libcurl;
//   - checks that its result parses to itself, so that what a key names is
//     what is fetched.
// s3://bucket/key is kept as written, with a bucket of S3's characters
// ([A-Za-z0-9.-_]): the request URL is built from the bucket and the key
// (s3_object_url), and a bucket holding ':', '@' or '/' would be a host.
// Throws InvalidArgumentError naming the URL (display_url).
std::string canonical_url(std::string_view url);

// The scheme of a path that starts with one (RFC 3986: a letter, then letters,
// digits, '+', '-' and '.', before "://"), as written; empty where none.
std::string_view url_scheme(std::string_view path);

// What messages, logs and store keys show of `url`: the scheme, host, port
// and path that libcurl parses (Note [Canonical URLs]), without user
// information, query (presigned URLs carry signatures there) or fragment; so
// a URL that libcurl fetches from host A never displays as host B. An s3://
// path, and a path with no scheme, is shown as written. A URL that libcurl
// cannot parse, or of another scheme (both never fetched), is cut at its
// first '?' or '#', without user information.
std::string display_url(std::string_view url);

// RFC 3986 percent-encoding of all but unreserved characters (and '/' when
// keep_slash), as SigV4's canonical form wants.
std::string uri_encode(std::string_view s, bool keep_slash);

// "bytes FIRST-LAST/TOTAL" or "bytes */TOTAL" (a 416's); TOTAL may be "*".
struct ContentRange {
  bool satisfied = true;
  std::uint64_t first = 0, last = 0;  // inclusive, when satisfied
  std::optional<std::uint64_t> total;
};
std::optional<ContentRange> parse_content_range(std::string_view value);
// What is wrong with a Content-Range that parse_content_range refuses, for
// messages ("" where it parses).
std::string content_range_problem(std::string_view value);

// One page of a ListObjectsV2 answer.
struct ListPage {
  struct Object {
    std::string key;
    std::uint64_t size = 0;
  };
  std::vector<Object> objects;
  std::vector<std::string> prefixes;  // CommonPrefixes
  bool truncated = false;
  std::string next_token;
};
// Throws InvalidFileError where `xml` is not a ListBucketResult.
ListPage parse_list_page(std::string_view xml);

// The <Code> of an S3 error document, or "".
std::string s3_error_code(std::string_view xml);

// An INI file as ~/.aws/credentials and ~/.aws/config write it:
// section -> key -> value, keys lowercased, "#" and ";" comments.
using Ini = std::map<std::string, std::map<std::string, std::string>>;
Ini parse_ini(std::string_view text);

// Where S3 requests go and how they are signed.
struct S3Config {
  std::string endpoint;  // "http(s)://host[:port]", no trailing '/'
  bool path_style = true;  // endpoint/bucket/key; false: bucket.endpoint/key (AWS)
  std::string region = "us-east-1";
  std::string access_key, secret_key, session_token;  // access_key "": anonymous
  bool anonymous() const { return access_key.empty(); }
  bool operator==(const S3Config&) const = default;
};

// Resolves the S3 configuration the way AWS tools do (remote.h) from
// `getenv` and the files it names (read_file returns nullopt for a missing
// file).
S3Config resolve_s3_config(const std::function<const char*(const char*)>& getenv,
                           const std::function<std::optional<std::string>(const std::string&)>& read_file);

// The request URL of an object (or of a bucket, key ""), and of a bucket
// listing of `prefix` after `token`.
std::string s3_object_url(const S3Config& config, const std::string& bucket, const std::string& key);
std::string s3_list_url(const S3Config& config, const std::string& bucket, const std::string& prefix,
                        const std::string& token);

// "Tue, 01 Dec 2026 15:51:16 GMT" as nanoseconds since the epoch; 0 if unparsable.
std::int64_t parse_http_date(std::string_view value);

// How well an object's validators tell its versions apart (Note [Remote
// consistency] in remote_client.h):
//   kStrong: an ETag that is neither weak (W/) nor made of the modification
//            time in seconds (S3's MD5s, most object stores);
//   kCoarse: a weak ETag, an ETag with a component equal to Last-Modified in
//            seconds (nginx's "<hex mtime>-<hex size>", lighttpd's and others'),
//            or Last-Modified alone: two versions of the same size written in
//            the same second look the same;
//   kNone:   neither ETag nor Last-Modified.
// `etag` as sent (quotes and W/ included, "" for none); `last_modified_s`:
// seconds since the epoch, 0 for none.
enum class Validator { kStrong, kCoarse, kNone };
Validator classify_validator(std::string_view etag, std::int64_t last_modified_s);
const char* validator_name(Validator v);

// How long to wait before a coarse validator pins the version read
// (Note [Remote consistency]): `last_modified_s` the object's modification
// second, `date_s` the server's clock when it answered (its Date header; the
// client's clock where it sends none). 0: pinned already (the second is over
// by a safe margin); nullopt: the modification time is more than
// kMaxSettleSeconds ahead of the server's clock (cannot wait for it).
inline constexpr std::int64_t kMaxSettleSeconds = 1;
std::optional<std::int64_t> settle_wait_ms(std::int64_t last_modified_s, std::int64_t date_s);

}  // namespace pinload::remote
