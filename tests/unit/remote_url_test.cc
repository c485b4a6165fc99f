// Remote paths and the text formats of S3 and HTTP (remote_url.h), no I/O.
#include "remote/remote_url.h"

#include <curl/curl.h>
#include <gtest/gtest.h>

#include <cctype>
#include <clocale>
#include <iterator>
#include <map>
#include <random>

#include "base/printable.h"
#include "pinload/error.h"
#include "pinload/remote.h"

namespace pinload::remote {
namespace {

TEST(RemoteUrl, RecognisesRemotePaths) {
  EXPECT_TRUE(is_remote_path("s3://b/k"));
  EXPECT_TRUE(is_remote_path("https://h/x"));
  EXPECT_TRUE(is_remote_path("http://h/x"));
  EXPECT_FALSE(is_remote_path("/data/s3://x"));
  EXPECT_FALSE(is_remote_path("model.safetensors"));
  EXPECT_FALSE(parse_location("./x").has_value());
  auto loc = parse_location("s3://bucket/a/b c.safetensors");
  ASSERT_TRUE(loc);
  EXPECT_EQ(loc->bucket, "bucket");
  EXPECT_EQ(loc->key, "a/b c.safetensors");
  EXPECT_THROW(parse_location("s3:///key"), InvalidFileError);
  EXPECT_THROW(parse_location("http:///x"), InvalidFileError);
}

TEST(RemoteUrl, DisplayDropsCredentialsAndQuery) {
  EXPECT_EQ(display_url("https://user:secret@host:8/a/b?X-Amz-Signature=abc"), "https://host:8/a/b");
  EXPECT_EQ(display_url("http://host/a@b"), "http://host/a@b");
  EXPECT_EQ(display_url("s3://b/k"), "s3://b/k");
}

// A path with a scheme pinload does not read is refused, not taken for a local
// path; it is shown without user information or query (an Azure SAS token).
TEST(RemoteUrl, OtherSchemesAreRefused) {
  const std::pair<std::string, std::string> refused[] = {
      {"gs://b/m.safetensors", "gs://b/m.safetensors"},
      {"az://container/m?sv=2024&sig=SECRET", "az://container/m"},
      {"abfs://u:SECRET@acct.dfs.core.windows.net/m", "abfs://acct.dfs.core.windows.net/m"},
      {"GS://b/m", "GS://b/m"},
      {"file:///tmp/m.safetensors", "file:///tmp/m.safetensors"},
  };
  for (const auto& [path, shown] : refused) {
    try {
      refuse_unread_scheme(path);
      ADD_FAILURE() << path << " was not refused";
    } catch (const InvalidArgumentError& e) {
      EXPECT_EQ(e.context().file, shown);
      EXPECT_NE(std::string(e.what()).find("s3://, http:// and https://"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("SECRET"), std::string::npos) << e.what();
    }
  }
  for (const std::string path : {"s3://b/k", "http://h/m", "https://h/m", "model.safetensors", "/tmp/a:b/m",
                                 "dir/x://y", "://x", "1a://x"}) {
    EXPECT_NO_THROW(refuse_unread_scheme(path)) << path;
  }
}

// libcurl's own parse of `url`: the host it connects to.
std::string curl_host(const std::string& url) {
  CURLU* u = curl_url();
  char* host = nullptr;
  std::string out;
  if (curl_url_set(u, CURLUPART_URL, url.c_str(), CURLU_URLENCODE) == CURLUE_OK &&
      curl_url_get(u, CURLUPART_HOST, &host, 0) == CURLUE_OK) {
    for (const char* c = host; *c != '\0'; ++c) out += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    curl_free(host);
  }
  curl_url_cleanup(u);
  return out;
}

// Note [Canonical URLs]: the host a URL displays (and is keyed) as is the one
// libcurl fetches from (issue 46, defect 4: the key took the text after the
// last '@', libcurl ended the host at '#').
TEST(RemoteUrl, DisplayShowsTheHostLibcurlFetches) {
  struct Row {
    std::string url, shown;
  };
  const Row rows[] = {
      {"http://127.0.0.1:1#@127.0.0.1:2/m", "http://127.0.0.1:1/"},
      {"http://127.0.0.1:1?@127.0.0.1:2/m", "http://127.0.0.1:1/"},
      {"http://127.0.0.1:1/x#@127.0.0.1:2/m", "http://127.0.0.1:1/x"},
      {"http://a\\@evil:9/x", "http://evil:9/x"},
      {"http://u:p@Real.Example:80/a/../m?sig=1", "http://real.example/m"},
      {"https://h:443/m", "https://h/m"},
      {"http://0x7f.1:8/m", "http://127.0.0.1:8/m"},
      {"http://[::1]:8/m", "http://[::1]:8/m"},
      {"s3://b/k?v#w@x", "s3://b/k?v#w@x"},  // an S3 key is whatever follows the bucket
  };
  for (const Row& row : rows) {
    EXPECT_EQ(display_url(row.url), row.shown) << row.url;
    if (row.url.starts_with("http")) {
      const std::string host = curl_host(row.url);
      EXPECT_FALSE(host.empty()) << row.url;
      EXPECT_NE(display_url(row.url).find("//" + host), std::string::npos) << row.url;
    }
  }
  // Never fetched (libcurl refuses it): cut at '?' or '#', without user information.
  EXPECT_EQ(display_url("http://a@b@c/x?q"), "http://c/x");
}

TEST(RemoteUrl, CanonicalUrlIsLibcurls) {
  struct Row {
    std::string url, canonical;
  };
  const Row rows[] = {
      {"http://Real.EXAMPLE:80/a/../m.safetensors", "http://real.example/m.safetensors"},
      {"https://h:443/m", "https://h/m"},
      {"https://h:8443/m?X-Amz-Signature=ab&X-Amz-Date=1", "https://h:8443/m?X-Amz-Signature=ab&X-Amz-Date=1"},
      {"http://h", "http://h/"},
      {"http://h:/m", "http://h/m"},
      {"http://h/a b.safetensors", "http://h/a%20b.safetensors"},
      {"http://h/w\xc3\xbcrfel", "http://h/w%c3%bcrfel"},
      {"http://h/a%2Fb%20c", "http://h/a%2Fb%20c"},
      {"http://0x7f.1:8/m", "http://127.0.0.1:8/m"},
      {"http://[::1]:80/m", "http://[::1]/m"},
      {"s3://bucket/a b#c?d@e", "s3://bucket/a b#c?d@e"},
      {"s3://bucket", "s3://bucket"},
  };
  for (const Row& row : rows) {
    EXPECT_EQ(canonical_url(row.url), row.canonical) << row.url;
    EXPECT_EQ(canonical_url(row.canonical), row.canonical) << row.url;
  }
  const std::string refused[] = {
      "http://127.0.0.1:1#@127.0.0.1:2/m",  // defect 4
      "http://h/m#",
      "http://h/m#frag",
      "http://u:p@h/m",
      "http://u@h/m",
      "http://a\\@evil/m",
      "http://a@b@c/m",
      "http://h:99999/m",
      "http://h/\x01m",
      "http:///m",
      "ftp://h/m",
      "gs://bucket/m",
      "s3://ev:il@host/m",
      "s3://b#x/m",
      "s3:///m",
  };
  for (const std::string& url : refused) {
    try {
      canonical_url(url);
      ADD_FAILURE() << url << " was accepted";
    } catch (const InvalidArgumentError& e) {
      EXPECT_EQ(e.context().file, display_url(url)) << e.what();
      EXPECT_EQ(std::string(e.what()).find("u:p"), std::string::npos) << e.what();  // no credentials shown
    }
  }
  // The fetch takes the same form, and refuses what canonical_url refuses.
  EXPECT_EQ(parse_location("http://H:80/m")->url, "http://h/m");
  EXPECT_THROW(parse_location("http://127.0.0.1:1#@127.0.0.1:2/m"), InvalidArgumentError);
  EXPECT_THROW(parse_location("s3://b@h/m"), InvalidArgumentError);
}

// libcurl's own parse of `url`: the port it connects to ("" for the scheme's default).
std::string curl_port(const std::string& url) {
  CURLU* u = curl_url();
  char* port = nullptr;
  std::string out;
  if (curl_url_set(u, CURLUPART_URL, url.c_str(), CURLU_URLENCODE) == CURLUE_OK &&
      curl_url_get(u, CURLUPART_PORT, &port, CURLU_NO_DEFAULT_PORT) == CURLUE_OK) {
    out = port;
    curl_free(port);
  }
  curl_url_cleanup(u);
  return out;
}

// Seeded random URLs made of the pieces that confuse URL parsers: for every one that libcurl
// parses, display_url names libcurl's host and port, and canonical_url (where it accepts the URL)
// is fetched from that host and port too.
TEST(RemoteUrl, RandomUrlsDisplayAndFetchLibcurlsHost) {
  const char* pieces[] = {"a", "b.example", "127.0.0.1", ":1", ":2", ":80", "@", "#", "?", "/", "\\", "%40", "%23",
                          ":", "[::1]", "u:p", ".", "..", "%2e", " ", "\t", "x", "&", "=", ";"};
  std::mt19937 rng(46);
  int parsed = 0, accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string url = rng() % 2 ? "http://" : "https://";
    for (int n = 1 + static_cast<int>(rng() % 8); n > 0; --n) url += pieces[rng() % std::size(pieces)];
    const std::string host = curl_host(url);
    if (host.empty()) continue;
    ++parsed;
    const std::string port = curl_port(url);
    const std::string authority = url.substr(0, url.find(':')) + "://" + host + (port.empty() ? "" : ":" + port) + "/";
    EXPECT_TRUE(display_url(url).starts_with(authority)) << url << " displays as " << display_url(url);
    try {
      const std::string canonical = canonical_url(url);
      ++accepted;
      EXPECT_EQ(curl_host(canonical), host) << url;
      EXPECT_EQ(curl_port(canonical), port) << url;
      EXPECT_EQ(display_url(canonical), display_url(url)) << url;
    } catch (const InvalidArgumentError&) {
    }
  }
  EXPECT_GT(parsed, 1000);
  EXPECT_GT(accepted, 100);
}

TEST(RemoteUrl, CanonicalHostIsIdna) {
  // libcurl converts with libidn2 from the locale's encoding; where it cannot, it refuses to fetch.
  const std::string saved = std::setlocale(LC_CTYPE, nullptr);
  if (std::setlocale(LC_CTYPE, "C.UTF-8") == nullptr || !(curl_version_info(CURLVERSION_NOW)->features & CURL_VERSION_IDN)) {
    GTEST_SKIP() << "no UTF-8 locale or libcurl without IDN";
  }
  EXPECT_EQ(canonical_url("http://B\xc3\xbc" "cher.example/m"), "http://xn--bcher-kva.example/m");
  EXPECT_EQ(display_url("http://B\xc3\xbc" "cher.example/m?q"), "http://xn--bcher-kva.example/m");
  std::setlocale(LC_CTYPE, "C");
  EXPECT_THROW(canonical_url("http://B\xc3\xbc" "cher.example/m"), InvalidArgumentError);
  std::setlocale(LC_CTYPE, saved.c_str());
}

// Note [Printable text]: every byte a server sends reaches a message as valid UTF-8.
TEST(PrintableText, EscapesWhatIsNotPrintableUtf8) {
  struct Row {
    std::string in, out;
  };
  const Row rows[] = {
      {"plain ASCII", "plain ASCII"},
      {"a\\b", "a\\\\b"},                                    // a backslash is doubled
      {"t\tn\nr\r\x1b[31m\x7f", "t\\x09n\\x0ar\\x0d\\x1b[31m\\x7f"},  // C0 controls, DEL
      {"w\xc3\xbcrfel \xe2\x82\xac \xf0\x9f\x98\x80", "w\xc3\xbcrfel \xe2\x82\xac \xf0\x9f\x98\x80"},  // valid UTF-8 kept
      {"\xc2\x85", "\\xc2\\x85"},                              // C1 control (NEL)
      {"\"abc\xff\"", "\"abc\\xff\""},                          // a stray byte >= 0x80 (defect 2's ETag)
      {"\xc3", "\\xc3"},                                      // a sequence cut short
      {"\xc0\xaf", "\\xc0\\xaf"},                              // overlong
      {"\xe0\x80\xaf", "\\xe0\\x80\\xaf"},                      // overlong
      {"\xed\xa0\x80", "\\xed\\xa0\\x80"},                      // a UTF-16 surrogate
      {"\xf4\x90\x80\x80", "\\xf4\\x90\\x80\\x80"},              // above U+10FFFF
      {std::string("nul\0byte", 8), "nul\\x00byte"},
  };
  for (const Row& row : rows) EXPECT_EQ(printable_text(row.in), row.out) << row.in;
  EXPECT_EQ(printable_text("abcdef", 3), "abc...");
  EXPECT_EQ(printable_text("abc", 3), "abc");
  EXPECT_EQ(printable_text("ab\xc3\xbc", 3), "ab...");  // not cut inside a character
}

TEST(RemoteUrl, EncodesLikeSigV4) {
  EXPECT_EQ(uri_encode("a b/c~d+e", true), "a%20b/c~d%2Be");
  EXPECT_EQ(uri_encode("a/b", false), "a%2Fb");
}

TEST(RemoteUrl, ParsesContentRange) {
  auto r = parse_content_range("bytes 0-7/100");
  ASSERT_TRUE(r);
  EXPECT_TRUE(r->satisfied);
  EXPECT_EQ(r->first, 0u);
  EXPECT_EQ(r->last, 7u);
  EXPECT_EQ(r->total, 100u);
  r = parse_content_range("bytes */0");
  ASSERT_TRUE(r);
  EXPECT_FALSE(r->satisfied);
  EXPECT_EQ(r->total, 0u);
  r = parse_content_range("bytes 5-9/*");
  ASSERT_TRUE(r);
  EXPECT_FALSE(r->total.has_value());
  EXPECT_FALSE(parse_content_range("bytes 9-5/100"));
  EXPECT_FALSE(parse_content_range("bytes 0-100/100"));  // last past the end
  EXPECT_FALSE(parse_content_range("items 0-1/2"));
  EXPECT_FALSE(parse_content_range("bytes 0-x/2"));
}

TEST(RemoteUrl, ParsesListObjectsV2) {
  const char* xml =
      "<?xml version=\"1.0\"?><ListBucketResult><Name>b</Name><Prefix>m/</Prefix>"
      "<Contents><Key>m/a&amp;b.safetensors</Key><Size>123</Size></Contents>"
      "<Contents><Key>m/model_index.json</Key><Size>7</Size></Contents>"
      "<CommonPrefixes><Prefix>m/unet/</Prefix></CommonPrefixes>"
      "<IsTruncated>true</IsTruncated><NextContinuationToken>tok/1</NextContinuationToken></ListBucketResult>";
  ListPage page = parse_list_page(xml);
  ASSERT_EQ(page.objects.size(), 2u);
  EXPECT_EQ(page.objects[0].key, "m/a&b.safetensors");
  EXPECT_EQ(page.objects[0].size, 123u);
  ASSERT_EQ(page.prefixes.size(), 1u);
  EXPECT_EQ(page.prefixes[0], "m/unet/");
  EXPECT_TRUE(page.truncated);
  EXPECT_EQ(page.next_token, "tok/1");
  EXPECT_THROW(parse_list_page("<Error><Code>AccessDenied</Code></Error>"), InvalidFileError);
  EXPECT_THROW(parse_list_page("<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>"),
               InvalidFileError);
  EXPECT_EQ(s3_error_code("<Error><Code>SignatureDoesNotMatch</Code></Error>"), "SignatureDoesNotMatch");
  EXPECT_EQ(s3_error_code("not xml"), "");
}

TEST(RemoteUrl, ParsesIni) {
  Ini ini = parse_ini("# c\n[default]\naws_access_key_id = AK\n AWS_Secret_Access_Key=SK \n; x\n[profile p]\nregion=eu-west-1\n");
  EXPECT_EQ(ini["default"]["aws_access_key_id"], "AK");
  EXPECT_EQ(ini["default"]["aws_secret_access_key"], "SK");
  EXPECT_EQ(ini["profile p"]["region"], "eu-west-1");
}

struct FakeEnv {
  std::map<std::string, std::string> vars;
  std::map<std::string, std::string> files;
  S3Config resolve() const {
    return resolve_s3_config(
        [&](const char* n) -> const char* {
          auto it = vars.find(n);
          return it == vars.end() ? nullptr : it->second.c_str();
        },
        [&](const std::string& f) -> std::optional<std::string> {
          auto it = files.find(f);
          if (it == files.end()) return std::nullopt;
          return it->second;
        });
  }
};

TEST(RemoteUrl, S3ConfigFromEnvironment) {
  FakeEnv e;
  e.vars = {{"AWS_ACCESS_KEY_ID", "AK"}, {"AWS_SECRET_ACCESS_KEY", "SK"}, {"AWS_SESSION_TOKEN", "T"},
            {"AWS_DEFAULT_REGION", "eu-central-1"}, {"AWS_ENDPOINT_URL", "http://127.0.0.1:9000/"},
            {"AWS_ENDPOINT_URL_S3", "http://127.0.0.1:8333"}};
  S3Config c = e.resolve();
  EXPECT_EQ(c.access_key, "AK");
  EXPECT_EQ(c.secret_key, "SK");
  EXPECT_EQ(c.session_token, "T");
  EXPECT_EQ(c.region, "eu-central-1");
  EXPECT_EQ(c.endpoint, "http://127.0.0.1:8333");  // the S3-specific one wins
  EXPECT_TRUE(c.path_style);
  EXPECT_EQ(s3_object_url(c, "bkt", "a b/m.safetensors"), "http://127.0.0.1:8333/bkt/a%20b/m.safetensors");
  EXPECT_EQ(s3_list_url(c, "bkt", "m/", ""), "http://127.0.0.1:8333/bkt?delimiter=%2F&list-type=2&prefix=m%2F");
  EXPECT_EQ(s3_list_url(c, "bkt", "", "t=1"),
            "http://127.0.0.1:8333/bkt?continuation-token=t%3D1&delimiter=%2F&list-type=2&prefix=");
}

TEST(RemoteUrl, S3ConfigFromProfileFiles) {
  FakeEnv e;
  e.vars = {{"HOME", "/h"}, {"AWS_PROFILE", "p"}};
  e.files = {{"/h/.aws/credentials", "[default]\naws_access_key_id=D\naws_secret_access_key=DS\n"
                                      "[p]\naws_access_key_id=PK\naws_secret_access_key=PS\n"},
             {"/h/.aws/config", "[profile p]\nregion = ap-south-1\nendpoint_url = https://oss.example\n"}};
  S3Config c = e.resolve();
  EXPECT_EQ(c.access_key, "PK");
  EXPECT_EQ(c.secret_key, "PS");
  EXPECT_EQ(c.region, "ap-south-1");
  EXPECT_EQ(c.endpoint, "https://oss.example");
}

TEST(RemoteUrl, S3ConfigAnonymousOnAws) {
  FakeEnv e;
  e.vars = {{"AWS_REGION", "us-west-2"}};
  S3Config c = e.resolve();
  EXPECT_TRUE(c.anonymous());
  EXPECT_FALSE(c.path_style);
  EXPECT_EQ(s3_object_url(c, "bkt", "k"), "https://bkt.s3.us-west-2.amazonaws.com/k");
  EXPECT_EQ(s3_list_url(c, "bkt", "p/", ""),
            "https://bkt.s3.us-west-2.amazonaws.com/?delimiter=%2F&list-type=2&prefix=p%2F");
}

TEST(RemoteUrl, HttpDates) {
  EXPECT_EQ(parse_http_date("Thu, 01 Jan 1970 00:00:10 GMT"), 10'000'000'000);
  EXPECT_EQ(parse_http_date("garbage"), 0);
}

TEST(RemoteUrl, SaysWhatIsWrongWithAContentRange) {
  EXPECT_EQ(content_range_problem("bytes 0-7/100"), "");
  EXPECT_EQ(content_range_problem("bytes 9-5/100"), "its last byte is before its first");
  EXPECT_EQ(content_range_problem("bytes 0-100/100"), "its last byte is past the object's 100 bytes");
  EXPECT_EQ(content_range_problem("items 0-1/2"), "its unit is not 'bytes'");
  EXPECT_EQ(content_range_problem("bytes 0-x/2"), "its range is not FIRST-LAST in digits");
  EXPECT_EQ(content_range_problem("bytes 0-1"), "it has no '/TOTAL'");
  EXPECT_EQ(content_range_problem("bytes 0-1/x"), "its total is not a number");
}

// Note [Remote consistency]: which validators tell same-size versions apart.
TEST(RemoteUrl, ClassifiesValidators) {
  const std::int64_t mtime = 0x6565a3f1;  // nginx: "<hex mtime>-<hex size>"
  EXPECT_EQ(classify_validator("\"6565a3f1-200008\"", mtime), Validator::kCoarse);
  EXPECT_EQ(classify_validator("\"6565a3f1-200008\"", 0), Validator::kStrong);  // no Last-Modified to match
  EXPECT_EQ(classify_validator("W/\"abc\"", mtime), Validator::kCoarse);
  EXPECT_EQ(classify_validator("\"1700000000_42\"", 1700000000), Validator::kCoarse);  // decimal seconds
  EXPECT_EQ(classify_validator("\"d41d8cd98f00b204e9800998ecf8427e\"", mtime), Validator::kStrong);  // S3 MD5
  EXPECT_EQ(classify_validator("\"d41d8cd98f00b204e9800998ecf8427e-12\"", mtime), Validator::kStrong);  // multipart
  EXPECT_EQ(classify_validator("\"2a-5e8c3b2c4d1f0\"", mtime), Validator::kStrong);  // Apache: size-mtime in µs
  EXPECT_EQ(classify_validator("", mtime), Validator::kCoarse);  // Last-Modified alone
  EXPECT_EQ(classify_validator("", 0), Validator::kNone);
}

TEST(RemoteUrl, SettlesCoarseValidators) {
  EXPECT_EQ(settle_wait_ms(100, 102), 0);     // the modification second is over
  EXPECT_EQ(settle_wait_ms(100, 500), 0);
  EXPECT_EQ(settle_wait_ms(100, 101), 100);   // just over: a margin for coarse file clocks
  EXPECT_EQ(settle_wait_ms(100, 100), 1100);  // the same second
  EXPECT_EQ(settle_wait_ms(101, 100), 2100);
  EXPECT_EQ(settle_wait_ms(103, 100), std::nullopt);  // far in the future: cannot wait
}

TEST(RemoteUrl, Connections) {
  RemoteOptions o;
  o.connections = 3;
  EXPECT_EQ(effective_connections(o), 3u);
}

}  // namespace
}  // namespace pinload::remote
