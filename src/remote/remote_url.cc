#include "remote/remote_url.h"

#include <curl/curl.h>

#include <langinfo.h>

#include <algorithm>
#include <memory>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <ctime>

#include "pinload/error.h"
#include "pinload/remote.h"

namespace pinload {

bool is_remote_path(std::string_view path) noexcept {
  return path.starts_with("s3://") || path.starts_with("http://") || path.starts_with("https://");
}

void refuse_unread_scheme(std::string_view path) {
  if (is_remote_path(path) || remote::url_scheme(path).empty()) return;
  throw InvalidArgumentError("a URL of a scheme pinload does not read: it reads s3://, http:// and https:// "
                             "(gs:// and Azure: see docs/remote.md)",
                             ErrorContext{remote::display_url(path)});
}

}  // namespace pinload

namespace pinload::remote {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::optional<std::uint64_t> parse_u64(std::string_view s) {
  std::uint64_t v = 0;
  if (s.empty()) return std::nullopt;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size()) return std::nullopt;
  return v;
}

std::string xml_unescape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out += s[i];
      continue;
    }
    const std::size_t semi = s.find(';', i);
    if (semi == std::string_view::npos) {
      out += s[i];
      continue;
    }
    const std::string_view entity = s.substr(i + 1, semi - i - 1);
    if (entity == "amp") out += '&';
    else if (entity == "lt") out += '<';
    else if (entity == "gt") out += '>';
    else if (entity == "quot") out += '"';
    else if (entity == "apos") out += '\'';
    else if (entity.starts_with("#x") || entity.starts_with("#")) {
      const bool hex = entity.starts_with("#x");
      unsigned code = 0;
      const std::string_view digits = entity.substr(hex ? 2 : 1);
      auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), code, hex ? 16 : 10);
      if (ec != std::errc{} || end != digits.data() + digits.size() || code > 0x7f) {
        out.append(s.substr(i, semi - i + 1));  // non-ASCII references: left as written
      } else {
        out += static_cast<char>(code);
      }
    } else {
      out.append(s.substr(i, semi - i + 1));
    }
    i = semi;
  }
  return out;
}

// The text of each <tag>...</tag> in `xml` from `from` up to `until`.
std::vector<std::string_view> elements(std::string_view xml, std::string_view tag) {
  std::vector<std::string_view> out;
  const std::string open = "<" + std::string(tag) + ">";
  const std::string close = "</" + std::string(tag) + ">";
  std::size_t at = 0;
  while ((at = xml.find(open, at)) != std::string_view::npos) {
    const std::size_t begin = at + open.size();
    const std::size_t end = xml.find(close, begin);
    if (end == std::string_view::npos) break;
    out.push_back(xml.substr(begin, end - begin));
    at = end + close.size();
  }
  return out;
}

std::string first_element(std::string_view xml, std::string_view tag) {
  auto all = elements(xml, tag);
  return all.empty() ? std::string{} : xml_unescape(all.front());
}

}  // namespace

namespace {

// Note [Canonical URLs]: one URL as libcurl's URL API holds it.
class CurlUrl {
 public:
  CurlUrl() : h_(curl_url()) {
    if (h_ == nullptr) throw std::bad_alloc();
  }
  ~CurlUrl() { curl_url_cleanup(h_); }
  CurlUrl(const CurlUrl&) = delete;
  CurlUrl& operator=(const CurlUrl&) = delete;

  CURLUcode set(CURLUPart part, const std::string& value, unsigned flags) {
    return curl_url_set(h_, part, value.c_str(), flags);
  }
  // The part, or nullopt where it is absent (or cannot be had: `rc` says).
  std::optional<std::string> get(CURLUPart part, unsigned flags, CURLUcode* rc = nullptr) const {
    char* text = nullptr;
    const CURLUcode got = curl_url_get(h_, part, &text, flags);
    if (rc != nullptr) *rc = got;
    if (got != CURLUE_OK) return std::nullopt;
    std::string out(text);
    curl_free(text);
    return out;
  }

 private:
  CURLU* h_;
};

// The host as libcurl fetches it, converted to IDNA (punycode). libcurl converts a non-ASCII
// host with libidn2 from the locale's character set; under an ASCII one (the C locale) the
// conversion fails, and libcurl 7.88 leaks the attempt's buffers, so such a host is refused
// here before libcurl is asked (Note [Canonical URLs]). nullopt: no host, or none to fetch.
std::optional<std::string> idna_host(const CurlUrl& u) {
  const std::optional<std::string> raw = u.get(CURLUPART_HOST, 0);
  if (!raw || std::all_of(raw->begin(), raw->end(), [](unsigned char c) { return c < 0x80; })) return raw;
  const std::string_view codeset = nl_langinfo(CODESET);
  if (codeset == "ANSI_X3.4-1968" || codeset == "ASCII" || codeset == "US-ASCII") return std::nullopt;
  return u.get(CURLUPART_HOST, CURLU_PUNYCODE);
}

bool has_authority(std::string_view url) {
  const std::size_t host = url.find("://");
  return host != std::string_view::npos && host + 3 < url.size() && url[host + 3] != '/';
}

std::string ascii_lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// An http(s) URL parsed as libcurl fetches it, or nullopt (`problem` says why).
std::unique_ptr<CurlUrl> parse_http(std::string_view url, std::string* problem) {
  auto u = std::make_unique<CurlUrl>();
  if (const CURLUcode rc = u->set(CURLUPART_URL, std::string(url), CURLU_URLENCODE); rc != CURLUE_OK) {
    *problem = std::string("libcurl cannot parse the URL: ") + curl_url_strerror(rc);
    return nullptr;
  }
  const std::optional<std::string> scheme = u->get(CURLUPART_SCHEME, 0);
  if (scheme != "http" && scheme != "https") {
    *problem = "only http, https and s3 URLs are read";
    return nullptr;
  }
  return u;
}

// S3's characters of a bucket name (with the legacy upper case and '_').
bool valid_bucket(std::string_view bucket) {
  return !bucket.empty() && std::all_of(bucket.begin(), bucket.end(), [](unsigned char c) {
    return std::isalnum(c) || c == '.' || c == '-' || c == '_';
  });
}

}  // namespace

std::optional<Location> parse_location(std::string_view path) {
  Location loc;
  if (path.starts_with("s3://")) {
    loc.scheme = Location::Scheme::kS3;
    const std::string_view rest = path.substr(5);
    const std::size_t slash = rest.find('/');
    loc.bucket = std::string(rest.substr(0, slash));
    loc.key = slash == std::string_view::npos ? std::string{} : std::string(rest.substr(slash + 1));
    if (loc.bucket.empty()) throw InvalidFileError("S3 path has no bucket", ErrorContext{std::string(path)});
    canonical_url(path);  // checks the bucket
    return loc;
  }
  if (path.starts_with("http://") || path.starts_with("https://")) {
    if (!has_authority(path)) throw InvalidFileError("URL has no host", ErrorContext{display_url(path)});
    loc.scheme = Location::Scheme::kHttp;
    loc.url = canonical_url(path);
    return loc;
  }
  return std::nullopt;
}

std::string canonical_url(std::string_view url) {
  const auto refuse = [&](const std::string& why) -> std::string {
    throw InvalidArgumentError(why, ErrorContext{display_url(url)});
  };
  if (url.starts_with("s3://")) {
    const std::string_view rest = url.substr(5);
    if (!valid_bucket(rest.substr(0, rest.find('/')))) {
      return refuse("an S3 bucket name is made of letters, digits, '.', '-' and '_'");
    }
    return std::string(url);
  }
  if (!url.starts_with("http://") && !url.starts_with("https://")) {
    return refuse("only http, https and s3 URLs are read (gs:// and Azure: see docs/remote.md)");
  }
  // libcurl reads 'http:///h/m' as host h; the URL names none.
  if (!has_authority(url)) return refuse("URL has no host");
  std::string problem;
  std::unique_ptr<CurlUrl> u = parse_http(url, &problem);
  if (!u) return refuse(problem);
  if (u->get(CURLUPART_USER, 0) || u->get(CURLUPART_PASSWORD, 0) || u->get(CURLUPART_OPTIONS, 0)) {
    return refuse("URL holds user information (user:password@); pass credentials in a presigned URL's query");
  }
  if (u->get(CURLUPART_FRAGMENT, 0) || url.find('#') != std::string_view::npos) {
    return refuse("URL holds a fragment ('#'), which is never sent to the server; write '#' in a path as %23");
  }
  const std::optional<std::string> host = idna_host(*u);
  if (!host) {
    return refuse("libcurl cannot convert the host name to IDNA (a non-ASCII host needs a UTF-8 locale, or write "
                  "it as punycode)");
  }
  // An IPv6 literal keeps its zone id's case (an interface name).
  if (u->set(CURLUPART_HOST, host->starts_with('[') ? *host : ascii_lower(*host), 0) != CURLUE_OK) {
    return refuse("libcurl refuses the host name");
  }
  const std::optional<std::string> out = u->get(CURLUPART_URL, CURLU_NO_DEFAULT_PORT);
  CurlUrl again;
  if (!out || again.set(CURLUPART_URL, *out, 0) != CURLUE_OK || again.get(CURLUPART_URL, CURLU_NO_DEFAULT_PORT) != out) {
    return refuse("libcurl does not parse the URL to one form");
  }
  return *out;
}

std::string_view url_scheme(std::string_view path) {
  const std::size_t end = path.find("://");
  if (end == std::string_view::npos || end == 0) return {};
  const std::string_view scheme = path.substr(0, end);
  const bool ok = std::isalpha(static_cast<unsigned char>(scheme[0])) &&
                  std::all_of(scheme.begin(), scheme.end(), [](unsigned char c) {
                    return std::isalnum(c) || c == '+' || c == '-' || c == '.';
                  });
  return ok ? scheme : std::string_view{};
}

namespace {

// A URL never fetched, shown cut at its query or fragment, without user information.
std::string shown_unfetched(std::string_view url) {
  std::string out(url.substr(0, url.find_first_of("?#")));
  const std::size_t host = out.find("://") + 3;
  const std::size_t at = out.rfind('@', std::min(out.find('/', host), out.size()));
  if (at != std::string::npos && at >= host) out.erase(host, at + 1 - host);
  return out;
}

}  // namespace

std::string display_url(std::string_view url) {
  if (url.starts_with("s3://") || url_scheme(url).empty()) return std::string(url);
  // Another scheme is never fetched (an Azure SAS token is a query).
  if (!url.starts_with("http://") && !url.starts_with("https://")) return shown_unfetched(url);
  std::string problem;
  if (std::unique_ptr<CurlUrl> u = parse_http(url, &problem)) {
    std::string host = idna_host(*u).value_or(u->get(CURLUPART_HOST, 0).value_or(""));
    if (!host.starts_with('[')) host = ascii_lower(std::move(host));
    const std::optional<std::string> port = u->get(CURLUPART_PORT, CURLU_NO_DEFAULT_PORT);
    return *u->get(CURLUPART_SCHEME, 0) + "://" + host + (port ? ":" + *port : "") +
           u->get(CURLUPART_PATH, 0).value_or("/");
  }
  return shown_unfetched(url);  // never fetched
}

std::string uri_encode(std::string_view s, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += ch;
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

std::optional<ContentRange> parse_content_range(std::string_view value) {
  value = trim(value);
  if (!value.starts_with("bytes ")) return std::nullopt;
  value = trim(value.substr(6));
  const std::size_t slash = value.find('/');
  if (slash == std::string_view::npos) return std::nullopt;
  ContentRange r;
  const std::string_view span = value.substr(0, slash), total = value.substr(slash + 1);
  if (total != "*") {
    r.total = parse_u64(total);
    if (!r.total) return std::nullopt;
  }
  if (span == "*") {
    r.satisfied = false;
    return r;
  }
  const std::size_t dash = span.find('-');
  if (dash == std::string_view::npos) return std::nullopt;
  auto first = parse_u64(span.substr(0, dash)), last = parse_u64(span.substr(dash + 1));
  if (!first || !last || *last < *first || (r.total && *last >= *r.total)) return std::nullopt;
  r.first = *first;
  r.last = *last;
  return r;
}

std::string content_range_problem(std::string_view value) {
  if (parse_content_range(value)) return {};
  std::string_view v = trim(value);
  if (!v.starts_with("bytes ")) return "its unit is not 'bytes'";
  v = trim(v.substr(6));
  const std::size_t slash = v.find('/');
  if (slash == std::string_view::npos) return "it has no '/TOTAL'";
  const std::string_view span = v.substr(0, slash), total_text = v.substr(slash + 1);
  const std::optional<std::uint64_t> total = parse_u64(total_text);
  if (total_text != "*" && !total) return "its total is not a number";
  const std::size_t dash = span.find('-');
  if (dash == std::string_view::npos) return "its range is not FIRST-LAST";
  const auto first = parse_u64(span.substr(0, dash)), last = parse_u64(span.substr(dash + 1));
  if (!first || !last) return "its range is not FIRST-LAST in digits";
  if (*last < *first) return "its last byte is before its first";
  if (total && *last >= *total) return "its last byte is past the object's " + std::to_string(*total) + " bytes";
  return "it does not parse";
}

ListPage parse_list_page(std::string_view xml) {
  if (xml.find("<ListBucketResult") == std::string_view::npos) {
    throw InvalidFileError("bucket listing is not a ListBucketResult");
  }
  ListPage page;
  for (std::string_view contents : elements(xml, "Contents")) {
    ListPage::Object o;
    o.key = first_element(contents, "Key");
    o.size = parse_u64(first_element(contents, "Size")).value_or(0);
    page.objects.push_back(std::move(o));
  }
  for (std::string_view common : elements(xml, "CommonPrefixes")) page.prefixes.push_back(first_element(common, "Prefix"));
  page.truncated = first_element(xml, "IsTruncated") == "true";
  page.next_token = first_element(xml, "NextContinuationToken");
  if (page.truncated && page.next_token.empty()) {
    throw InvalidFileError("truncated bucket listing without a continuation token");
  }
  return page;
}

std::string s3_error_code(std::string_view xml) {
  if (xml.find("<Error") == std::string_view::npos) return {};
  return first_element(xml, "Code");
}

Ini parse_ini(std::string_view text) {
  Ini ini;
  std::string section;
  while (!text.empty()) {
    const std::size_t nl = text.find('\n');
    std::string_view line = trim(text.substr(0, nl));
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    if (line.empty() || line.front() == '#' || line.front() == ';') continue;
    if (line.front() == '[' && line.back() == ']') {
      section = std::string(trim(line.substr(1, line.size() - 2)));
      ini[section];
      continue;
    }
    const std::size_t eq = line.find('=');
    if (eq == std::string_view::npos) continue;
    std::string key(trim(line.substr(0, eq)));
    std::transform(key.begin(), key.end(), key.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    ini[section][key] = std::string(trim(line.substr(eq + 1)));
  }
  return ini;
}

S3Config resolve_s3_config(const std::function<const char*(const char*)>& getenv,
                           const std::function<std::optional<std::string>(const std::string&)>& read_file) {
  auto env = [&](const char* name) -> std::string {
    const char* v = getenv(name);
    return v != nullptr ? std::string(v) : std::string{};
  };
  const std::string home = env("HOME");
  const std::string profile = env("AWS_PROFILE").empty() ? "default" : env("AWS_PROFILE");
  auto load_ini = [&](const char* var, const char* fallback) {
    std::string path = env(var);
    if (path.empty() && !home.empty()) path = home + fallback;
    if (path.empty()) return Ini{};
    std::optional<std::string> text = read_file(path);
    return text ? parse_ini(*text) : Ini{};
  };
  const Ini credentials = load_ini("AWS_SHARED_CREDENTIALS_FILE", "/.aws/credentials");
  const Ini config = load_ini("AWS_CONFIG_FILE", "/.aws/config");
  // ~/.aws/config names profiles "[profile x]", except "[default]".
  auto config_section = [&]() -> const std::map<std::string, std::string>* {
    for (const std::string& name : {"profile " + profile, profile}) {
      if (auto it = config.find(name); it != config.end()) return &it->second;
    }
    return nullptr;
  }();
  auto from_files = [&](const std::string& key) -> std::string {
    if (auto it = credentials.find(profile); it != credentials.end()) {
      if (auto v = it->second.find(key); v != it->second.end()) return v->second;
    }
    if (config_section != nullptr) {
      if (auto v = config_section->find(key); v != config_section->end()) return v->second;
    }
    return {};
  };

  S3Config c;
  if (!env("AWS_ACCESS_KEY_ID").empty() && !env("AWS_SECRET_ACCESS_KEY").empty()) {
    c.access_key = env("AWS_ACCESS_KEY_ID");
    c.secret_key = env("AWS_SECRET_ACCESS_KEY");
    c.session_token = env("AWS_SESSION_TOKEN");
  } else if (!from_files("aws_access_key_id").empty()) {
    c.access_key = from_files("aws_access_key_id");
    c.secret_key = from_files("aws_secret_access_key");
    c.session_token = from_files("aws_session_token");
  }
  std::string region = env("AWS_REGION");
  if (region.empty()) region = env("AWS_DEFAULT_REGION");
  if (region.empty()) region = from_files("region");
  if (!region.empty()) c.region = region;
  std::string endpoint = env("AWS_ENDPOINT_URL_S3");
  if (endpoint.empty()) endpoint = env("AWS_ENDPOINT_URL");
  if (endpoint.empty()) endpoint = from_files("endpoint_url");
  if (endpoint.empty()) {
    c.endpoint = "https://s3." + c.region + ".amazonaws.com";
    c.path_style = false;
  } else {
    while (endpoint.ends_with('/')) endpoint.pop_back();
    c.endpoint = endpoint;
    c.path_style = true;
  }
  return c;
}

std::string s3_object_url(const S3Config& config, const std::string& bucket, const std::string& key) {
  const std::string path = "/" + uri_encode(key, true);
  if (config.path_style) return config.endpoint + "/" + uri_encode(bucket, false) + (key.empty() ? "" : path);
  const std::size_t host = config.endpoint.find("://") + 3;
  return config.endpoint.substr(0, host) + bucket + "." + config.endpoint.substr(host) + path;
}

std::string s3_list_url(const S3Config& config, const std::string& bucket, const std::string& prefix,
                        const std::string& token) {
  // SigV4 wants the query sorted by name and encoded; libcurl 7.88 signs it as given.
  std::string query;
  if (!token.empty()) query += "continuation-token=" + uri_encode(token, false) + "&";
  query += "delimiter=%2F&list-type=2&prefix=" + uri_encode(prefix, false);
  // Path-style "endpoint/bucket?..."; virtual-hosted "https://bucket.host/?...".
  return s3_object_url(config, bucket, "") + "?" + query;
}

std::int64_t parse_http_date(std::string_view value) {
  std::tm tm{};
  const std::string text(trim(value));
  if (strptime(text.c_str(), "%a, %d %b %Y %H:%M:%S", &tm) == nullptr) return 0;
  return static_cast<std::int64_t>(timegm(&tm)) * 1'000'000'000;
}

Validator classify_validator(std::string_view etag, std::int64_t last_modified_s) {
  etag = trim(etag);
  if (etag.empty()) return last_modified_s != 0 ? Validator::kCoarse : Validator::kNone;
  if (etag.starts_with("W/")) return Validator::kCoarse;
  if (last_modified_s > 0) {
    std::string_view opaque = etag;
    if (opaque.size() >= 2 && opaque.front() == '"' && opaque.back() == '"') opaque = opaque.substr(1, opaque.size() - 2);
    // nginx: "%xT-%xO"; others join inode, size and mtime with '-' or '_'.
    std::size_t start = 0;
    while (start <= opaque.size()) {
      std::size_t end = opaque.find_first_of("-_", start);
      if (end == std::string_view::npos) end = opaque.size();
      const std::string_view part = opaque.substr(start, end - start);
      for (const int base : {16, 10}) {
        std::uint64_t v = 0;
        auto [p, ec] = std::from_chars(part.data(), part.data() + part.size(), v, base);
        if (!part.empty() && ec == std::errc{} && p == part.data() + part.size() &&
            v == static_cast<std::uint64_t>(last_modified_s)) {
          return Validator::kCoarse;
        }
      }
      start = end + 1;
    }
  }
  return Validator::kStrong;
}

const char* validator_name(Validator v) {
  switch (v) {
    case Validator::kStrong: return "strong ETag";
    case Validator::kCoarse: return "validator of one-second resolution";
    case Validator::kNone: return "no validator";
  }
  return "?";
}

std::optional<std::int64_t> settle_wait_ms(std::int64_t last_modified_s, std::int64_t date_s) {
  // A write at or after server time L + 1 (a coarse file clock may lag a
  // tick: 100 ms of margin) gets another modification second than L.
  if (date_s >= last_modified_s + 2) return 0;
  if (last_modified_s - date_s > kMaxSettleSeconds) return std::nullopt;
  return (last_modified_s + 1 - date_s) * 1000 + 100;
}

static unsigned effective_connections_from(const char* env_value, unsigned option) {
  if (option != 0) return option;
  if (env_value != nullptr) {
    if (auto v = parse_u64(env_value); v && *v > 0 && *v <= 1024) return static_cast<unsigned>(*v);
  }
  return kDefaultConnections;
}

}  // namespace pinload::remote

namespace pinload {
unsigned effective_connections(const RemoteOptions& options) {
  return remote::effective_connections_from(std::getenv("PINLOAD_CONNECTIONS"), options.connections);
}
}  // namespace pinload
