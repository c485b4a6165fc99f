#include "format/checkpoint_storage.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>
#include <utility>

#include "base/log.h"
#include "pinload/error.h"
#include "pinload/remote.h"
#include "remote/remote_client.h"
#include "source/sources.h"

namespace pinload::detail {
namespace fs = std::filesystem;
namespace {

class LocalStorage final : public Storage {
 public:
  explicit LocalStorage(Env* env) : env_(env) {}

  PathKind kind(const std::string& path) override {
    FileStat st;
    const int rc = env_->stat_path(path, &st);
    // ENOENT and ENOTDIR are "not found"; ELOOP, EACCES on a parent, ... are not.
    if (rc == -ENOENT || rc == -ENOTDIR) return PathKind::kMissing;
    if (rc != 0) throw_os_error("cannot stat", -rc, ErrorContext{path});
    if (st.type == FileType::kDirectory) return PathKind::kFolder;
    if (st.type == FileType::kRegular) return PathKind::kFile;
    // Note [Special files] in checkpoint.h: refused before open(), which would block on a FIFO.
    throw InvalidFileError(std::string("is a ") + file_type_name(st.type) + ", not a regular file or folder",
                           ErrorContext{path});
  }

  void list(const std::string& folder, std::vector<std::string>* files, std::vector<std::string>* folders) override {
    std::vector<FolderEntry> entries;
    // A symlink loop, no read permission, ...
    if (int rc = env_->list_folder(folder, &entries); rc != 0) throw_os_error("cannot list folder", -rc, ErrorContext{folder});
    for (FolderEntry& entry : entries) {
      if (entry.type == FileType::kRegular) files->push_back(std::move(entry.name));
      else if (entry.type == FileType::kDirectory) folders->push_back(std::move(entry.name));
    }
    std::sort(files->begin(), files->end());
    std::sort(folders->begin(), folders->end());
  }

  std::string read_small(const std::string& path, std::uint64_t limit) override {
    const std::unique_ptr<detail::LocalFileSource> source = detail::open_local_file(env_, path);  // Note [Byte sources]
    const std::uint64_t size = source->stat().size;
    if (size > limit) {
      throw InvalidFileError("file of " + std::to_string(size) + " bytes exceeds the limit of " +
                                 std::to_string(limit) + " for an index", ErrorContext{path});
    }
    std::string text(size, '\0');
    source->read(0, size, reinterpret_cast<std::byte*>(text.data()), size);
    return text;
  }

  CheckpointFile read_header(const std::string& path) override { return read_checkpoint_file(env_, path); }

  std::string join(const std::string& folder, const std::string& name) const override {
    return (fs::path(folder) / name).string();
  }
  std::string parent(const std::string& path) const override { return fs::path(path).parent_path().string(); }

 private:
  Env* env_;
};

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string as_folder(std::string path) {
  if (!path.ends_with('/')) path += '/';
  return path;
}

class RemoteStorage final : public Storage {
 public:
  explicit RemoteStorage(const RemoteOptions& options) : options_(options), client_(remote::client_for(options)) {}

  PathKind kind(const std::string& path) override {
    const bool s3 = path.starts_with("s3://");
    const std::optional<remote::Location> loc = remote::parse_location(path);
    if (path.ends_with('/') || (s3 && loc->key.empty())) return PathKind::kFolder;
    // Files by their names; reading the header says whether they exist.
    if (!s3 || ends_with(path, ".safetensors") || ends_with(path, ".json")) return PathKind::kFile;
    if (client_->stat(path)) return PathKind::kFile;
    std::vector<std::string> files, folders;
    try {
      list(path, &files, &folders);
    } catch (const NotFoundError&) {
      return PathKind::kMissing;
    }
    return files.empty() && folders.empty() ? PathKind::kMissing : PathKind::kFolder;
  }

  void list(const std::string& folder, std::vector<std::string>* files, std::vector<std::string>* folders) override {
    remote::Listing listing = client_->list(as_folder(folder));
    *files = std::move(listing.files);
    *folders = std::move(listing.folders);
  }

  std::string read_small(const std::string& path, std::uint64_t limit) override {
    return client_->read_small(path, limit);
  }

  CheckpointFile read_header(const std::string& path) override { return read_remote_checkpoint_file(options_, path); }

  std::string join(const std::string& folder, const std::string& name) const override {
    return as_folder(folder) + name;
  }
  std::string parent(const std::string& path) const override {
    const std::size_t slash = path.rfind('/');
    return slash == std::string::npos ? path : path.substr(0, slash);
  }

 private:
  RemoteOptions options_;
  std::shared_ptr<remote::RemoteClient> client_;
};

}  // namespace

std::unique_ptr<Storage> local_storage(Env* env) { return std::make_unique<LocalStorage>(env); }
std::unique_ptr<Storage> remote_storage(const RemoteOptions& options) { return std::make_unique<RemoteStorage>(options); }

namespace {

// One read of a remote header: 8 bytes (whose answer says the version), then N.
CheckpointFile read_remote_header_once(const std::shared_ptr<remote::RemoteClient>& client, const std::string& path,
                                       remote::ObjectInfo* info) {
  CheckpointFile file;
  file.path = path;
  std::byte prefix[kHeaderPrefixSize] = {};
  std::uint64_t got = 0;
  *info = client->open(path, prefix, sizeof prefix, &got);
  file.stat.size = info->size;
  file.stat.mtime_ns = info->mtime_ns;
  // Loads compare files by (size, mtime, inode): the ETag stands in for the inode.
  file.stat.inode = std::hash<std::string>{}(info->etag);
  file.version = info->etag;
  const std::string shown = remote::display_url(path);
  const std::uint64_t n = parse_header_prefix(
      std::span<const std::byte>(prefix, got >= kHeaderPrefixSize ? kHeaderPrefixSize : 0), info->size, shown);
  std::vector<std::byte> json(n);  // n <= kMaxHeaderSize and n <= size
  detail::open_remote_object(client, *info)->read(kHeaderPrefixSize, n, json.data(), n);  // Note [Byte sources]
  file.header = parse_header(json, info->size, shown);
  return file;
}

}  // namespace

// Note [Remote consistency] in remote_client.h: a coarse validator pins the
// version only once the server's clock has passed the object's modification
// second; until then the header is read again after waiting.
CheckpointFile read_remote_checkpoint_file(const RemoteOptions& options, const std::string& path) {
  std::shared_ptr<remote::RemoteClient> client = remote::client_for(options);
  const std::string shown = remote::display_url(path);
  constexpr int kRounds = 4;
  std::optional<std::pair<std::string, std::int64_t>> waited_for;  // (ETag, Last-Modified)
  for (int round = 0;; ++round) {
    remote::ObjectInfo info;
    CheckpointFile file = read_remote_header_once(client, path, &info);
    const remote::Validator validator = info.validator();
    if (validator == remote::Validator::kNone) {
      log::warn("{}: the server sends neither ETag nor Last-Modified: a change to the object during the load "
                "cannot be detected", shown);
      return file;
    }
    if (validator == remote::Validator::kStrong) return file;
    const std::int64_t modified_s = info.mtime_ns / 1'000'000'000;
    if (modified_s == 0) return file;  // a weak ETag alone: compared on every answer
    const std::int64_t date_s =
        info.date_s != 0 ? info.date_s
                         : std::chrono::duration_cast<std::chrono::seconds>(
                               std::chrono::system_clock::now().time_since_epoch()).count();
    const std::optional<std::int64_t> wait_ms = remote::settle_wait_ms(modified_s, date_s);
    if (!wait_ms) {
      log::warn("{}: modified {} s ahead of the server's clock: its {} cannot tell versions of the same size "
                "apart until then", shown, modified_s - date_s, remote::validator_name(validator));
      return file;
    }
    // Waited already for this version: its second is over.
    if (*wait_ms == 0 || waited_for == std::pair(info.etag, info.mtime_ns)) return file;
    waited_for = std::pair(info.etag, info.mtime_ns);
    if (round + 1 == kRounds) {
      throw IoError("object keeps changing (modified at " + std::to_string(modified_s) + " s, " +
                        std::to_string(kRounds) + " times in a row)", ErrorContext{shown});
    }
    log::debug("{}: modified in the server's current second ({} s, Date {} s) and its {} cannot tell versions of "
               "the same size apart: reading the header again in {} ms", shown, modified_s, date_s,
               remote::validator_name(validator), *wait_ms);
    std::this_thread::sleep_for(std::chrono::milliseconds(*wait_ms));
  }
}

}  // namespace pinload::detail
