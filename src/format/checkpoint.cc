#include "pinload/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <unordered_map>

#include "format/checkpoint_storage.h"
#include "format/json_strict.h"
#include "pinload/error.h"
#include "source/sources.h"

namespace pinload {
namespace fs = std::filesystem;
namespace {

constexpr std::string_view kSafetensorsExt = ".safetensors";
constexpr std::string_view kIndexSuffix = ".safetensors.index.json";

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// "model.fp16-00001-of-00002" -> "model.fp16": a shard's number is not part
// of its variant.
std::string_view strip_shard_number(std::string_view stem) {
  const auto of = stem.rfind("-of-");
  if (of == std::string_view::npos || of == 0 || !all_digits(stem.substr(of + 4))) return stem;
  const auto dash = stem.rfind('-', of - 1);
  if (dash == std::string_view::npos || !all_digits(stem.substr(dash + 1, of - dash - 1))) return stem;
  return stem.substr(0, dash);
}

// The variant of a file name: "fp16" for "x.fp16.safetensors" or
// "x.safetensors.index.fp16.json", "" for plain names, nullopt if neither kind.
std::optional<std::string> safetensors_variant(const std::string& name, bool* is_index) {
  *is_index = false;
  if (ends_with(name, kIndexSuffix)) {
    *is_index = true;
    return std::string{};
  }
  if (auto pos = name.find(".safetensors.index."); pos != std::string::npos && ends_with(name, ".json")) {
    *is_index = true;
    const std::size_t from = pos + std::string_view(".safetensors.index.").size();
    return name.substr(from, name.size() - from - 5);
  }
  if (!ends_with(name, kSafetensorsExt)) return std::nullopt;
  const std::string_view stem =
      strip_shard_number(std::string_view(name).substr(0, name.size() - kSafetensorsExt.size()));
  const auto dot = stem.rfind('.');
  if (dot == std::string_view::npos) return std::string{};
  const std::string tail(stem.substr(dot + 1));
  // "model-00001-of-00002" has no dot; treat short alphanumeric tails as variants.
  const bool looks_like_variant = !tail.empty() && tail.size() <= 16 &&
                                  std::all_of(tail.begin(), tail.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
  return looks_like_variant ? tail : std::string{};
}

struct IndexFile {
  std::string path;
  std::vector<std::string> shards;  // absolute-ish paths, first-appearance order
  std::unordered_map<std::string, std::string> weight_map;  // tensor -> shard path
};

IndexFile read_index(detail::Storage& storage, const std::string& path) {
  const std::string text = storage.read_small(path, kMaxHeaderSize);
  Json root = parse_strict_json(text.data(), text.data() + text.size(), path, 0, "index JSON");
  if (!root.is_object()) throw InvalidFileError("index must be a JSON object", ErrorContext{path});
  auto it = root.find("weight_map");
  if (it == root.end() || !it->is_object()) {
    throw InvalidFileError("index has no 'weight_map' object", ErrorContext{path});
  }
  IndexFile index;
  index.path = path;
  const std::string dir = storage.parent(path);
  std::set<std::string> seen;
  for (auto& [tensor, shard] : it->items()) {
    if (!shard.is_string()) {
      throw InvalidFileError("weight_map value must be a file name", ErrorContext{path, tensor});
    }
    const std::string name = shard.get<std::string>();
    if (name.empty() || fs::path(name).is_absolute() || name.find("..") != std::string::npos) {
      throw InvalidFileError("weight_map names shard '" + name + "' outside the index's folder",
                             ErrorContext{path, tensor});
    }
    const std::string shard_path = storage.join(dir, name);
    if (seen.insert(shard_path).second) index.shards.push_back(shard_path);
    index.weight_map.emplace(tensor, shard_path);
  }
  std::sort(index.shards.begin(), index.shards.end());
  return index;
}

// Checks that an index and its shards' headers agree exactly.
void check_index(const IndexFile& index, std::span<const CheckpointFile> shards) {
  std::size_t total = 0;
  for (const CheckpointFile& shard : shards) {
    for (const TensorInfo& t : shard.header.tensors) {
      auto it = index.weight_map.find(t.name);
      if (it == index.weight_map.end()) {
        throw InvalidFileError("tensor in shard '" + shard.path + "' is missing from weight_map",
                               ErrorContext{index.path, t.name});
      }
      if (it->second != shard.path) {
        throw InvalidFileError("weight_map puts the tensor in '" + it->second + "' but it is in '" +
                                   shard.path + "'", ErrorContext{index.path, t.name});
      }
    }
    total += shard.header.tensors.size();
  }
  if (total != index.weight_map.size()) {
    for (const auto& entry : index.weight_map) {
      // Not a structured binding: clang 14 cannot capture one in a lambda.
      const std::string& tensor = entry.first;
      const std::string& shard_path = entry.second;
      auto shard = std::find_if(shards.begin(), shards.end(), [&](const CheckpointFile& f) { return f.path == shard_path; });
      if (shard == shards.end() || shard->header.find(tensor) == nullptr) {
        throw InvalidFileError("weight_map lists a tensor that shard '" + shard_path + "' does not hold",
                               ErrorContext{index.path, tensor});
      }
    }
  }
}

class Resolver {
 public:
  Resolver(Env* env, const ResolveOptions& options, Checkpoint* out)
      : local_(detail::local_storage(env)), options_(options), out_(out) {}

  void add_path(const std::string& path, const std::string& prefix) {
    detail::Storage& storage = storage_for(path);
    const detail::PathKind kind = storage.kind(path);
    if (kind == detail::PathKind::kMissing) throw NotFoundError("no such file or folder", ErrorContext{path});
    if (kind == detail::PathKind::kFolder) {
      add_folder(storage, path, prefix);
    } else if (ends_with(path, ".json")) {
      add_index(storage, path, prefix);
    } else {
      add_file(storage, path, prefix);
    }
  }

 private:
  detail::Storage& storage_for(const std::string& path) {
    refuse_unread_scheme(path);
    if (!is_remote_path(path)) return *local_;
    if (!remote_) remote_ = detail::remote_storage(options_.remote);
    return *remote_;
  }

  void add_file(detail::Storage& storage, const std::string& path, const std::string& prefix) {
    CheckpointFile file = storage.read_header(path);
    file.name_prefix = prefix;
    out_->files.push_back(std::move(file));
  }

  void add_index(detail::Storage& storage, const std::string& path, const std::string& prefix) {
    IndexFile index = read_index(storage, path);
    const std::size_t first = out_->files.size();
    for (const std::string& shard : index.shards) add_file(storage, shard, prefix);
    check_index(index, std::span<const CheckpointFile>(out_->files).subspan(first));
    out_->index_files.push_back(path);
  }

  void add_folder(detail::Storage& storage, const std::string& path, const std::string& prefix) {
    std::vector<std::string> names, folders;
    storage.list(path, &names, &folders);
    if (std::binary_search(names.begin(), names.end(), "model_index.json")) {
      add_pipeline(storage, path, folders);
      return;
    }
    std::vector<std::string> files, indexes;
    std::set<std::string> other_variants;
    for (const std::string& name : names) {
      bool is_index = false;
      auto variant = safetensors_variant(name, &is_index);
      if (!variant) continue;
      if (*variant != options_.variant) {
        other_variants.insert(*variant);
        continue;
      }
      (is_index ? indexes : files).push_back(storage.join(path, name));
    }
    if (files.empty() && indexes.empty()) {
      std::string hint;
      for (const std::string& v : other_variants) hint += (hint.empty() ? "" : ", ") + (v.empty() ? std::string("(no variant)") : v);
      throw NotFoundError(options_.variant.empty()
                              ? "folder holds no .safetensors file" + (hint.empty() ? std::string{} : "; variants present: " + hint)
                              : "folder holds no file of variant '" + options_.variant + "'" + (hint.empty() ? std::string{} : "; present: " + hint),
                          ErrorContext{path});
    }
    std::sort(files.begin(), files.end());
    std::sort(indexes.begin(), indexes.end());
    if (indexes.size() > 1) {
      throw InvalidFileError("folder holds several index files; name one", ErrorContext{path});
    }
    if (indexes.size() == 1) {
      add_index(storage, indexes.front(), prefix);
      return;
    }
    for (const std::string& file : files) add_file(storage, file, prefix);
  }

  void add_pipeline(detail::Storage& storage, const std::string& path, const std::vector<std::string>& components) {
    bool any = false;
    for (const std::string& component : components) {
      const std::string dir = storage.join(path, component);
      std::vector<std::string> names, folders;
      storage.list(dir, &names, &folders);
      const bool has_weights = std::any_of(names.begin(), names.end(), [](const std::string& name) {
        bool is_index = false;
        return safetensors_variant(name, &is_index).has_value();
      });
      if (!has_weights) continue;  // tokenizer/, scheduler/
      add_folder(storage, dir, component + "/");
      any = true;
    }
    if (!any) throw NotFoundError("pipeline folder has no component with .safetensors files", ErrorContext{path});
  }

  std::unique_ptr<detail::Storage> local_;
  std::unique_ptr<detail::Storage> remote_;
  const ResolveOptions& options_;
  Checkpoint* out_;
};

}  // namespace

std::uint64_t Checkpoint::data_bytes() const {
  std::uint64_t total = 0;
  for (const CheckpointFile& f : files) total += f.header.data_size();
  return total;
}

std::uint64_t Checkpoint::tensor_count() const {
  std::uint64_t total = 0;
  for (const CheckpointFile& f : files) total += f.header.tensors.size();
  return total;
}

std::vector<std::pair<std::string, std::string>> Checkpoint::metadata() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const CheckpointFile& f : files) {
    for (const auto& kv : f.header.metadata) {
      if (std::none_of(out.begin(), out.end(), [&](const auto& m) { return m.first == kv.first; })) out.push_back(kv);
    }
  }
  return out;
}

SourceFile source_file(const CheckpointFile& file) {
  return SourceFile{file.path, file.stat, file.version, file.header.data_offset()};
}

CheckpointFile read_checkpoint_file(Env* env, const std::string& path, const RemoteOptions& remote) {
  if (is_remote_path(path)) return detail::read_remote_checkpoint_file(remote, path);
  refuse_unread_scheme(path);
  CheckpointFile file;
  file.path = path;
  const std::unique_ptr<detail::LocalFileSource> source = detail::open_local_file(env, path);  // Note [Byte sources]
  file.stat = source->stat();
  std::byte prefix[kHeaderPrefixSize] = {};
  if (file.stat.size >= kHeaderPrefixSize) source->read(0, sizeof prefix, prefix, sizeof prefix);
  const std::uint64_t n = parse_header_prefix(std::span<const std::byte>(prefix, file.stat.size >= kHeaderPrefixSize ? kHeaderPrefixSize : 0),
                                              file.stat.size, path);
  std::vector<std::byte> json(n);  // n <= kMaxHeaderSize and n <= file size
  source->read(kHeaderPrefixSize, json.size(), json.data(), json.size());
  file.header = parse_header(json, file.stat.size, path);
  return file;
}

Checkpoint open_checkpoint(Env* env, const std::vector<std::string>& paths, const ResolveOptions& options) {
  if (paths.empty()) throw InvalidArgumentError("no checkpoint path given");
  Checkpoint checkpoint;
  Resolver resolver(env, options, &checkpoint);
  for (const std::string& path : paths) resolver.add_path(path, "");

  std::unordered_map<std::string, const std::string*> owner;
  for (const CheckpointFile& file : checkpoint.files) {
    for (const TensorInfo& t : file.header.tensors) {
      auto [it, inserted] = owner.emplace(file.name_prefix + t.name, &file.path);
      if (!inserted) {
        throw InvalidFileError("tensor also appears in '" + *it->second + "'",
                               ErrorContext{file.path, file.name_prefix + t.name});
      }
    }
  }
  return checkpoint;
}

}  // namespace pinload
