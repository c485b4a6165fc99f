#include "pinload/manifest.h"


#include <algorithm>
#include <cctype>
#include <filesystem>
#include <future>
#include <nlohmann/json.hpp>
#include <string>

#include "base/sha256.h"
#include "load/verify.h"
#include "os/read_full.h"
#include "pinload/byte_source.h"
#include "pinload/checkpoint.h"
#include "pinload/error.h"
#include "pinload/remote.h"

namespace pinload {

namespace {

// Ordered: "format" and "version" first, files and tensors in load order, kept across a round trip.
using json = nlohmann::ordered_json;

constexpr const char* kFormat = "pinload.manifest";
constexpr std::size_t kReadBytes = 16u << 20;

bool is_hex_digest(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The deepest folder holding every file ("" where they share none).
std::string common_folder(const std::vector<CheckpointFile>& files) {
  std::string common;
  for (std::size_t i = 0; i < files.size(); ++i) {
    const std::string& p = files[i].path;
    const std::size_t slash = p.rfind('/');
    const std::string dir = slash == std::string::npos ? std::string() : p.substr(0, slash + 1);
    if (i == 0) common = dir;
    while (!common.empty() && dir.compare(0, common.size(), common) != 0) {
      common.pop_back();  // its '/'
      const std::size_t up = common.rfind('/');
      common = up == std::string::npos ? std::string() : common.substr(0, up + 1);
    }
  }
  return common;
}

// Hashes one file's bytes as they are read, in file order: the whole file on
// one thread, the tensors and their pieces on another.
struct FileHashing {
  const Header& header;
  std::uint64_t piece_bytes;
  detail::Sha256 whole;
  std::vector<ManifestTensor> tensors;
  std::vector<detail::Sha256> tensor_ctx;
  detail::Sha256 piece;

  FileHashing(const Header& h, std::uint64_t pb) : header(h), piece_bytes(pb), tensor_ctx(h.tensors.size()) {
    for (const TensorInfo& t : h.tensors) {
      ManifestTensor& m = tensors.emplace_back();
      m.name = t.name;
      m.dtype = t.dtype;
      m.shape = t.shape;
      m.begin = h.data_offset() + t.begin;
      m.end = h.data_offset() + t.end;
    }
  }

  // Bytes [offset, offset + n) of the file.
  void tensors_update(const std::byte* bytes, std::uint64_t offset, std::uint64_t n) {
    const std::uint64_t end = offset + n;
    for (std::size_t k = 0; k < tensors.size(); ++k) {
      ManifestTensor& t = tensors[k];
      if (t.end <= offset || t.begin >= end) continue;
      std::uint64_t a = std::max(t.begin, offset);
      const std::uint64_t b = std::min(t.end, end);
      tensor_ctx[k].update(bytes + (a - offset), b - a);
      const bool several = t.end - t.begin > piece_bytes;
      while (several && a < b) {
        const std::uint64_t piece_end = std::min(t.end, t.begin + ((a - t.begin) / piece_bytes + 1) * piece_bytes);
        const std::uint64_t stop = std::min(piece_end, b);
        piece.update(bytes + (a - offset), stop - a);
        if (stop == piece_end) t.pieces.push_back(piece.final_hex());
        a = stop;
      }
      if (b == t.end) t.sha256 = tensor_ctx[k].final_hex();
    }
  }
};

ManifestFile hash_file(Env* env, const CheckpointFile& cf, const std::string& name, const ManifestOptions& options) {
  ManifestFile out;
  out.name = name;
  out.size = cf.header.file_size;
  out.has_tensors = true;
  out.data_offset = cf.header.data_offset();
  out.metadata = cf.header.metadata;
  const std::unique_ptr<ByteSource> source =  // Note [Byte sources]
      open_byte_source(env, source_file(cf), SourceOptions{});
  FileHashing h(cf.header, options.piece_bytes);
  std::vector<std::byte> buffers[2] = {std::vector<std::byte>(kReadBytes), std::vector<std::byte>(kReadBytes)};
  std::future<void> whole;
  std::uint64_t offset = 0;
  for (int turn = 0; offset < out.size; turn ^= 1) {
    std::vector<std::byte>& buf = buffers[turn];
    const std::uint64_t n = std::min<std::uint64_t>(kReadBytes, out.size - offset);
    source->read(offset, n, buf.data(), n);
    if (whole.valid()) whole.get();  // the other buffer is free again
    if (options.threads > 1) {
      whole = std::async(std::launch::async, [&h, &buf, n] { h.whole.update(buf.data(), n); });
    } else {
      h.whole.update(buf.data(), n);
    }
    h.tensors_update(buf.data(), offset, n);
    if (whole.valid()) whole.get();
    offset += n;
  }
  out.sha256 = h.whole.final_hex();
  for (std::size_t k = 0; k < h.tensors.size(); ++k) {
    if (h.tensors[k].begin == h.tensors[k].end) h.tensors[k].sha256 = h.tensor_ctx[k].final_hex();
  }
  out.tensors = std::move(h.tensors);
  return out;
}

std::uint64_t get_u64(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned()) {
    throw std::runtime_error(where + ": '" + key + "' must be a non-negative integer");
  }
  return it->get<std::uint64_t>();
}

std::string get_digest(const json& j, const std::string& where) {
  if (!j.is_string() || !is_hex_digest(j.get<std::string>())) {
    throw std::runtime_error(where + ": a sha256 must be 64 hex digits");
  }
  return lower(j.get<std::string>());
}

ManifestFile parse_file(const std::string& name, const json& j, std::uint64_t piece_bytes) {
  const std::string where = "file '" + name + "'";
  if (!j.is_object()) throw std::runtime_error(where + " must be an object");
  ManifestFile f;
  f.name = name;
  f.size = get_u64(j, "size", where);
  if (j.contains("sha256")) f.sha256 = get_digest(j["sha256"], where);
  f.has_tensors = j.contains("tensors");
  if (!f.has_tensors) {
    if (f.sha256.empty()) throw std::runtime_error(where + " has neither 'sha256' nor 'tensors'");
    return f;
  }
  f.data_offset = get_u64(j, "data_offset", where);
  if (f.data_offset < kHeaderPrefixSize || f.data_offset > f.size) {
    throw std::runtime_error(where + ": 'data_offset' out of the file");
  }
  if (j.contains("metadata")) {
    if (!j["metadata"].is_object()) throw std::runtime_error(where + ": 'metadata' must be an object");
    for (const auto& [k, v] : j["metadata"].items()) {
      if (!v.is_string()) throw std::runtime_error(where + ": metadata values must be strings");
      f.metadata.emplace_back(k, v.get<std::string>());
    }
  }
  const json& tensors = j["tensors"];
  if (!tensors.is_object()) throw std::runtime_error(where + ": 'tensors' must be an object");
  for (const auto& [tname, t] : tensors.items()) {
    const std::string twhere = where + ", tensor '" + tname + "'";
    if (!t.is_object()) throw std::runtime_error(twhere + " must be an object");
    ManifestTensor m;
    m.name = tname;
    const auto dtype = t.contains("dtype") && t["dtype"].is_string()
                           ? dtype_from_name(t["dtype"].get<std::string>())
                           : std::nullopt;
    if (!dtype) throw std::runtime_error(twhere + ": unknown or missing 'dtype'");
    m.dtype = *dtype;
    if (!t.contains("shape") || !t["shape"].is_array()) throw std::runtime_error(twhere + ": 'shape' must be an array");
    for (const json& d : t["shape"]) {
      if (!d.is_number_unsigned()) throw std::runtime_error(twhere + ": 'shape' must hold non-negative integers");
      m.shape.push_back(d.get<std::uint64_t>());
    }
    const auto range = t.find("range");
    if (range == t.end() || !range->is_array() || range->size() != 2 || !(*range)[0].is_number_unsigned() ||
        !(*range)[1].is_number_unsigned()) {
      throw std::runtime_error(twhere + ": 'range' must be [begin, end]");
    }
    m.begin = (*range)[0].get<std::uint64_t>();
    m.end = (*range)[1].get<std::uint64_t>();
    if (m.begin > m.end || m.end > f.size || m.begin < f.data_offset) {
      throw std::runtime_error(twhere + ": 'range' outside the file's data section");
    }
    if (!t.contains("sha256")) throw std::runtime_error(twhere + ": no 'sha256'");
    m.sha256 = get_digest(t["sha256"], twhere);
    const std::uint64_t pieces = m.end - m.begin > piece_bytes ? (m.end - m.begin + piece_bytes - 1) / piece_bytes : 0;
    if (t.contains("pieces")) {
      if (!t["pieces"].is_array()) throw std::runtime_error(twhere + ": 'pieces' must be an array");
      for (const json& p : t["pieces"]) m.pieces.push_back(get_digest(p, twhere));
    }
    if (m.pieces.size() != pieces) {
      throw std::runtime_error(twhere + ": " + std::to_string(pieces) + " pieces of piece_bytes expected, not " +
                               std::to_string(m.pieces.size()));
    }
    f.tensors.push_back(std::move(m));
  }
  std::sort(f.tensors.begin(), f.tensors.end(),
            [](const ManifestTensor& a, const ManifestTensor& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  std::sort(f.metadata.begin(), f.metadata.end());
  return f;
}

}  // namespace

std::string sha256_hex(const void* bytes, std::size_t size) { return detail::sha256_hex(bytes, size); }

bool detail::file_named(std::string_view path, std::string_view name) noexcept {
  return !name.empty() && (path == name || (path.size() > name.size() && path.ends_with(name) &&
                                            path[path.size() - name.size() - 1] == '/'));
}

const ManifestFile* Manifest::find(std::string_view path) const noexcept {
  const ManifestFile* best = nullptr;
  for (const ManifestFile& f : files) {
    if (detail::file_named(path, f.name) && (best == nullptr || f.name.size() > best->name.size())) best = &f;
  }
  return best;
}

void VerifyOptions::validate() const {
  for (const auto& [name, digest] : file_sha256) {
    if (name.empty()) throw InvalidArgumentError("verify: a sha256 needs the name of its file");
    if (!is_hex_digest(digest)) {
      throw InvalidArgumentError("verify: the sha256 of '" + name + "' must be 64 hex digits, not '" + digest + "'");
    }
  }
}

Manifest make_manifest(const std::vector<std::string>& paths, const ManifestOptions& options, Env* env) {
  if (env == nullptr) env = default_env();
  if (options.piece_bytes < 4096 || options.piece_bytes > (1u << 30)) {
    throw InvalidArgumentError("piece_bytes must be 4K..1G, not " + std::to_string(options.piece_bytes));
  }
  for (const std::string& p : paths) {
    if (is_remote_path(p)) throw InvalidArgumentError("a manifest is made of local files, not '" + p + "'");
  }
  ResolveOptions resolve;
  resolve.variant = options.variant;
  // Each path on its own: unrelated checkpoints (which may share tensor
  // names) can share a manifest.
  Checkpoint checkpoint;
  for (const std::string& p : paths) {
    for (CheckpointFile& f : open_checkpoint(env, {p}, resolve).files) checkpoint.files.push_back(std::move(f));
  }
  const std::string root = common_folder(checkpoint.files);
  Manifest m;
  m.piece_bytes = options.piece_bytes;
  for (const CheckpointFile& cf : checkpoint.files) {
    m.files.push_back(hash_file(env, cf, cf.path.substr(root.size()), options));
  }
  return m;
}

std::string manifest_to_json(const Manifest& manifest) {
  json files = json::object();
  for (const ManifestFile& f : manifest.files) {
    json jf = {{"size", f.size}};
    if (!f.sha256.empty()) jf["sha256"] = f.sha256;
    if (f.has_tensors) {
      jf["data_offset"] = f.data_offset;
      if (!f.metadata.empty()) {
        json meta = json::object();
        for (const auto& [k, v] : f.metadata) meta[k] = v;
        jf["metadata"] = meta;
      }
      json tensors = json::object();
      for (const ManifestTensor& t : f.tensors) {
        json jt = {{"dtype", std::string(dtype_name(t.dtype))},
                   {"shape", t.shape},
                   {"range", {t.begin, t.end}},
                   {"sha256", t.sha256}};
        if (!t.pieces.empty()) jt["pieces"] = t.pieces;
        tensors[t.name] = std::move(jt);
      }
      jf["tensors"] = std::move(tensors);
    }
    files[f.name] = std::move(jf);
  }
  const json j = {{"format", kFormat}, {"version", kManifestVersion}, {"piece_bytes", manifest.piece_bytes},
                  {"files", std::move(files)}};
  return j.dump(1) + "\n";
}

Manifest parse_manifest(std::string_view text, const std::string& source) {
  try {
    const json j = json::parse(text.begin(), text.end());
    if (!j.is_object() || !j.contains("format") || j["format"] != kFormat) {
      throw std::runtime_error(std::string("not a manifest (no \"format\": \"") + kFormat + "\")");
    }
    const std::uint64_t version = get_u64(j, "version", "the manifest");
    if (version != kManifestVersion) {
      throw std::runtime_error("manifest version " + std::to_string(version) + " is not supported (this pinload reads " +
                               std::to_string(kManifestVersion) + ")");
    }
    Manifest m;
    m.piece_bytes = get_u64(j, "piece_bytes", "the manifest");
    if (m.piece_bytes < 4096 || m.piece_bytes > (1u << 30)) throw std::runtime_error("'piece_bytes' must be 4K..1G");
    if (!j.contains("files") || !j["files"].is_object()) throw std::runtime_error("'files' must be an object");
    for (const auto& [name, f] : j["files"].items()) {
      if (name.empty()) throw std::runtime_error("a file with an empty name");
      m.files.push_back(parse_file(name, f, m.piece_bytes));
    }
    return m;
  } catch (const json::exception& e) {
    throw InvalidFileError(std::string("not a manifest: ") + e.what(), ErrorContext{source});
  } catch (const std::runtime_error& e) {
    if (dynamic_cast<const Error*>(&e) != nullptr) throw;
    throw InvalidFileError(e.what(), ErrorContext{source});
  }
}

void save_manifest(const Manifest& manifest, const std::string& file, Env* env) {
  const std::string text = manifest_to_json(manifest);
  write_file_atomically(env != nullptr ? env : default_env(), file, text.data(), text.size());
}

Manifest load_manifest(const std::string& file, Env* env) {
  if (env == nullptr) env = default_env();
  ScopedFd fd = open_or_throw(env, file);
  const FileStat st = stat_or_throw(env, fd.get(), file);
  if (st.size > (std::uint64_t{1} << 32)) throw InvalidFileError("a manifest larger than 4 GiB", ErrorContext{file});
  std::string text(st.size, '\0');
  const ReadResult r = read_full(env, fd.get(), text.data(), st.size, 0);
  if (r.error != 0) throw_os_error("read", r.error, ErrorContext{file});
  text.resize(r.bytes);
  return parse_manifest(text, file);
}

}  // namespace pinload
