#include "remote/remote_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "base/log.h"
#include "base/printable.h"
#include "pinload/error.h"
#include "remote/object_cache.h"

namespace pinload::remote {

namespace {

// SHA-256 of the empty body: the x-amz-content-sha256 of a GET (AWS requires
// the header; libcurl 7.88 signs the empty payload but does not send it).
constexpr const char* kEmptyPayloadSha256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr std::size_t kErrorBodyLimit = 16 << 10;
constexpr std::size_t kTextLimit = 64u << 20;  // listings
constexpr unsigned kMaxBackoffMs = 2000;
constexpr std::uint64_t kProbeBytes = 64 << 10;

void init_curl_once() {
  static const CURLcode rc = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (rc != CURLE_OK) throw IoError(std::string("cannot initialise libcurl: ") + curl_easy_strerror(rc));
}

// A server's text for a message: at most 120 bytes, escaped (Note [Printable text]).
std::string printable(std::string_view v) { return printable_text(v, 120); }

bool iequals_prefix(std::string_view line, std::string_view name) {
  if (line.size() < name.size()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(line[i])) != std::tolower(static_cast<unsigned char>(name[i]))) return false;
  }
  return true;
}

std::string_view header_value(std::string_view line, std::string_view name) {
  std::string_view v = line.substr(name.size());
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == '\r' || v.back() == '\n' || v.back() == ' ')) v.remove_suffix(1);
  return v;
}

// One transfer's state, shared with libcurl's callbacks.
struct Transfer {
  // Body destination: `dest` (capacity bytes) for ranges, else `text`.
  std::byte* dest = nullptr;
  std::uint64_t capacity = 0;
  std::string* text = nullptr;
  // What the answer must be for its body to be taken.
  bool ranged = false;
  std::uint64_t first = 0, last = 0;        // the range asked, inclusive
  std::optional<std::uint64_t> total;       // the object's size, when known
  bool probe = false;                       // last may exceed the object
  // Filled by the callbacks.
  long status = 0;
  bool decided = false, accepted = false;
  std::string refused;  // why the body was refused (aborts the transfer)
  std::uint64_t got = 0;
  std::string error_body;
  std::string etag;
  std::optional<ContentRange> content_range;
  std::string content_range_text;  // as sent, when there is one
  std::optional<std::uint64_t> content_length;
  std::int64_t mtime_ns = 0;
  std::int64_t date_s = 0;

  void decide() {
    decided = true;
    if (status == 206 && ranged) {
      if (content_range_text.empty()) {
        refused = "206 without a Content-Range";
      } else if (!content_range) {
        refused = "invalid Content-Range \"" + printable(content_range_text) + "\" (" +
                  content_range_problem(content_range_text) + ")";
      } else if (!content_range->satisfied) {
        refused = "Content-Range \"" + printable(content_range_text) + "\" names no range in a 206 answer";
      } else if (content_range->first != first || (!probe && content_range->last != last) ||
                 (probe && content_range->last > last)) {
        refused = "Content-Range is bytes " + std::to_string(content_range->first) + "-" +
                  std::to_string(content_range->last) + ", not the range asked";
      } else if (total && !content_range->total) {
        // The size read with the header (or that a store's client names) is checked on every range.
        refused = "Content-Range \"" + printable(content_range_text) + "\" does not give the object's size (" +
                  std::to_string(*total) + " bytes expected)";
      } else if (total && *content_range->total != *total) {
        refused = "object is now " + std::to_string(*content_range->total) + " bytes, was " + std::to_string(*total);
      } else {
        accepted = true;
      }
    } else if (status == 200 && !ranged) {
      accepted = true;
    } else if (status == 200 && ranged) {
      refused = "server ignores Range (answered 200 to a ranged GET)";
    }
    // Other statuses: the body is an error document, kept for the message.
  }

  static std::size_t on_header(char* data, std::size_t size, std::size_t n, void* self) {
    auto* t = static_cast<Transfer*>(self);
    const std::string_view line(data, size * n);
    if (line.starts_with("HTTP/")) {  // a new response (after 100 Continue or a redirect)
      const std::size_t sp = line.find(' ');
      t->status = sp == std::string_view::npos ? 0 : std::atol(std::string(line.substr(sp + 1, 3)).c_str());
      t->etag.clear();
      t->content_range.reset();
      t->content_range_text.clear();
      t->content_length.reset();
      t->mtime_ns = 0;
      t->date_s = 0;
    } else if (iequals_prefix(line, "etag:")) {
      t->etag = std::string(header_value(line, "etag:"));
    } else if (iequals_prefix(line, "content-range:")) {
      t->content_range_text = std::string(header_value(line, "content-range:"));
      t->content_range = parse_content_range(t->content_range_text);
    } else if (iequals_prefix(line, "content-length:")) {
      t->content_length = std::strtoull(std::string(header_value(line, "content-length:")).c_str(), nullptr, 10);
    } else if (iequals_prefix(line, "last-modified:")) {
      t->mtime_ns = parse_http_date(header_value(line, "last-modified:"));
    } else if (iequals_prefix(line, "date:")) {
      t->date_s = parse_http_date(header_value(line, "date:")) / 1'000'000'000;
    }
    return size * n;
  }

  static std::size_t on_body(char* data, std::size_t size, std::size_t n, void* self) {
    auto* t = static_cast<Transfer*>(self);
    const std::size_t bytes = size * n;
    if (!t->decided) t->decide();
    if (!t->refused.empty()) return 0;  // CURLE_WRITE_ERROR
    if (!t->accepted) {
      const std::size_t keep = std::min(bytes, kErrorBodyLimit - std::min(kErrorBodyLimit, t->error_body.size()));
      t->error_body.append(data, keep);
      return bytes;
    }
    if (t->text != nullptr) {
      if (t->text->size() + bytes > kTextLimit) {
        t->refused = "answer exceeds " + std::to_string(kTextLimit) + " bytes";
        return 0;
      }
      t->text->append(data, bytes);
    } else {
      if (t->got + bytes > t->capacity) {
        t->refused = "server sent more bytes than the range asked (Content-Length mismatch)";
        return 0;
      }
      std::memcpy(t->dest + t->got, data, bytes);
    }
    t->got += bytes;
    return bytes;
  }
};

bool retryable_status(long status) { return status == 429 || status == 500 || status == 502 || status == 503 || status == 504; }

bool retryable_curl(CURLcode rc) {
  switch (rc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_PARTIAL_FILE:
    case CURLE_GOT_NOTHING:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
}

std::string range_text(std::uint64_t first, std::uint64_t last) {
  return std::to_string(first) + "-" + std::to_string(last);
}

std::string status_message(long status, const std::string& body) {
  std::string msg = "HTTP " + std::to_string(status);
  if (const std::string code = s3_error_code(body); !code.empty()) msg += " (" + printable(code) + ")";
  return msg;
}

}  // namespace

struct RemoteClient::Handle {
  CURL* curl = nullptr;
};

RemoteClient::RemoteClient(const RemoteOptions& options, S3Config s3)
    : options_(options), s3_(std::move(s3)), connections_(effective_connections(options)) {
  init_curl_once();
  ca_file_ = options_.ca_file;
  if (ca_file_.empty()) {
    if (const char* bundle = std::getenv("AWS_CA_BUNDLE"); bundle != nullptr) ca_file_ = bundle;
  }
  if (!options_.verify_tls) log::warn("TLS verification is OFF for remote reads (verify_tls = false)");
  if (!options_.cache_dir.empty()) cache_ = std::make_shared<ObjectCache>(options_.cache_dir, options_.cache_bytes);
}

RemoteClient::~RemoteClient() {
  for (Handle* h : idle_) {
    curl_easy_cleanup(h->curl);
    delete h;
  }
}

RemoteClient::Handle* RemoteClient::acquire() {
  {
    std::lock_guard lock(mu_);
    if (!idle_.empty()) {
      Handle* h = idle_.back();
      idle_.pop_back();
      return h;
    }
  }
  auto h = std::make_unique<Handle>();
  h->curl = curl_easy_init();
  if (h->curl == nullptr) throw IoError("cannot create a libcurl handle");
  std::lock_guard lock(mu_);
  ++open_handles_;
  return h.release();
}

void RemoteClient::release(Handle* h) {
  curl_easy_reset(h->curl);  // keeps the connection, DNS and TLS session caches
  std::lock_guard lock(mu_);
  if (idle_.size() < std::max<std::size_t>(connections_, 1) * 2) {
    idle_.push_back(h);
    return;
  }
  --open_handles_;
  curl_easy_cleanup(h->curl);
  delete h;
}

RemoteClient::HandleCounts RemoteClient::handle_counts() {
  std::lock_guard lock(mu_);
  return {open_handles_, idle_.size()};
}

// A handle for one request; back to the pool at scope exit.
class RemoteClient::Lease {
 public:
  explicit Lease(RemoteClient* c) : client_(c), h_(c->acquire()) {}
  ~Lease() { client_->release(h_); }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  CURL* curl() const { return h_->curl; }

 private:
  RemoteClient* client_;
  Handle* h_;
};

std::string RemoteClient::request_url(const std::string& path) const {
  const std::optional<Location> loc = parse_location(path);
  if (!loc) throw InvalidFileError("not a remote path", ErrorContext{path});
  if (loc->scheme == Location::Scheme::kHttp) return loc->url;
  return s3_object_url(s3_, loc->bucket, loc->key);
}

namespace {

struct Request {
  std::string url;
  bool s3 = false;
  std::string if_match;
};

CURLcode perform(CURL* h, const Request& req, const S3Config& s3, const RemoteOptions& options,
                 const std::string& ca_file, Transfer* t) {
  curl_easy_setopt(h, CURLOPT_URL, req.url.c_str());
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
  curl_easy_setopt(h, CURLOPT_BUFFERSIZE, 512L << 10);
  curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, static_cast<long>(options.connect_timeout_s));
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, static_cast<long>(std::max(options.low_speed_time_s, 1u)));
  curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, options.verify_tls ? 1L : 0L);
  curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, options.verify_tls ? 2L : 0L);
  if (!ca_file.empty()) curl_easy_setopt(h, CURLOPT_CAINFO, ca_file.c_str());
  curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &Transfer::on_header);
  curl_easy_setopt(h, CURLOPT_HEADERDATA, t);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &Transfer::on_body);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, t);
  std::string range;
  if (t->ranged) {
    range = range_text(t->first, t->last);
    curl_easy_setopt(h, CURLOPT_RANGE, range.c_str());
  }
  curl_slist* headers = nullptr;
  std::string if_match, token;
  if (!req.if_match.empty()) {
    if_match = "If-Match: " + req.if_match;
    headers = curl_slist_append(headers, if_match.c_str());
  }
  std::string userpwd, sigv4;
  if (req.s3 && !s3.anonymous()) {
    sigv4 = "aws:amz:" + s3.region + ":s3";
    userpwd = s3.access_key + ":" + s3.secret_key;
    curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4.c_str());
    curl_easy_setopt(h, CURLOPT_USERPWD, userpwd.c_str());
    headers = curl_slist_append(headers, (std::string("x-amz-content-sha256: ") + kEmptyPayloadSha256).c_str());
    if (!s3.session_token.empty()) {
      token = "x-amz-security-token: " + s3.session_token;
      headers = curl_slist_append(headers, token.c_str());
    }
  } else if (!req.s3) {
    curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(h, CURLOPT_MAXREDIRS, 5L);
    curl_easy_setopt(h, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
  }
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  const CURLcode rc = curl_easy_perform(h);
  if (!t->decided && t->refused.empty()) t->decide();  // an empty body never called on_body
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, nullptr);
  curl_slist_free_all(headers);
  // The secret goes no further than this frame and libcurl's copy, which
  // curl_easy_reset drops.
  std::fill(userpwd.begin(), userpwd.end(), '\0');
  return rc;
}

void backoff(const RemoteOptions& options, unsigned failures) {
  const unsigned shift = std::min(failures, 10u);
  const unsigned ms = std::min(kMaxBackoffMs, options.retry_base_ms << shift);
  thread_local std::minstd_rand jitter(std::random_device{}());
  std::this_thread::sleep_for(std::chrono::milliseconds(ms / 2 + jitter() % (ms / 2 + 1)));
}

}  // namespace

ObjectInfo RemoteClient::get_range(const std::string& path, std::uint64_t offset, std::uint64_t length,
                                   std::byte* dest, const ObjectInfo* expect, bool probe, std::uint64_t* got_out) {
  const std::string shown = display_url(path);
  const std::uint64_t end = offset + length;
  Request req;
  req.url = request_url(path);
  req.s3 = path.starts_with("s3://");
  // An ETag is visible ASCII or obs-text (RFC 9110 8.8.3). One with a control byte, sent in
  // If-Match, would end that header line and start others: the daemon of a node store sends its
  // clients' ETags.
  if (expect != nullptr && std::any_of(expect->etag.begin(), expect->etag.end(), [](char c) {
        return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
      })) {
    throw IoError("invalid ETag " + printable(expect->etag) + " (a control byte)", ErrorContext{shown, {}, offset, end});
  }
  // W/ never matches If-Match (RFC 9110 compares strongly): such answers are compared below.
  if (expect != nullptr && !expect->etag.starts_with("W/")) req.if_match = expect->etag;
  ObjectInfo info;
  info.path = path;
  std::uint64_t done = 0;
  unsigned failures = 0, attempts = 0, stalls = 0;
  std::string last_cause;
  Lease lease(this);
  for (;;) {
    Transfer t;
    t.dest = dest + done;
    t.capacity = length - done;
    t.ranged = true;
    t.first = offset + done;
    t.last = end - 1;
    t.probe = probe;
    if (expect != nullptr) t.total = expect->size;
    ++attempts;
    const CURLcode rc = perform(lease.curl(), req, s3_, options_, ca_file_, &t);
    const ErrorContext where{shown, {}, t.first, end};
    if (!t.refused.empty()) throw IoError(t.refused, where);
    if (t.accepted) {
      if (expect != nullptr && !expect->etag.empty() && t.etag.empty()) {
        // Nothing confirms the version asked: a store's daemon would take any bytes for it.
        throw IoError("the server sent no ETag, so the version " + printable(expect->etag) + " cannot be checked", where);
      }
      if (expect != nullptr && !expect->etag.empty() && t.etag != expect->etag) {
        throw IoError("object changed while loading (ETag " + printable(t.etag) + ", was " + printable(expect->etag) + ")", where);
      }
      // Note [Remote consistency]: the second of a coarse validator.
      if (expect != nullptr && expect->mtime_ns != 0 && t.mtime_ns != 0 && t.mtime_ns != expect->mtime_ns) {
        throw IoError("object changed while loading (Last-Modified " + std::to_string(t.mtime_ns / 1'000'000'000) +
                      " s, was " + std::to_string(expect->mtime_ns / 1'000'000'000) + " s since the epoch)", where);
      }
      if (info.etag.empty()) info.etag = t.etag;
      if (t.mtime_ns != 0) info.mtime_ns = t.mtime_ns;
      if (t.date_s != 0) info.date_s = t.date_s;
      if (t.content_range && t.content_range->total) info.size = *t.content_range->total;
      done += t.got;
    }
    if (rc == CURLE_OK && t.accepted) {
      const std::uint64_t want = probe ? t.content_range->last + 1 - offset : length;
      if (done != want) {
        throw IoError("body of " + std::to_string(t.got) + " bytes for a range of " + std::to_string(want - (done - t.got)) +
                      " (Content-Length mismatch)", where);
      }
      *got_out = done;
      return info;
    }
    if (rc == CURLE_OK) {  // an HTTP error status
      if (t.status == 416 && probe && offset == 0 && t.content_range && !t.content_range->satisfied &&
          t.content_range->total == 0u) {
        info.size = 0;  // an empty object
        info.etag = t.etag;
        *got_out = 0;
        return info;
      }
      if (t.status == 404 || t.status == 410) throw NotFoundError("no such object: " + status_message(t.status, t.error_body), where);
      if (t.status == 412) {
        throw IoError("object changed since its header was read (If-Match " + printable(req.if_match) + " failed)", where);
      }
      if (!retryable_status(t.status)) {
        std::string msg = status_message(t.status, t.error_body);
        if (t.status == 401 || t.status == 403) msg += req.s3 ? ": access denied (check the AWS credentials)" : ": access denied";
        throw IoError(msg, where);
      }
      last_cause = status_message(t.status, t.error_body);
    } else if (rc == CURLE_OPERATION_TIMEDOUT && t.status != 0) {
      last_cause = "stalled (under 1 KiB/s for " + std::to_string(std::max(options_.low_speed_time_s, 1u)) + " s)";
    } else if (retryable_curl(rc)) {
      last_cause = curl_easy_strerror(rc);
    } else {
      throw IoError(std::string("GET failed: ") + curl_easy_strerror(rc), where);
    }
    // Retry: a range that made progress starts its count again, unless it
    // stalled: every stall counts (Note [Remote faults]).
    const bool stalled = rc == CURLE_OPERATION_TIMEDOUT;
    stalls += stalled ? 1 : 0;
    failures = t.got > 0 && !stalled ? 0 : failures + 1;
    if (failures > options_.retries || stalls > options_.retries || attempts > 4 * (options_.retries + 1)) {
      throw IoError(last_cause + " (gave up after " + std::to_string(attempts) + " attempts)", where);
    }
    log::debug("{}: bytes {}-{}: {}, retrying", shown, offset + done, end, last_cause);
    if (failures > 0) backoff(options_, failures - 1);
  }
}

ObjectInfo RemoteClient::open(const std::string& path, std::byte* dest, std::uint64_t want, std::uint64_t* got) {
  if (want == 0) throw InvalidFileError("empty probe", ErrorContext{display_url(path)});
  return get_range(path, 0, want, dest, nullptr, true, got);
}

void RemoteClient::read(const ObjectInfo& object, std::uint64_t offset, std::uint64_t length, std::byte* dest) {
  if (length == 0) return;
  if (offset + length > object.size) {
    throw IoError("range past the object's end (" + std::to_string(object.size) + " bytes)",
                  ErrorContext{display_url(object.path), {}, offset, offset + length});
  }
  std::uint64_t got = 0;
  get_range(object.path, offset, length, dest, &object, false, &got);
}

std::string RemoteClient::read_small(const std::string& path, std::uint64_t limit, ObjectInfo* info_out) {
  std::string text(std::min(limit, kProbeBytes), '\0');
  std::uint64_t got = 0;
  ObjectInfo info = text.empty() ? ObjectInfo{} : open(path, reinterpret_cast<std::byte*>(text.data()), text.size(), &got);
  if (info.size > limit) {
    throw InvalidFileError("object of " + std::to_string(info.size) + " bytes exceeds the limit of " +
                           std::to_string(limit), ErrorContext{display_url(path)});
  }
  text.resize(info.size);
  if (info.size > got) read(info, got, info.size - got, reinterpret_cast<std::byte*>(text.data()) + got);
  if (info_out != nullptr) *info_out = info;
  return text;
}

std::optional<ObjectInfo> RemoteClient::stat(const std::string& path) {
  std::byte one[1];
  std::uint64_t got = 0;
  try {
    return open(path, one, 1, &got);
  } catch (const NotFoundError&) {
    return std::nullopt;
  }
}

Listing RemoteClient::list(const std::string& path) {
  const std::optional<Location> loc = parse_location(path);
  if (!loc || loc->scheme != Location::Scheme::kS3) {
    throw InvalidFileError("only s3:// folders can be listed; name the file or index", ErrorContext{display_url(path)});
  }
  Listing out;
  std::string token;
  Lease lease(this);
  unsigned failures = 0;
  do {
    Request req;
    req.url = s3_list_url(s3_, loc->bucket, loc->key, token);
    req.s3 = true;
    std::string text;
    Transfer t;
    t.text = &text;
    const CURLcode rc = perform(lease.curl(), req, s3_, options_, ca_file_, &t);
    const ErrorContext where{path};
    if (!t.refused.empty()) throw IoError(t.refused, where);
    if (rc == CURLE_OK && t.accepted) {
      ListPage page = parse_list_page(text);
      for (const ListPage::Object& o : page.objects) {
        if (o.key.size() > loc->key.size() && o.key.starts_with(loc->key)) out.files.push_back(o.key.substr(loc->key.size()));
      }
      for (std::string& p : page.prefixes) {
        if (p.size() > loc->key.size() + 1 && p.starts_with(loc->key)) out.folders.push_back(p.substr(loc->key.size(), p.size() - loc->key.size() - 1));
      }
      token = page.truncated ? page.next_token : std::string{};
      failures = 0;
      continue;
    }
    std::string cause = rc == CURLE_OK ? status_message(t.status, t.error_body) : curl_easy_strerror(rc);
    if (rc == CURLE_OK && t.status == 404) throw NotFoundError("cannot list: " + cause, where);
    const bool retry = rc == CURLE_OK ? retryable_status(t.status) : retryable_curl(rc);
    if (!retry || ++failures > options_.retries) throw IoError("cannot list: " + cause, where);
    backoff(options_, failures - 1);
  } while (!token.empty() || failures > 0);
  std::sort(out.files.begin(), out.files.end());
  std::sort(out.folders.begin(), out.folders.end());
  return out;
}

namespace {

// PINLOAD_CONNECTIONS (where `connections` is 0), PINLOAD_REMOTE_* overrides
// of the fault-handling knobs (tests and field tuning), and
// PINLOAD_TLS_VERIFY=0, the explicit TLS opt-out.
RemoteOptions with_environment(RemoteOptions options) {
  auto number = [](const char* name, unsigned* field) {
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') {
      char* end = nullptr;
      const unsigned long n = std::strtoul(v, &end, 10);
      if (end != nullptr && *end == '\0' && n <= 1'000'000) *field = static_cast<unsigned>(n);
    }
  };
  // Resolved now, so that clients are kept per connection count: a client
  // made under another PINLOAD_CONNECTIONS is not reused for this load.
  options.connections = effective_connections(options);
  number("PINLOAD_REMOTE_RETRIES", &options.retries);
  number("PINLOAD_REMOTE_RETRY_BASE_MS", &options.retry_base_ms);
  number("PINLOAD_REMOTE_LOW_SPEED_TIME", &options.low_speed_time_s);
  number("PINLOAD_REMOTE_CONNECT_TIMEOUT", &options.connect_timeout_s);
  if (const char* v = std::getenv("PINLOAD_TLS_VERIFY"); v != nullptr && std::string_view(v) == "0") {
    options.verify_tls = false;
  }
  if (options.cache_dir.empty()) {
    if (const char* v = std::getenv("PINLOAD_CACHE_DIR"); v != nullptr) options.cache_dir = v;
  }
  if (options.cache_bytes == 0) {
    if (const char* v = std::getenv("PINLOAD_CACHE_BYTES"); v != nullptr) options.cache_bytes = std::strtoull(v, nullptr, 10);
  }
  return options;
}

}  // namespace

std::shared_ptr<RemoteClient> client_for(const RemoteOptions& requested) {
  const RemoteOptions options = with_environment(requested);
  S3Config s3 = resolve_s3_config([](const char* name) { return std::getenv(name); },
                                  [](const std::string& file) -> std::optional<std::string> {
                                    std::ifstream in(file);
                                    if (!in) return std::nullopt;
                                    std::ostringstream text;
                                    text << in.rdbuf();
                                    return text.str();
                                  });
  struct Entry {
    RemoteOptions options;
    S3Config s3;
    std::shared_ptr<RemoteClient> client;
  };
  static std::mutex mu;
  static std::vector<Entry> clients;  // most recent last; a few kept
  std::lock_guard lock(mu);
  for (auto it = clients.begin(); it != clients.end(); ++it) {
    if (it->options == options && it->s3 == s3) {
      std::rotate(it, it + 1, clients.end());
      return clients.back().client;
    }
  }
  auto client = std::make_shared<RemoteClient>(options, s3);
  if (clients.size() >= 4) clients.erase(clients.begin());
  clients.push_back(Entry{options, std::move(s3), client});
  return client;
}

}  // namespace pinload::remote
