#include "load/zero_copy.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "base/log.h"
#include "io/read_session.h"
#include "source/sources.h"
#include "load/load_counters.h"
#include "pinload/error.h"
#include "pinload/memory_limit.h"

namespace pinload::detail {

namespace {

constexpr int kResidencySamples = 64;

// The fraction of `path` in the page cache, on a plain descriptor (below 0:
// unknown). kAuto measures it before taking a lease: a cold file then costs
// no lease and no lease-watcher thread.
double page_cache_fraction(Env* env, const std::string& path, std::uint64_t size) {
  const int fd = env->open_read(path, 0);
  if (fd < 0) return -1.0;
  const ScopedFd owned(env, fd);
  return env->resident_fraction(fd, size, kResidencySamples);
}

// The mode a load runs under: the option, else PINLOAD_PAGE_CACHE.
PageCache page_cache_mode(const LoadOptions& options) {
  if (options.page_cache != PageCache::kAuto) return options.page_cache;
  const char* v = std::getenv(kPageCacheVariable);
  if (v == nullptr || *v == '\0') return PageCache::kAuto;
  if (const std::optional<PageCache> mode = parse_page_cache(v)) return *mode;
  log::warn("{}={}: not auto, keep or bypass; using auto", kPageCacheVariable, v);
  return PageCache::kAuto;
}

// A cold file on a network filesystem is read as Note [Network filesystems]
// says, not populated through a mapping.
bool file_on_network_filesystem(Env* env, const std::string& path) {
  const int fd = env->open_read(path, 0);
  if (fd < 0) return false;
  const bool network = detail::on_network_filesystem(env, fd, path);
  env->close(fd);
  return network;
}

// keep_page_cache with the memory limit given: `read_limit` is called only
// where the rule needs it (a load reads the limit once).
template <typename ReadLimit>
bool keep_page_cache_by(const LoadOptions& options, std::uint64_t bytes, bool only_copy, ReadLimit read_limit) {
  switch (page_cache_mode(options)) {
    case PageCache::kKeep: return true;
    case PageCache::kBypass: return false;
    case PageCache::kAuto: break;
  }
  // DirectIo::kOn asks for direct reads: auto leaves the page cache alone.
  if (!only_copy || options.direct == DirectIo::kOn) return false;
  const std::optional<HostMemoryLimit> limit = read_limit();
  if (!limit) return false;  // nothing to go by: direct reads, as before
  const bool keep = static_cast<double>(bytes) <= kKeepFraction * static_cast<double>(limit->available_bytes);
  log::debug("page cache: {} bytes against {} left ({}): {}", bytes, limit->available_bytes, limit->source,
             keep ? "kept" : "bypassed");
  return keep;
}

}  // namespace

bool keep_page_cache(const LoadOptions& options, Env* env, std::uint64_t bytes, bool only_copy) {
  return keep_page_cache_by(options, bytes, only_copy, [&] { return read_host_memory_limit(env, options.memory_root); });
}

std::vector<std::shared_ptr<LeasedMapping>> choose_zero_copy(const LoadOptions& options, Env* env,
                                                             const Checkpoint& checkpoint, const Pool& pool) {
  std::vector<std::shared_ptr<LeasedMapping>> mapped(checkpoint.files.size());
  if (options.zero_copy == ZeroCopy::kOff) return mapped;
  // Memory the pool has touched already and would hand out again: a load
  // that fits it copies at memory speed and keeps its blocks pinned-ready
  // (the model-switching case), so kAuto reads into it.
  // A pool with a budget is the caller's cap on the load's memory: kAuto
  // keeps the load inside it (and failing before reading when it cannot fit).
  if (options.zero_copy == ZeroCopy::kAuto && (pool.options().capacity_bytes != 0 || options.pool_bytes != 0)) {
    return mapped;
  }
  // A load that cannot fit the process's memory limit keeps failing as
  // Note [Memory limits] says, before reading.
  // The limit is read once for the load: here and by the page cache's rule.
  std::optional<std::optional<HostMemoryLimit>> limit_read;
  auto memory_limit = [&] {
    if (!limit_read) limit_read = read_host_memory_limit(env, options.memory_root);
    return *limit_read;
  };
  if (options.zero_copy == ZeroCopy::kAuto) {
    const std::optional<HostMemoryLimit> limit = memory_limit();
    if (limit && limit->available_bytes < checkpoint.data_bytes()) return mapped;
  }
  // Note [Keeping the page cache]: cold files mapped too, read in by the
  // populate, so that the page cache holds them for the next process.
  std::optional<bool> keep;
  // Each mapping holds its file open for the lease: kAuto leaves at least
  // three quarters of the process's file descriptors to everything else.
  rlimit nofile{};
  const std::uint64_t fd_cap = ::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY
                                   ? nofile.rlim_cur / 4
                                   : UINT64_MAX;
  std::uint64_t leased = LeasedMapping::live_count();
  const PoolStats stats = pool.stats();
  std::uint64_t idle = stats.reserved_bytes > stats.in_use_bytes ? stats.reserved_bytes - stats.in_use_bytes : 0;
  for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
    const CheckpointFile& cf = checkpoint.files[i];
    if (cf.path.find("://") != std::string::npos || !cf.version.empty()) continue;  // remote
    const std::uint64_t bytes = cf.header.data_size();
    if (options.zero_copy == ZeroCopy::kAuto && bytes <= idle) {
      idle -= bytes;
      continue;
    }
    if (options.zero_copy == ZeroCopy::kAuto && leased >= fd_cap) {
      log::debug("{}: read, not mapped (file descriptor budget)", cf.path);
      continue;
    }
    if (options.zero_copy == ZeroCopy::kAuto) {
      const double resident = page_cache_fraction(env, cf.path, cf.stat.size);
      if (resident < options.resident_threshold) {
        if (file_on_network_filesystem(env, cf.path)) continue;  // read by one reader per connection instead
        if (!keep.has_value()) keep = keep_page_cache_by(options, checkpoint.data_bytes(), true, memory_limit);
        if (!*keep) {
          log::debug("{}: {:.0f}% in page cache: read, not mapped", cf.path, std::max(resident, 0.0) * 100);
          continue;
        }
        log::debug("{}: {:.0f}% in page cache: mapped, read in to stay cached", cf.path, std::max(resident, 0.0) * 100);
      }
    }
    std::string why;
    std::shared_ptr<LeasedMapping> m = LeasedMapping::open(env, cf.path, FileIdentity::of(cf.stat), &why);
    if (!m) {
      log::debug("{}: read, not mapped ({})", cf.path, why);
      continue;
    }
    mapped[i] = std::move(m);
    ++leased;
  }
  return mapped;
}

// Note [One read ahead per range]
// Faulting a cold mapping in reads it through the kernel's readahead, which
// starts small after the header's read and doubles window by window, each
// window one more round trip to the disk: a cold 1.2 MB file took ~1 ms of
// waits more than one direct read of it, and its load (pinload.torch.load_file
// in a fresh process, 1.2 MB files, page cache dropped) 3.3-3.7 ms against
// 1.3-2.0 ms read into the pool and 1.9-2.8 ms by safetensors. So each range
// is advised first (MADV_WILLNEED: one request for the whole range, up to the
// device's readahead limit) and then populated; the same loads took 2.2-2.3
// ms. On pages already cached the advice only looks them up (9 ms for a warm
// 5.1 GB file).
void populate_mapped(Env* env, const std::vector<MappedFile>& mappings, const Checkpoint& checkpoint, unsigned threads,
                     std::size_t block_size, std::stop_token stop) {
  struct Range {
    const std::byte* begin;
    std::size_t bytes;
    std::size_t file;
  };
  std::vector<Range> ranges;
  for (std::size_t i = 0; i < mappings.size(); ++i) {
    if (mappings[i].data == nullptr) continue;
    const std::uint64_t data_offset = checkpoint.files[i].header.data_offset();
    const std::uint64_t end = data_offset + checkpoint.files[i].header.data_size();
    // Whole pages: MADV_POPULATE_READ takes a page-aligned start.
    const std::uint64_t page = 4096;
    for (std::uint64_t at = data_offset / page * page; at < end; at += block_size) {
      ranges.push_back({mappings[i].data + at, static_cast<std::size_t>(std::min<std::uint64_t>(block_size, end - at)), i});
    }
  }
  if (ranges.empty()) return;
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::exception_ptr error;
  auto work = [&] {
    for (;;) {
      const std::size_t k = next.fetch_add(1, std::memory_order_relaxed);
      if (k >= ranges.size() || failed.load(std::memory_order_relaxed)) return;
      if (stop.stop_requested()) {
        failed = true;
        return;
      }
      const Range& r = ranges[k];
      // Note [One read ahead per range]
      (void)env->advise(const_cast<std::byte*>(r.begin), r.bytes, MADV_WILLNEED);
      int rc;
      do {
        rc = env->populate_read(r.begin, r.bytes);
      } while (rc == -EINTR || rc == -EAGAIN);
      // EINVAL: a kernel without it (ENOSYS: an Env without it); the pages
      // then fault in when touched.
      if (rc != 0 && rc != -EINVAL && rc != -ENOSYS) {
        std::lock_guard lock(mu);
        if (!error) {
          const CheckpointFile& cf = checkpoint.files[r.file];
          error = std::make_exception_ptr(IoError(
              std::string("reading a zero-copy mapping failed: ") + std::strerror(-rc),
              ErrorContext{cf.path, {}, static_cast<std::uint64_t>(r.begin - mappings[r.file].data)}));
        }
        failed = true;
        return;
      }
    }
  };
  const unsigned n = static_cast<unsigned>(std::min<std::size_t>(std::max(threads, 1u), ranges.size()));
  {
    std::vector<std::jthread> workers;
    for (unsigned t = 1; t < n; ++t) workers.emplace_back(work);
    work();
  }
  if (error) std::rethrow_exception(error);
  if (stop.stop_requested()) throw CancelledError("load cancelled");
}

std::optional<StateDict> load_zero_copy(const LoadOptions& options, Env* env, const Checkpoint& checkpoint, const Pool& pool,
                                        Loader::Counters* counters, std::stop_token stop,
                                        const std::function<void(std::vector<Tensor>)>& hand_out,
                                        const std::function<StateDict(const Checkpoint&)>& read) {
  std::vector<std::shared_ptr<LeasedMapping>> leased = choose_zero_copy(options, env, checkpoint, pool);
  if (std::none_of(leased.begin(), leased.end(), [](const auto& m) { return m != nullptr; })) return std::nullopt;
  std::vector<MappedFile> mapped(leased.size());
  for (std::size_t i = 0; i < leased.size(); ++i) {
    if (leased[i]) mapped[i] = MappedFile{leased[i]->data(), leased[i]->block()};
  }
  leased.clear();  // the blocks hold the mappings now
  return hand_out_mapped(options, env, checkpoint, std::move(mapped), &counters->files_zero_copy, counters, stop, hand_out,
                         read);
}

StateDict hand_out_mapped(const LoadOptions& options, Env* env, const Checkpoint& checkpoint, std::vector<MappedFile> mapped,
                          std::atomic<std::uint64_t>* files_counter, Loader::Counters* counters, std::stop_token stop,
                          const std::function<void(std::vector<Tensor>)>& hand_out,
                          const std::function<StateDict(const Checkpoint&)>& read) {
  // Files that are not mapped: loaded as usual, after the mapped ones are in.
  Checkpoint rest;
  rest.index_files = checkpoint.index_files;
  std::uint64_t mapped_bytes = 0;
  std::uint64_t mapped_files = 0;
  for (std::size_t i = 0; i < mapped.size(); ++i) {
    if (!mapped[i].block) {
      rest.files.push_back(checkpoint.files[i]);
    } else {
      mapped_bytes += checkpoint.files[i].header.data_size();
      ++mapped_files;
    }
  }
  // Every byte is in the process's page tables before the call returns, so a
  // zero-copy load is a load: the caller's first pass over the weights takes
  // no page faults, and a page that cannot be read fails here, typed.
  populate_mapped(env, mapped, checkpoint, options.threads, options.block_size, stop);
  if (stop.stop_requested()) throw CancelledError("load cancelled");
  for (std::size_t i = 0; i < mapped.size(); ++i) {
    if (mapped[i].block) log::debug("{}: handed out from a mapping", checkpoint.files[i].path);
  }
  std::vector<std::vector<Tensor>> by_file(mapped.size());
  for (std::size_t i = 0; i < mapped.size(); ++i) {
    if (!mapped[i].block) continue;
    const CheckpointFile& cf = checkpoint.files[i];
    const std::shared_ptr<Block> block = mapped[i].block;
    const std::uint64_t base = cf.header.data_offset();
    for (const TensorInfo& t : cf.header.tensors) {
      by_file[i].emplace_back(cf.name_prefix + t.name, t.dtype, t.shape, block, base + t.begin, t.nbytes());
    }
    hand_out(by_file[i]);
  }
  mapped.clear();  // the tensors hold the blocks now
  StateDict read_part;
  if (!rest.files.empty()) read_part = read(rest);
  *files_counter += mapped_files;
  counters->bytes_total += mapped_bytes;
  counters->bytes_done += mapped_bytes;
  if (counters->stream) return StateDict();
  std::vector<Tensor> tensors;
  tensors.reserve(checkpoint.tensor_count());
  std::size_t next_read = 0;
  for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
    const CheckpointFile& cf = checkpoint.files[i];
    if (!by_file[i].empty() || cf.header.tensors.empty()) {
      for (Tensor& t : by_file[i]) tensors.push_back(std::move(t));
    } else {
      for (std::size_t k = 0; k < cf.header.tensors.size(); ++k) tensors.push_back(read_part[next_read++]);
    }
  }
  return StateDict(std::move(tensors), checkpoint.metadata());
}

}  // namespace pinload::detail
