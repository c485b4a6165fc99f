// The node store's converted entries (Note [Converted store entries] in
// pinload/store.h): the daemon's converting fill, and serve_store, which
// gives the store's daemon this fill.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "base/parallel_for.h"
#include "load/convert_on_load.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "pinload/store.h"
#include "store/server.h"

namespace pinload {
namespace detail {
namespace {

constexpr std::uint64_t kImageDataAlignment = 4096;  // the data section starts on a page
constexpr std::size_t kCopyPiece = 8u << 20;

// The client's file under the name it gave: its own descriptor reopened
// through /proc (so that O_DIRECT can be asked), or duplicated where the
// daemon may not reopen it. The converting load reads this one file only.
class ClientFileEnv final : public EnvWrapper {
 public:
  ClientFileEnv(Env* target, int fd, std::string path) : EnvWrapper(target), fd_(fd), path_(std::move(path)) {}

  int open_read(const std::string& path, int extra_flags) override {
    if (path != path_) return -ENOENT;
    const int reopened = EnvWrapper::open_read("/proc/self/fd/" + std::to_string(fd_), extra_flags);
    if (reopened >= 0) return reopened;
    const int copy = ::fcntl(fd_, F_DUPFD_CLOEXEC, 0);
    return copy >= 0 ? copy : -errno;
  }

 private:
  int fd_;
  std::string path_;
};

// What a converting load of one file hands out, laid out as a safetensors
// file: planned from the header and the scales, written by loading.
class LoadedImage final : public ConvertedImage {
 public:
  LoadedImage(Env* env, int fd, const std::string& path, const StoreVariant& variant, unsigned threads)
      : env_(env, fd, path), variant_(variant), threads_(std::max(threads, 1u)) {
    CheckpointFile file = read_checkpoint_file(&env_, path);
    file.name_prefix = variant.name_prefix;  // keep patterns match the names the client's load sees
    checkpoint_.files.push_back(std::move(file));
    const CheckpointFile& cf = checkpoint_.files[0];
    const ConversionPlan plan = plan_conversions(&env_, checkpoint_, variant.dtype);
    nlohmann::ordered_json json = nlohmann::ordered_json::object();
    if (!cf.header.metadata.empty()) {
      nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
      for (const auto& [k, v] : cf.header.metadata) metadata[k] = v;
      json["__metadata__"] = std::move(metadata);
    }
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < cf.header.tensors.size(); ++i) {
      const TensorInfo& t = cf.header.tensors[i];
      const std::int64_t role = plan.role[0][i];
      if (role == kDroppedTensor) continue;
      Planned p{t.name, t.dtype, at, t.nbytes()};
      if (role != kKeptTensor) {
        const TensorConversion& c = plan.tensors[static_cast<std::size_t>(role)];
        p.dtype = c.to;
        p.nbytes = c.out_bytes();
      }
      json[t.name] = {{"dtype", std::string(dtype_name(p.dtype))}, {"shape", t.shape}, {"data_offsets", {at, at + p.nbytes}}};
      at += p.nbytes;
      planned_.push_back(std::move(p));
    }
    std::string text = json.dump();
    text.append((kImageDataAlignment - (8 + text.size()) % kImageDataAlignment) % kImageDataAlignment, ' ');
    header_.resize(8);
    for (int b = 0; b < 8; ++b) header_[b] = static_cast<char>((text.size() >> (8 * b)) & 0xFF);
    header_ += text;
    bytes_ = header_.size() + at;
  }

  std::uint64_t bytes() const override { return bytes_; }

  void write(std::byte* into) override {
    const std::string& path = checkpoint_.files[0].path;
    LoadOptions options;
    options.threads = threads_;
    options.dtype = variant_.dtype;
    options.zero_copy = ZeroCopy::kOff;
    options.page_cache = PageCache::kBypass;  // the entry is the copy the node keeps
    options.store.disabled = true;            // never itself
    const StateDict loaded = Loader(options, nullptr, &env_).load(checkpoint_);
    const auto mismatch = [&](const std::string& what) {
      return IoError("the converting load handed out " + what + " than its plan (a pinload bug)", ErrorContext{path});
    };
    if (loaded.size() != planned_.size()) throw mismatch("other tensors");
    if (loaded.metadata() != checkpoint_.files[0].header.metadata) throw mismatch("other metadata");
    std::memcpy(into, header_.data(), header_.size());
    std::byte* data = into + header_.size();
    struct Piece {
      const std::byte* from;
      std::byte* to;
      std::size_t bytes;
    };
    std::vector<Piece> pieces;
    for (std::size_t i = 0; i < planned_.size(); ++i) {
      const Tensor& t = loaded[i];
      const Planned& p = planned_[i];
      if (t.name() != variant_.name_prefix + p.name || t.dtype() != p.dtype || t.nbytes() != p.nbytes) {
        throw mismatch("tensor " + t.name() + " otherwise");
      }
      for (std::uint64_t done = 0; done < p.nbytes; done += kCopyPiece) {
        const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kCopyPiece, p.nbytes - done));
        pieces.push_back({t.data() + done, data + p.offset + done, n});
      }
    }
    parallel_for(pieces.size(), threads_,
                 [&](std::size_t k) { std::memcpy(pieces[k].to, pieces[k].from, pieces[k].bytes); });
  }

 private:
  struct Planned {
    std::string name;  // without the prefix
    DType dtype;
    std::uint64_t offset;  // in the data section
    std::uint64_t nbytes;
  };
  ClientFileEnv env_;
  StoreVariant variant_;
  unsigned threads_;
  Checkpoint checkpoint_;
  std::vector<Planned> planned_;
  std::string header_;  // 8-byte length + padded JSON
  std::uint64_t bytes_ = 0;
};

}  // namespace
}  // namespace detail

int serve_store(const StoreServerOptions& options) {
  return detail::serve_store_with(
      options, [](Env* env, int fd, const std::string& path, const detail::StoreVariant& variant, unsigned threads)
                   -> std::unique_ptr<detail::ConvertedImage> {
        return std::make_unique<detail::LoadedImage>(env, fd, path, variant, threads);
      });
}

}  // namespace pinload
