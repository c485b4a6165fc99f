// convert_checkpoint (convert.h): FP8 copies in ComfyUI's layout, written
// atomically (Note [Converted file layout]).
#include "pinload/convert.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <unordered_map>

#include "base/log.h"
#include "base/parallel_for.h"
#include "format/dtype_convert.h"
#include "pinload/byte_source.h"
#include "pinload/error.h"
#include "source/sources.h"

namespace pinload {
namespace fs = std::filesystem;

namespace {

constexpr std::uint64_t kDataAlignment = 4096;  // Note [Converted file layout]
// Files of a folder copied beside the converted weights: configs and
// tokenizers, not other weight formats.
constexpr std::uint64_t kMaxCopiedFileBytes = 64u << 20;

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string fp8_format_name(DType to) { return to == DType::kF8_E5M2 ? "float8_e5m2" : "float8_e4m3fn"; }

// The largest power of two dividing n, at most kDataAlignment.
std::uint64_t size_alignment(std::uint64_t n) {
  if (n == 0) return kDataAlignment;
  return std::min<std::uint64_t>(n & (~n + 1), kDataAlignment);
}

// A file or folder at `path` removed when the guard goes, unless committed.
class TempPath {
 public:
  explicit TempPath(fs::path path) : path_(std::move(path)) {}
  ~TempPath() {
    if (!committed_) {
      std::error_code ec;
      fs::remove_all(path_, ec);
    }
  }
  TempPath(const TempPath&) = delete;
  TempPath& operator=(const TempPath&) = delete;
  const fs::path& path() const { return path_; }
  void commit() { committed_ = true; }

 private:
  fs::path path_;
  bool committed_ = false;
};

// The temporary name for `target`, next to it; stale ones of crashed runs
// are removed.
fs::path temp_for(const fs::path& target) {
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string prefix = "." + target.filename().string() + ".pinload-tmp-";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0) {
      std::error_code rm;
      fs::remove_all(entry.path(), rm);
    }
  }
  return dir / (prefix + std::to_string(::getpid()));
}

// An output file written through the Env's write half (the caller's
// TempPath removes it if the conversion fails).
class OutFile {
 public:
  OutFile(Env* env, const fs::path& path) : env_(env), path_(path.string()) {
    const int fd = env_->open_write(path_, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) throw_os_error("cannot create", -fd, ErrorContext{path_});
    fd_ = ScopedFd(env_, fd);
  }

  // Thread-safe: pwrite at an offset.
  void write(const void* data, std::size_t bytes, std::uint64_t offset) const {
    pwrite_exact(env_, fd_.get(), data, bytes, offset, path_);
  }
  void finish(std::uint64_t size) {
    if (const int rc = env_->truncate(fd_.get(), size); rc != 0) throw_os_error("ftruncate failed", -rc, ErrorContext{path_});
    if (const int rc = env_->sync(fd_.get()); rc != 0) throw_os_error("fsync failed", -rc, ErrorContext{path_});
    if (const int rc = env_->close(fd_.release()); rc != 0) throw_os_error("close failed", -rc, ErrorContext{path_});
  }

 private:
  Env* env_;
  std::string path_;
  ScopedFd fd_;
};

// One tensor of an output file.
struct OutTensor {
  enum Kind { kCopy, kQuantized, kScale, kMarker };
  std::string name;
  DType dtype;
  std::vector<std::uint64_t> shape;
  std::uint64_t nbytes = 0;
  std::uint64_t offset = 0;  // in the data section
  Kind kind = kCopy;
  std::size_t source = 0;    // kCopy, kQuantized: index into the source header's tensors
  std::size_t scale = 0;     // kQuantized: index of its kScale tensor
  std::string marker;        // kMarker: the JSON bytes
};

struct FilePlan {
  std::vector<OutTensor> tensors;
  std::string header;  // 8-byte length + padded JSON
  std::uint64_t file_size = 0;
  std::vector<std::string> quantized_names;  // source names of quantised weights
};

FilePlan plan_file(const CheckpointFile& cf, const ConvertOptions& options) {
  FilePlan plan;
  nlohmann::ordered_json layers = nlohmann::ordered_json::object();
  const std::string format = fp8_format_name(options.to);
  const auto& src = cf.header.tensors;
  for (std::size_t i = 0; i < src.size(); ++i) {
    const TensorInfo& t = src[i];
    if (!quantizes(t, options.keep)) {
      plan.tensors.push_back({t.name, t.dtype, t.shape, t.nbytes(), 0, OutTensor::kCopy, i, 0, {}});
      continue;
    }
    const std::string layer = t.name.substr(0, t.name.size() - std::string_view(".weight").size());
    plan.quantized_names.push_back(t.name);
    const std::size_t weight = plan.tensors.size();
    plan.tensors.push_back({t.name, options.to, t.shape, t.numel(), 0, OutTensor::kQuantized, i, weight + 1, {}});
    std::vector<std::uint64_t> scale_shape;
    if (options.scale == ScaleMode::kPerRow) scale_shape = {t.shape[0], 1};
    const std::uint64_t scale_bytes = options.scale == ScaleMode::kPerRow ? t.shape[0] * 4 : 4;
    plan.tensors.push_back({layer + ".weight_scale", DType::kF32, scale_shape, scale_bytes, 0, OutTensor::kScale, i, 0, {}});
    const std::string marker = nlohmann::json{{"format", format}}.dump();
    plan.tensors.push_back({layer + ".comfy_quant", DType::kU8, {marker.size()}, marker.size(), 0, OutTensor::kMarker, i,
                            0, marker});
    layers[layer] = {{"format", format}};
  }
  // Note [Converted file layout]: by decreasing size alignment, stable.
  std::vector<std::size_t> order(plan.tensors.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return size_alignment(plan.tensors[a].nbytes) > size_alignment(plan.tensors[b].nbytes);
  });
  std::uint64_t at = 0;
  for (std::size_t i : order) {
    plan.tensors[i].offset = at;
    at += plan.tensors[i].nbytes;
  }
  nlohmann::ordered_json json = nlohmann::ordered_json::object();
  nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
  for (const auto& [k, v] : cf.header.metadata) metadata[k] = v;
  if (!layers.empty()) {
    metadata["_quantization_metadata"] = nlohmann::ordered_json{{"format_version", "1.0"}, {"layers", layers}}.dump();
  }
  if (!metadata.empty()) json["__metadata__"] = metadata;
  for (std::size_t i : order) {
    const OutTensor& t = plan.tensors[i];
    json[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                    {"shape", t.shape},
                    {"data_offsets", {t.offset, t.offset + t.nbytes}}};
  }
  std::string text = json.dump();
  const std::uint64_t unpadded = 8 + text.size();
  text.append((kDataAlignment - unpadded % kDataAlignment) % kDataAlignment, ' ');
  const std::uint64_t n = text.size();
  plan.header.resize(8);
  for (int b = 0; b < 8; ++b) plan.header[b] = static_cast<char>((n >> (8 * b)) & 0xFF);
  plan.header += text;
  plan.file_size = plan.header.size() + at;
  return plan;
}

// Note [Infinite weights]: a scale is the largest magnitude over the FP8
// maximum, so one infinite element makes it infinite and every dequantised
// value of the tensor non-finite. FP8 cannot hold the tensor: the conversion
// fails naming it, and --keep keeps it as stored. NaN is representable and
// passes through (abs_max ignores it).
std::uint64_t first_infinite(DType dtype, const std::byte* data, std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; ++i) {
    if (dtype == DType::kF32) {
      std::uint32_t x;
      std::memcpy(&x, data + i * 4, 4);
      if ((x & 0x7fffffffu) == 0x7f800000u) return i;
    } else {
      std::uint16_t x;
      std::memcpy(&x, data + i * 2, 2);
      const std::uint16_t exp_mask = dtype == DType::kBF16 ? 0x7f80 : 0x7c00;
      if ((x & 0x7fff) == exp_mask) return i;
    }
  }
  return n;
}

[[noreturn]] void throw_infinite(const CheckpointFile& cf, const TensorInfo& t, std::uint64_t element, DType to) {
  const std::uint64_t esize = dtype_bits(t.dtype) / 8;
  const std::uint64_t at = cf.header.data_offset() + t.begin + element * esize;
  throw InvalidFileError("element " + std::to_string(element) + " is infinite: " + fp8_format_name(to) +
                             " with a finite scale cannot hold this tensor; keep it as stored with --keep " + t.name,
                         ErrorContext{cf.path, t.name, at, at + esize});
}

void write_file(Env* env, const CheckpointFile& cf, const FilePlan& plan, const fs::path& out_path,
                const ConvertOptions& options) {
  // The input's bytes come through its source (Note [Byte sources]).
  const std::unique_ptr<ByteSource> in =
      open_byte_source(env, source_file(cf), SourceOptions{});
  OutFile out(env, out_path);
  out.write(plan.header.data(), plan.header.size(), 0);
  const std::uint64_t in_base = cf.header.data_offset();
  const std::uint64_t out_base = plan.header.size();
  const std::size_t piece = std::max<std::size_t>(options.piece_bytes, 4096);
  // Work items: the copied and quantised tensors (scales and markers are
  // written with their weight).
  std::vector<std::size_t> items;
  for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
    if (plan.tensors[i].kind == OutTensor::kCopy || plan.tensors[i].kind == OutTensor::kQuantized) items.push_back(i);
  }
  const float max = fp8_max(options.to);
  const auto read_piece = [&](void* dst, std::size_t bytes, std::uint64_t offset) {
    if (options.stop != nullptr && options.stop->load(std::memory_order_relaxed)) {
      throw CancelledError("conversion interrupted", ErrorContext{cf.path});
    }
    in->read(offset, bytes, static_cast<std::byte*>(dst), bytes);
  };
  detail::parallel_for(items.size(), options.threads, [&](std::size_t k) {
    const OutTensor& o = plan.tensors[items[k]];
    const TensorInfo& t = cf.header.tensors[o.source];
    std::vector<std::byte> buffer(std::min<std::uint64_t>(piece, std::max<std::uint64_t>(t.nbytes(), 1)));
    if (o.kind == OutTensor::kCopy) {
      for (std::uint64_t at = 0; at < t.nbytes(); at += buffer.size()) {
        const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), t.nbytes() - at));
        read_piece(buffer.data(), n, in_base + t.begin + at);
        out.write(buffer.data(), n, out_base + o.offset + at);
      }
    } else {
      const unsigned esize = dtype_bits(t.dtype) / 8;
      const std::uint64_t numel = t.numel();
      const std::uint64_t rows = t.shape[0];
      const std::uint64_t cols = t.shape[1];
      const std::uint64_t piece_elems = std::max<std::uint64_t>(buffer.size() / esize, 1);
      const bool per_row = options.scale == ScaleMode::kPerRow;
      std::vector<float> amax(per_row ? rows : 1, 0.0f);
      // Pass 1: the absolute maxima.
      for (std::uint64_t e = 0; e < numel; e += piece_elems) {
        const std::uint64_t n = std::min(piece_elems, numel - e);
        read_piece(buffer.data(), n * esize, in_base + t.begin + e * esize);
        if (!per_row) {
          amax[0] = std::max(amax[0], abs_max(t.dtype, buffer.data(), n));
        } else {
          for (std::uint64_t d = 0; d < n;) {
            const std::uint64_t row = (e + d) / cols;
            const std::uint64_t len = std::min(n - d, (row + 1) * cols - (e + d));
            amax[row] = std::max(amax[row], abs_max(t.dtype, buffer.data() + d * esize, len));
            d += len;
          }
        }
        if (std::isinf(*std::max_element(amax.begin(), amax.end()))) {
          throw_infinite(cf, t, e + first_infinite(t.dtype, buffer.data(), n), options.to);
        }
      }
      std::vector<float> scales(amax.size());
      for (std::size_t r = 0; r < amax.size(); ++r) scales[r] = amax[r] > 0.0f ? amax[r] / max : 1.0f;
      // Pass 2: quantise.
      std::vector<std::uint8_t> q(static_cast<std::size_t>(piece_elems));
      for (std::uint64_t e = 0; e < numel; e += piece_elems) {
        const std::uint64_t n = std::min(piece_elems, numel - e);
        read_piece(buffer.data(), n * esize, in_base + t.begin + e * esize);
        quantize_elements(t.dtype, options.to, buffer.data(), q.data(), n, scales[0],
                          per_row ? scales.data() : nullptr, per_row ? cols : 0, e);
        out.write(q.data(), n, out_base + o.offset + e);
      }
      const OutTensor& s = plan.tensors[o.scale];
      out.write(scales.data(), scales.size() * 4, out_base + s.offset);
      const OutTensor& m = plan.tensors[o.scale + 1];
      out.write(m.marker.data(), m.marker.size(), out_base + m.offset);
    }
    if (options.after_tensor) options.after_tensor(t.name);
  });
  out.finish(plan.file_size);
}

// Best effort: a folder's entries reach the disk (a failure here loses no data
// of a file already synced).
void sync_dir(Env* env, const fs::path& dir) {
  const int fd = env->open_read(dir.string(), O_DIRECTORY);
  if (fd >= 0) {
    env->sync(fd);
    env->close(fd);
  }
}

// Rewrites an index: scale and marker entries beside each quantised weight,
// total_size from the written shards.
void write_index(Env* env, const std::string& index_path, const fs::path& out_path,
                 const std::unordered_map<std::string, std::set<std::string>>& quantized_by_shard,
                 const std::unordered_map<std::string, std::uint64_t>& data_bytes_by_shard) {
  const std::unique_ptr<detail::LocalFileSource> source = detail::open_local_file(env, index_path);
  std::string text(source->stat().size, '\0');
  source->read(0, text.size(), reinterpret_cast<std::byte*>(text.data()), text.size());
  nlohmann::ordered_json index = nlohmann::ordered_json::parse(text, nullptr, false);
  if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    throw InvalidFileError("not a safetensors index (no weight_map object)", ErrorContext{index_path});
  }
  nlohmann::ordered_json& map = index["weight_map"];
  nlohmann::ordered_json added = nlohmann::ordered_json::object();
  std::set<std::string> shards;
  for (auto it = map.begin(); it != map.end(); ++it) {
    if (!it.value().is_string()) continue;
    const std::string shard = it.value().get<std::string>();
    shards.insert(shard);
    auto q = quantized_by_shard.find(shard);
    if (q == quantized_by_shard.end() || !q->second.contains(it.key())) continue;
    const std::string layer = it.key().substr(0, it.key().size() - std::string_view(".weight").size());
    added[layer + ".weight_scale"] = shard;
    added[layer + ".comfy_quant"] = shard;
  }
  for (auto it = added.begin(); it != added.end(); ++it) map[it.key()] = it.value();
  std::uint64_t total = 0;
  for (const std::string& s : shards) {
    if (auto d = data_bytes_by_shard.find(s); d != data_bytes_by_shard.end()) total += d->second;
  }
  if (!index.contains("metadata") || !index["metadata"].is_object()) index["metadata"] = nlohmann::ordered_json::object();
  index["metadata"]["total_size"] = total;
  const std::string out_text = index.dump(2) + "\n";
  OutFile out(env, out_path);
  out.write(out_text.data(), out_text.size(), 0);
  out.finish(out_text.size());
}

bool has_glob(const std::string& p) { return p.find_first_of("*?[") != std::string::npos; }

}  // namespace

bool keep_pattern_matches(const std::string& pattern, const std::string& name) {
  if (pattern.empty()) return false;
  if (has_glob(pattern)) return ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
  for (std::size_t at = name.find(pattern); at != std::string::npos; at = name.find(pattern, at + 1)) {
    const std::size_t end = at + pattern.size();
    const bool starts = at == 0 || name[at - 1] == '.' || name[at - 1] == '/';
    const bool ends = end == name.size() || name[end] == '.';
    if (starts && ends) return true;
  }
  return false;
}

bool quantizes(const TensorInfo& t, const std::vector<std::string>& keep) {
  if (t.shape.size() != 2 || t.numel() == 0) return false;
  if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16) return false;
  if (!ends_with(t.name, ".weight")) return false;
  // A dotted part naming a norm or an embedding.
  std::size_t begin = 0;
  for (;;) {
    const std::size_t end = t.name.find('.', begin);
    const std::string part = t.name.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    if (part.find("norm") != std::string::npos || part.find("embed") != std::string::npos) return false;
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return std::none_of(keep.begin(), keep.end(), [&](const std::string& p) { return keep_pattern_matches(p, t.name); });
}

ConvertStats convert_checkpoint(const std::string& input, const std::string& output, const ConvertOptions& options,
                                Env* env) {
  if (env == nullptr) env = default_env();
  if (options.to != DType::kF8_E4M3 && options.to != DType::kF8_E5M2) {
    throw InvalidFileError("convert writes F8_E4M3 or F8_E5M2, not " + std::string(dtype_name(options.to)));
  }
  std::error_code ec;
  const fs::path in_path(input);
  const fs::path out_path(output);
  if (fs::exists(out_path, ec) && fs::equivalent(in_path, out_path, ec)) {
    throw InvalidFileError("the output is the input", ErrorContext{output});
  }
  const Checkpoint checkpoint = open_checkpoint(env, {input}, options.resolve);
  const bool single_file = fs::is_regular_file(in_path) && ends_with(input, ".safetensors");
  fs::path root;
  if (!single_file) {
    root = fs::is_directory(in_path) ? in_path : in_path.parent_path();
    if (root.empty()) root = ".";
    if (fs::exists(out_path, ec)) throw InvalidFileError("output folder exists already", ErrorContext{output});
  }
  TempPath temp(temp_for(out_path));
  if (!single_file) fs::create_directories(temp.path());

  ConvertStats stats;
  std::unordered_map<std::string, std::set<std::string>> quantized_by_shard;   // shard path (abs) -> names
  std::unordered_map<std::string, std::uint64_t> data_bytes_by_shard;          // shard path (abs) -> bytes
  std::set<std::string> written;  // relative paths written (folders)
  for (const CheckpointFile& cf : checkpoint.files) {
    fs::path target = temp.path();
    if (!single_file) {
      const fs::path rel = fs::relative(fs::path(cf.path), root);
      target = temp.path() / rel;
      fs::create_directories(target.parent_path());
      written.insert(rel.string());
    }
    const FilePlan plan = plan_file(cf, options);
    log::debug("{}: {} tensors quantised, writing {} bytes", cf.path, plan.quantized_names.size(), plan.file_size);
    write_file(env, cf, plan, target, options);
    stats.files++;
    stats.tensors_quantized += plan.quantized_names.size();
    stats.tensors_kept += cf.header.tensors.size() - plan.quantized_names.size();
    stats.bytes_in += cf.header.file_size;
    stats.bytes_out += plan.file_size;
    const std::string key = fs::weakly_canonical(cf.path).string();
    quantized_by_shard[key].insert(plan.quantized_names.begin(), plan.quantized_names.end());
    data_bytes_by_shard[key] = plan.file_size - plan.header.size();
  }
  if (!single_file) {
    for (const std::string& index_path : checkpoint.index_files) {
      const fs::path index_dir = fs::path(index_path).parent_path();
      // The index names shards relative to its folder.
      std::unordered_map<std::string, std::set<std::string>> q;
      std::unordered_map<std::string, std::uint64_t> d;
      for (const auto& [abs, names] : quantized_by_shard) {
        const std::string rel = fs::relative(abs, fs::weakly_canonical(index_dir)).string();
        q[rel] = names;
        d[rel] = data_bytes_by_shard[abs];
      }
      const fs::path rel = fs::relative(fs::path(index_path), root);
      fs::create_directories((temp.path() / rel).parent_path());
      write_index(env, index_path, temp.path() / rel, q, d);
      written.insert(rel.string());
    }
    // The folder's other small files: configs, tokenizers.
    for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator(); ++it) {
      const fs::path& p = it->path();
      const std::string rel = fs::relative(p, root).string();
      if (p.filename().string().find(".pinload-tmp-") != std::string::npos) {
        if (it->is_directory()) it.disable_recursion_pending();
        continue;
      }
      if (!it->is_regular_file() || written.contains(rel)) continue;
      const std::string name = p.filename().string();
      if (ends_with(name, ".safetensors") || name.find(".safetensors.index") != std::string::npos) continue;
      if (it->file_size() > kMaxCopiedFileBytes) {
        log::warn("{}: not copied to the converted folder ({} bytes: not a config)", p.string(), it->file_size());
        continue;
      }
      fs::create_directories((temp.path() / rel).parent_path());
      fs::copy_file(p, temp.path() / rel, fs::copy_options::overwrite_existing);
    }
    for (auto it = fs::recursive_directory_iterator(temp.path()); it != fs::recursive_directory_iterator(); ++it) {
      if (it->is_directory()) sync_dir(env, it->path());
    }
    sync_dir(env, temp.path());
  }
  if (const int rc = env->rename(temp.path().string(), out_path.string()); rc != 0) {
    throw_os_error("cannot rename " + temp.path().string() + " to the output", -rc, ErrorContext{output});
  }
  temp.commit();
  sync_dir(env, out_path.parent_path().empty() ? fs::path(".") : out_path.parent_path());
  return stats;
}

}  // namespace pinload
