#include "pinload/io_template.h"

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "base/log.h"
#include "pinload/checkpoint.h"
#include "pinload/error.h"

namespace pinload {

namespace {

constexpr char kMagic[8] = {'P', 'L', 'T', 'M', 'P', 'L', '\0', '\1'};
constexpr std::size_t kFixedHead = 8 + 4 + 8;  // magic, version, payload size
constexpr std::uint64_t kMaxString = 1u << 16;  // paths, prefixes, device names

std::uint64_t fnv1a(std::span<const std::uint8_t> bytes) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::uint8_t b : bytes) {
    h ^= b;
    h *= 0x100000001b3ull;
  }
  return h;
}

class Writer {
 public:
  void raw(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  template <typename T>
  void num(T v) {
    for (std::size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<std::uint8_t>(static_cast<std::uint64_t>(v) >> (8 * i)));
  }
  void str(const std::string& s) {
    num<std::uint32_t>(static_cast<std::uint32_t>(s.size()));
    raw(s.data(), s.size());
  }
  std::vector<std::uint8_t> out;
};

// Reads from a span; every call checks the bytes left first. A failed read
// sets `bad` and returns zeros, so parsing code checks once per record.
class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> b) : bytes_(b) {}
  template <typename T>
  T num() {
    if (left() < sizeof(T)) return fail<T>("ends inside a number");
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<std::uint64_t>(bytes_[at_ + i]) << (8 * i);
    at_ += sizeof(T);
    return static_cast<T>(v);
  }
  std::string str() {
    const std::uint32_t n = num<std::uint32_t>();
    if (n > kMaxString || n > left()) return fail<std::string>("a string longer than the bytes left");
    std::string s(reinterpret_cast<const char*>(bytes_.data() + at_), n);
    at_ += n;
    return s;
  }
  std::size_t left() const { return bytes_.size() - at_; }
  template <typename T>
  T fail(const char* why) {
    if (why_.empty()) why_ = why;
    return T{};
  }
  bool bad() const { return !why_.empty(); }
  const std::string& why() const { return why_; }

 private:
  std::span<const std::uint8_t> bytes_;
  std::size_t at_ = 0;
  std::string why_;
};

std::optional<IoTemplate> reject(std::string* why, std::string reason) {
  if (why) *why = std::move(reason);
  return std::nullopt;
}

}  // namespace

const TemplateReads* IoTemplate::find(std::string_view destination) const {
  for (const TemplateReads& d : destinations) {
    if (d.destination == destination) return &d;
  }
  return nullptr;
}

void IoTemplate::set(TemplateReads reads) {
  for (TemplateReads& d : destinations) {
    if (d.destination == reads.destination) {
      d = std::move(reads);
      return;
    }
  }
  destinations.push_back(std::move(reads));
}

IoTemplate template_files_of(const Checkpoint& checkpoint) {
  IoTemplate t;
  for (const CheckpointFile& f : checkpoint.files) {
    t.files.push_back(TemplateFile{f.path, f.name_prefix, f.stat.size, f.stat.mtime_ns, f.stat.inode, f.stat.device});
  }
  return t;
}

std::vector<std::uint8_t> serialize_template(const IoTemplate& t) {
  Writer body;
  body.num<std::uint32_t>(static_cast<std::uint32_t>(t.files.size()));
  for (const TemplateFile& f : t.files) {
    body.str(f.path);
    body.str(f.name_prefix);
    body.num<std::uint64_t>(f.size);
    body.num<std::int64_t>(f.mtime_ns);
    body.num<std::uint64_t>(f.inode);
    body.num<std::uint64_t>(f.device);
  }
  // Note [Template versions]: version 1 unless there are readers to name.
  const std::uint32_t version = t.readers.empty() ? 1 : 2;
  if (version == 2) {
    body.num<std::uint32_t>(static_cast<std::uint32_t>(t.readers.size()));
    for (const TemplateReader& r : t.readers) {
      body.num<std::uint32_t>(r.pid);
      body.str(r.comm);
      body.str(r.exe);
    }
  }
  body.num<std::uint32_t>(static_cast<std::uint32_t>(t.destinations.size()));
  for (const TemplateReads& d : t.destinations) {
    body.str(d.destination);
    body.num<std::uint64_t>(d.reads.size());
    for (const TemplateRead& r : d.reads) {
      body.num<std::uint32_t>(r.file);
      body.num<std::uint64_t>(r.offset);
      body.num<std::uint64_t>(r.length);
      if (version == 2) body.num<std::uint32_t>(r.reader);
    }
  }
  Writer w;
  w.raw(kMagic, sizeof kMagic);
  w.num<std::uint32_t>(version);
  w.num<std::uint64_t>(body.out.size());
  w.raw(body.out.data(), body.out.size());
  w.num<std::uint64_t>(fnv1a(w.out));
  return std::move(w.out);
}

std::optional<IoTemplate> parse_template(std::span<const std::uint8_t> bytes, std::string* why) {
  if (bytes.size() < kFixedHead + 8) return reject(why, "shorter than a template's fixed fields");
  if (std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) return reject(why, "not a pinload template (magic)");
  Reader head(bytes.subspan(8, 12));
  const auto version = head.num<std::uint32_t>();
  if (version != 1 && version != 2) {
    return reject(why, "version " + std::to_string(version) + ", expected 1 or " + std::to_string(kTemplateVersion));
  }
  const auto payload = head.num<std::uint64_t>();
  if (payload != bytes.size() - kFixedHead - 8) return reject(why, "payload size disagrees with the file size");
  Reader tail(bytes.subspan(bytes.size() - 8));
  if (tail.num<std::uint64_t>() != fnv1a(bytes.first(bytes.size() - 8))) return reject(why, "checksum mismatch");

  Reader in(bytes.subspan(kFixedHead, payload));
  IoTemplate t;
  const auto file_count = in.num<std::uint32_t>();
  if (in.bad()) return reject(why, in.why());
  // Each file takes at least 40 bytes: never reserve more than could follow.
  if (file_count > in.left() / 40) return reject(why, "more files than bytes to describe them");
  t.files.resize(file_count);
  for (TemplateFile& f : t.files) {
    f.path = in.str();
    f.name_prefix = in.str();
    f.size = in.num<std::uint64_t>();
    f.mtime_ns = in.num<std::int64_t>();
    f.inode = in.num<std::uint64_t>();
    f.device = in.num<std::uint64_t>();
    if (in.bad()) return reject(why, in.why());
    if (f.path.empty()) return reject(why, "a file with an empty path");
    // Keeps offset arithmetic below far from overflow.
    if (f.size > kTemplateMaxFileSize) return reject(why, "a file of " + std::to_string(f.size) + " bytes");
  }
  if (version == 2) {
    const auto reader_count = in.num<std::uint32_t>();
    if (in.bad()) return reject(why, in.why());
    // Note [Template versions]: version 2 is written only with readers.
    if (reader_count == 0) return reject(why, "version 2 without readers (written as version 1)");
    // Each reader takes at least 12 bytes.
    if (reader_count > in.left() / 12) return reject(why, "more readers than bytes to describe them");
    t.readers.resize(reader_count);
    for (TemplateReader& r : t.readers) {
      r.pid = in.num<std::uint32_t>();
      r.comm = in.str();
      r.exe = in.str();
      if (in.bad()) return reject(why, in.why());
    }
  }
  const std::size_t read_bytes = version == 2 ? 24 : 20;
  const auto dest_count = in.num<std::uint32_t>();
  if (in.bad()) return reject(why, in.why());
  if (dest_count > in.left() / 12) return reject(why, "more destinations than bytes to describe them");
  for (std::uint32_t i = 0; i < dest_count; ++i) {
    TemplateReads d;
    d.destination = in.str();
    const auto read_count = in.num<std::uint64_t>();
    if (in.bad()) return reject(why, in.why());
    if (read_count > in.left() / read_bytes) return reject(why, "more reads than bytes to describe them");
    if (t.find(d.destination) != nullptr) return reject(why, "destination \"" + d.destination + "\" twice");
    d.reads.resize(read_count);
    for (TemplateRead& r : d.reads) {
      r.file = in.num<std::uint32_t>();
      r.offset = in.num<std::uint64_t>();
      r.length = in.num<std::uint64_t>();
      if (version == 2) r.reader = in.num<std::uint32_t>();
      if (in.bad()) return reject(why, in.why());
      if (r.reader != kNoReader && r.reader >= t.readers.size()) {
        return reject(why, "a read by reader " + std::to_string(r.reader) + " of " + std::to_string(t.readers.size()));
      }
      if (r.file >= t.files.size()) return reject(why, "a read of file " + std::to_string(r.file) + " of " + std::to_string(t.files.size()));
      const std::uint64_t size = t.files[r.file].size;
      if (r.length == 0 || r.offset >= size || r.length > size + kTemplateMaxAlign - r.offset) {
        return reject(why, "a read [" + std::to_string(r.offset) + ", +" + std::to_string(r.length) +
                               ") outside its " + std::to_string(size) + "-byte file");
      }
    }
    t.destinations.push_back(std::move(d));
  }
  if (in.left() != 0) return reject(why, "trailing bytes after the last destination");
  return t;
}

std::string default_template_dir() {
  if (const char* dir = std::getenv("PINLOAD_CACHE_DIR"); dir != nullptr && *dir != '\0') {
    return (std::filesystem::path(dir) / "templates").string();
  }
  const char* home = std::getenv("HOME");
  return (std::filesystem::path(home != nullptr && *home != '\0' ? home : "/tmp") / ".cache" / "pinload" / "templates")
      .string();
}

std::string template_path(const std::vector<std::string>& paths, const std::string& dir) {
  std::string key;
  for (const std::string& p : paths) {
    std::error_code ec;
    std::filesystem::path abs = std::filesystem::absolute(p, ec);
    key += (ec ? std::filesystem::path(p) : abs.lexically_normal()).string();
    key.push_back('\0');
  }
  const std::uint64_t h = fnv1a({reinterpret_cast<const std::uint8_t*>(key.data()), key.size()});
  char name[32];
  std::snprintf(name, sizeof name, "%016llx.pltemplate", static_cast<unsigned long long>(h));
  return (std::filesystem::path(dir.empty() ? default_template_dir() : dir) / name).string();
}

void save_template(const IoTemplate& t, const std::string& file, Env* env) {
  if (env == nullptr) env = default_env();
  const std::vector<std::uint8_t> bytes = serialize_template(t);
  const std::filesystem::path path(file);
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  if (ec) throw IoError("cannot create the template folder: " + ec.message(), ErrorContext{file});
  write_file_atomically(env, file, bytes.data(), bytes.size());
}

std::optional<IoTemplate> load_template(const std::string& file, Env* env) {
  if (env == nullptr) env = default_env();
  std::vector<std::uint8_t> bytes;
  try {
    ScopedFd fd = open_or_throw(env, file);
    const FileStat st = stat_or_throw(env, fd.get(), file);
    if (st.size > (1u << 30)) {
      log::warn("{}: ignoring the I/O template: {} bytes is too large for one", file, st.size);
      return std::nullopt;
    }
    bytes.resize(st.size);
    pread_exact(env, fd.get(), bytes.data(), bytes.size(), 0, file);
  } catch (const NotFoundError&) {
    log::debug("{}: no I/O template yet", file);
    return std::nullopt;
  } catch (const Error& e) {
    log::warn("{}: ignoring the I/O template: {}", file, e.what());
    return std::nullopt;
  }
  std::string why;
  std::optional<IoTemplate> t = parse_template(bytes, &why);
  if (!t) {
    log::warn("{}: ignoring the I/O template: {}", file, why);
    return std::nullopt;
  }
  for (const TemplateFile& f : t->files) {
    const int fd = env->open_read(f.path, 0);
    if (fd < 0) {
      log::warn("{}: ignoring the I/O template: {} cannot be opened ({})", file, f.path, std::strerror(-fd));
      return std::nullopt;
    }
    FileStat st;
    const int rc = env->stat(fd, &st);
    env->close(fd);
    if (rc < 0 || FileIdentity::of(st) != f.identity()) {
      log::warn("{}: ignoring the I/O template: {} changed since it was recorded", file, f.path);
      return std::nullopt;
    }
  }
  return t;
}

}  // namespace pinload
