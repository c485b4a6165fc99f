#include "load/verify.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unordered_map>

#include "pinload/byte_source.h"
#include "pinload/error.h"
#include "pinload/remote.h"

namespace pinload::detail {

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string shape_text(const std::vector<std::uint64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out + "]";
}

// The header of `cf` against its manifest entry: the same tensors with the
// same dtype, shape and range, the same metadata.
void check_header(const CheckpointFile& cf, const ManifestFile& entry) {
  const Header& h = cf.header;
  if (entry.size != h.file_size) {
    throw IntegrityError("the file has " + std::to_string(h.file_size) + " bytes, the manifest says " +
                             std::to_string(entry.size),
                         ErrorContext{cf.path});
  }
  if (!entry.has_tensors) return;
  std::unordered_map<std::string_view, const ManifestTensor*> by_name;
  for (const ManifestTensor& t : entry.tensors) by_name.emplace(t.name, &t);
  for (const TensorInfo& t : h.tensors) {
    const auto it = by_name.find(t.name);
    const std::uint64_t begin = h.data_offset() + t.begin, end = h.data_offset() + t.end;
    const ErrorContext where{cf.path, t.name, begin, end};
    if (it == by_name.end()) throw IntegrityError("the tensor is not in the manifest", where);
    const ManifestTensor& m = *it->second;
    if (m.dtype != t.dtype) {
      throw IntegrityError("dtype " + std::string(dtype_name(t.dtype)) + ", the manifest says " +
                               std::string(dtype_name(m.dtype)),
                           where);
    }
    if (m.shape != t.shape) {
      throw IntegrityError("shape " + shape_text(t.shape) + ", the manifest says " + shape_text(m.shape), where);
    }
    if (m.begin != begin || m.end != end) {
      throw IntegrityError("the manifest puts the tensor at bytes " + std::to_string(m.begin) + ".." +
                               std::to_string(m.end),
                           where);
    }
    by_name.erase(it);
  }
  if (!by_name.empty()) {
    const ManifestTensor& m = *by_name.begin()->second;
    throw IntegrityError("the manifest's tensor is missing from the file", ErrorContext{cf.path, m.name, m.begin, m.end});
  }
  if (entry.metadata != h.metadata) throw IntegrityError("the header's metadata differs from the manifest's", ErrorContext{cf.path});
}

}  // namespace

Verifier::Verifier(Env* env, const VerifyOptions& options, const Checkpoint& checkpoint, const ReadPlan& plan,
                   bool streaming)
    : streaming_(streaming) {
  options.validate();
  std::vector<bool> sha_used(options.file_sha256.size(), false);
  static const std::string kEmpty = sha256_hex(nullptr, 0);
  for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
    const CheckpointFile& cf = checkpoint.files[i];
    File& f = *files_.emplace_back(std::make_unique<File>());
    f.path = cf.path;
    f.size = cf.header.file_size;
    f.read_begin = plan.files[i].read_begin;
    f.first_piece = f.end_piece = pieces_.size();
    const ManifestFile* entry = nullptr;
    if (options.manifest) {
      entry = options.manifest->find(cf.path);
      if (entry == nullptr) throw IntegrityError("the file is not in the manifest", ErrorContext{cf.path});
      check_header(cf, *entry);
      if (!entry->has_tensors) f.whole_expected = entry->sha256;
      const std::uint64_t piece_bytes = options.manifest->piece_bytes;
      for (const ManifestTensor& t : entry->tensors) {
        if (t.begin == t.end) {
          if (t.sha256 != kEmpty) {
            throw IntegrityError("an empty tensor, whose sha256 the manifest says is " + t.sha256,
                                 ErrorContext{cf.path, t.name, t.begin, t.end});
          }
          continue;
        }
        const std::size_t count = t.pieces.empty() ? 1 : t.pieces.size();
        for (std::size_t k = 0; k < count; ++k) {
          Piece& p = pieces_.emplace_back();
          p.begin = t.begin + k * piece_bytes;
          p.end = t.pieces.empty() ? t.end : std::min(t.end, p.begin + piece_bytes);
          p.expected = t.pieces.empty() ? t.sha256 : t.pieces[k];
          p.tensor = t.name;
        }
      }
      f.end_piece = pieces_.size();
    }
    for (std::size_t k = 0; k < options.file_sha256.size(); ++k) {
      if (!file_named(cf.path, options.file_sha256[k].first)) continue;
      sha_used[k] = true;
      const std::string expected = lower(options.file_sha256[k].second);
      if (!f.whole_expected.empty() && f.whole_expected != expected) {
        throw IntegrityError("the manifest's sha256 " + f.whole_expected + " differs from the one given, " + expected,
                             ErrorContext{cf.path});
      }
      f.whole_expected = expected;
    }
    if (f.whole_expected.empty()) continue;
    if (streaming) {
      throw InvalidArgumentError(
          "verify: a whole-file sha256 cannot be checked by a load that streams through staging blocks (a device "
          "load in streaming mode, or a staged conversion); verify against a manifest with tensor digests "
          "(pinload manifest), or load in cached mode",
          ErrorContext{cf.path});
    }
    if (is_remote_path(cf.path)) {
      throw InvalidArgumentError(
          "verify: a whole-file sha256 of a remote file cannot be checked in the load; verify against a manifest "
          "with tensor digests (pinload manifest)",
          ErrorContext{cf.path});
    }
    // The header's bytes go first: read them again (they are few; the
    // file's identity is checked when the load opens it).
    const std::uint64_t header_bytes = cf.header.data_offset();
    std::vector<std::byte> header(header_bytes);
    const std::unique_ptr<ByteSource> source =  // Note [Byte sources]
        open_byte_source(env, source_file(cf), SourceOptions{});
    source->read(0, header_bytes, header.data(), header_bytes);
    f.whole.update(header.data(), header.size());
    f.next = header_bytes;
  }
  for (std::size_t k = 0; k < sha_used.size(); ++k) {
    if (!sha_used[k]) {
      throw InvalidArgumentError("verify: no file of the load is named '" + options.file_sha256[k].first + "'");
    }
  }
}

void Verifier::check_piece(const Piece& p, const File& f, const std::byte* bytes) const {
  const std::string actual = sha256_hex(bytes, p.end - p.begin);
  if (actual != p.expected) {
    throw IntegrityError("the bytes differ from the manifest's (sha256 " + actual + ", expected " + p.expected + ")",
                         ErrorContext{f.path, p.tensor, p.begin, p.end});
  }
}

void Verifier::landed(const ReadChunk& c, const std::shared_ptr<Block>& block, std::size_t block_offset) {
  File& f = *files_[c.file];
  const std::byte* base = block->data() + block_offset;  // file offset c.offset
  const std::uint64_t a = c.offset, b = c.offset + c.valid;
  // The pieces the chunk holds a part of: the first that ends after a, on.
  auto first = std::partition_point(pieces_.begin() + static_cast<std::ptrdiff_t>(f.first_piece),
                                    pieces_.begin() + static_cast<std::ptrdiff_t>(f.end_piece),
                                    [&](const Piece& p) { return p.end <= a; });
  for (auto it = first; it != pieces_.begin() + static_cast<std::ptrdiff_t>(f.end_piece) && it->begin < b; ++it) {
    Piece& p = *it;
    const std::uint64_t length = p.end - p.begin;
    if (p.begin >= a && p.end <= b) {
      check_piece(p, f, base + (p.begin - a));
      p.landed.store(length, std::memory_order_release);
      continue;
    }
    const std::uint64_t from = std::max(p.begin, a), to = std::min(p.end, b);
    if (!streaming_) {
      // The other fragments are in the same block, at their places: the
      // reader that lands the last one hashes the piece.
      if (p.landed.fetch_add(to - from, std::memory_order_acq_rel) + (to - from) == length) {
        check_piece(p, f, base - (a - f.read_begin) + (p.begin - f.read_begin));
      }
      continue;
    }
    std::vector<std::byte> whole;
    {
      std::lock_guard lock(f.mu);
      if (p.fragments.empty()) p.fragments.resize(length);
      std::memcpy(p.fragments.data() + (from - p.begin), base + (from - a), to - from);
      if (p.landed.fetch_add(to - from, std::memory_order_relaxed) + (to - from) == length) whole.swap(p.fragments);
    }
    if (!whole.empty()) check_piece(p, f, whole.data());
  }
  if (!f.whole_expected.empty()) hash_in_order(f, base - (a - f.read_begin), a, b, block);
}

void Verifier::hash_in_order(File& f, const std::byte* file_base, std::uint64_t begin, std::uint64_t end,
                             const std::shared_ptr<Block>& block) {
  std::unique_lock lock(f.mu);
  if (!f.block) f.block = block;  // kept until hashed
  begin = std::max(begin, f.next);
  if (end > begin) f.pending.emplace(begin, end);
  if (f.hashing) return;  // that reader will reach these bytes
  f.hashing = true;
  while (!f.pending.empty() && f.pending.begin()->first == f.next) {
    const std::uint64_t from = f.next, to = f.pending.begin()->second;
    f.pending.erase(f.pending.begin());
    lock.unlock();
    try {
      f.whole.update(file_base + (from - f.read_begin), to - from);
    } catch (...) {
      lock.lock();
      f.hashing = false;
      throw;
    }
    lock.lock();
    f.next = to;
  }
  f.hashing = false;
  if (f.next >= f.size && !f.whole_done) {
    f.whole_done = true;
    lock.unlock();
    finish_whole(f);
  }
}

void Verifier::finish_whole(File& f) {
  f.block.reset();
  const std::string actual = f.whole.final_hex();
  if (actual != f.whole_expected) {
    throw IntegrityError("the file's sha256 is " + actual + ", not the expected " + f.whole_expected,
                         ErrorContext{f.path, {}, 0, f.size});
  }
}

void Verifier::finish() {
  for (const std::unique_ptr<File>& file : files_) {
    File& f = *file;
    for (std::size_t k = f.first_piece; k < f.end_piece; ++k) {
      const Piece& p = pieces_[k];
      if (p.landed.load(std::memory_order_acquire) != p.end - p.begin) {
        throw IntegrityError("the bytes were not verified", ErrorContext{f.path, p.tensor, p.begin, p.end});
      }
    }
    if (f.whole_expected.empty() || f.whole_done) continue;
    if (f.next < f.size) throw IntegrityError("the file was not verified", ErrorContext{f.path, {}, f.next, f.size});
    f.whole_done = true;
    finish_whole(f);  // a file without data: its header alone
  }
}

bool verify_checks_whole_files(const VerifyOptions& options, const Checkpoint& checkpoint) {
  if (!options.active()) return false;
  return std::any_of(checkpoint.files.begin(), checkpoint.files.end(), [&](const CheckpointFile& cf) {
    const ManifestFile* entry = options.manifest ? options.manifest->find(cf.path) : nullptr;
    if (entry != nullptr && !entry->has_tensors) return true;
    return std::any_of(options.file_sha256.begin(), options.file_sha256.end(),
                       [&](const auto& named) { return file_named(cf.path, named.first); });
  });
}

}  // namespace pinload::detail
