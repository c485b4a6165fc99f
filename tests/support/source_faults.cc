#include "source_faults.h"

#include <algorithm>
#include <sstream>

#include "base/sha256.h"
#include "pinload/checkpoint.h"
#include "test_files.h"

namespace pinload::testing {

const std::vector<SourceFault>& source_faults() {
  static const std::vector<SourceFault> table = {
      {"clean", SourceFaultKind::kNone, 0},
      {"first read fails", SourceFaultKind::kReadFails, 0},
      {"middle read fails", SourceFaultKind::kReadFails, 0.5},
      {"last read fails", SourceFaultKind::kReadFails, 1},
      {"open fails", SourceFaultKind::kOpenFails, 0},
      {"mapping serves nothing", SourceFaultKind::kMappingFails, 0},
  };
  return table;
}

FaultSource::FaultSource(std::unique_ptr<ByteSource> target, SourceFault fault, std::uint64_t target_byte,
                         std::shared_ptr<Counts> counts)
    : ByteSourceWrapper(std::move(target)), fault_(std::move(fault)), target_byte_(target_byte), counts_(std::move(counts)) {}

void FaultSource::open() {
  if (fault_.kind == SourceFaultKind::kOpenFails) {
    counts_->injected++;
    throw_os_error("cannot open", ENOENT, ErrorContext{path()});
  }
  ByteSourceWrapper::open();
}

void FaultSource::read(std::uint64_t offset, std::uint64_t bytes, std::byte* dest, std::uint64_t capacity) {
  counts_->reads++;
  if (direct()) counts_->direct_reads++;
  if (fault_.kind == SourceFaultKind::kOpenFails) {  // a read opens the source first
    counts_->injected++;
    throw_os_error("cannot open", ENOENT, ErrorContext{path()});
  }
  if (fault_.kind == SourceFaultKind::kReadFails && offset <= target_byte_ && target_byte_ < offset + bytes) {
    counts_->injected++;
    throw_os_error("read failed", EIO, ErrorContext{path(), {}, offset, offset + bytes});
  }
  ByteSourceWrapper::read(offset, bytes, dest, capacity);
}

bool FaultSource::copy_mapped(std::uint64_t offset, std::uint64_t bytes, std::byte* dest) {
  if (fault_.kind == SourceFaultKind::kMappingFails) {
    counts_->refused_copies++;
    counts_->injected++;
    return false;
  }
  // A mapped range whose pages cannot be read fails its populate; the load
  // then reads it, which fails too.
  if (fault_.kind == SourceFaultKind::kReadFails && offset <= target_byte_ && target_byte_ < offset + bytes) {
    counts_->refused_copies++;
    return false;
  }
  const bool copied = ByteSourceWrapper::copy_mapped(offset, bytes, dest);
  if (copied) counts_->mapped_copies++;
  return copied;
}

std::uint64_t fault_target_byte(const std::string& path, const LoadOptions& options, double where) {
  const Checkpoint checkpoint = open_checkpoint(default_env(), {path}, options.resolve);
  const CheckpointFile& file = checkpoint.files.at(0);
  const std::uint64_t data_begin = file.header.data_offset();
  const std::uint64_t data_bytes = file.stat.size - data_begin;
  if (data_bytes == 0) throw InvalidArgumentError("the fault table needs tensor data", ErrorContext{path});
  return data_begin + static_cast<std::uint64_t>(where * static_cast<double>(data_bytes - 1));
}

FaultOutcome load_with_fault(const std::string& path, LoadOptions options, const SourceFault& fault, Env* env) {
  FaultOutcome out;
  const Checkpoint checkpoint = open_checkpoint(default_env(), {path}, options.resolve);
  out.target_byte = fault_target_byte(path, options, fault.where);
  auto counts = std::make_shared<FaultSource::Counts>();
  options.wrap_source = [&](std::unique_ptr<ByteSource> source) -> std::unique_ptr<ByteSource> {
    return std::make_unique<FaultSource>(std::move(source), fault, out.target_byte, counts);
  };
  out.fds_before = open_fd_count();
  out.threads_before = stable_thread_count();
  {
    Loader loader(options, nullptr, env);
    try {
      const StateDict sd = loader.load(checkpoint);
      for (const Tensor& t : sd) {
        detail::Sha256 sha;
        const std::span<const std::byte> bytes = t.bytes();
        sha.update(bytes.data(), bytes.size());
        out.digests[t.name()] = sha.final_hex();
      }
    } catch (const Error& e) {
      out.failed = true;
      out.code = e.code();
      out.context = e.context();
      out.what = e.what();
    }
    out.pool_in_use_after = loader.pool()->stats().in_use_bytes;
  }
  out.fds_after = open_fd_count();
  out.threads_after = settled_thread_count(out.threads_before);
  out.reads = counts->reads;
  out.mapped_copies = counts->mapped_copies;
  out.refused_copies = counts->refused_copies;
  out.injected = counts->injected;
  out.direct_reads = counts->direct_reads;
  return out;
}

std::string judge(const FaultOutcome& o, const SourceFault& fault, const std::string& path,
                  const std::map<std::string, std::string>& expected, const std::string& cache_dir,
                  int fd_allowance) {
  std::ostringstream why;
  // Pooled connections of a remote client stay open between loads: a load
  // may leave fd_allowance more than it found.
  if (o.fds_after > o.fds_before + fd_allowance) why << "descriptors " << o.fds_before << " -> " << o.fds_after << "; ";
  if (o.threads_after > o.threads_before) why << "threads " << o.threads_before << " -> " << o.threads_after << "; ";
  if (o.pool_in_use_after != 0) why << o.pool_in_use_after << " pool bytes still in blocks; ";
  switch (fault.kind) {
    case SourceFaultKind::kReadFails:
    case SourceFaultKind::kOpenFails: {
      if (!o.failed) {
        why << "the load did not fail (" << o.injected << " faults injected)";
        break;
      }
      if (o.injected == 0) why << "failed without the fault: " << o.what << "; ";
      if (o.code != (fault.kind == SourceFaultKind::kOpenFails ? ErrorCode::kNotFound : ErrorCode::kIo)) {
        why << "error code " << static_cast<int>(o.code) << ": " << o.what << "; ";
      }
      const bool in_cache = !cache_dir.empty() && o.context.file.rfind(cache_dir + "/", 0) == 0;
      if (o.context.file != path && !in_cache) why << "error names '" << o.context.file << "', not the file: " << o.what << "; ";
      const bool has_range = o.context.begin && o.context.end && *o.context.begin < *o.context.end;
      if (fault.kind == SourceFaultKind::kReadFails && o.cut_at_target &&
          !(has_range && *o.context.begin >= o.target_byte)) {
        why << "error's range does not start at or past the cut at byte " << o.target_byte << ": " << o.what << "; ";
      }
      if (fault.kind == SourceFaultKind::kReadFails && !o.cut_at_target &&
          !(has_range && *o.context.begin <= o.target_byte && o.target_byte < *o.context.end)) {
        why << "error's range does not hold byte " << o.target_byte << ": " << o.what << "; ";
      }
      if (!o.digests.empty()) why << "tensors returned; ";
      break;
    }
    case SourceFaultKind::kNone:
    case SourceFaultKind::kMappingFails:
      if (o.failed) {
        why << "failed: " << o.what;
        break;
      }
      if (o.digests != expected) why << "bytes differ from the independent reader's (" << o.digests.size() << " tensors)";
      if (fault.kind == SourceFaultKind::kMappingFails && o.mapped_copies != 0) why << "; copied from a mapping";
      break;
  }
  return why.str();
}

}  // namespace pinload::testing
