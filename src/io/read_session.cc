#include "io/read_session.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <exception>
#include <optional>
#include <thread>

#include "base/log.h"
#include "io/mapped_copy.h"
#include "pinload/error.h"
#include "pinload/numa.h"

namespace pinload::detail {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kFallbackDirectAlign = 4096;
constexpr int kResidencySamples = 64;

std::uint64_t nanoseconds_since(Clock::time_point start) {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
}

// Keeps the first error of many workers.
class FirstError {
 public:
  void set(std::exception_ptr e) {
    std::lock_guard lock(mu_);
    if (!error_) error_ = std::move(e);
  }
  std::exception_ptr get() const {
    std::lock_guard lock(mu_);
    return error_;
  }

 private:
  mutable std::mutex mu_;
  std::exception_ptr error_;
};

// Maps a file in the page cache for copying (Note [Mapped reads]); where the
// mapping is refused, the file is pread.
void map_for_load(Env* env, OpenFile* f) {
  if (f->stat.size == 0) return;
  int err = 0;
  const void* data = env->map_file(f->buffered_fd.get(), f->stat.size, &err);
  if (data == nullptr) {
    log::debug("{}: cannot map ({}), reading with pread", f->path, log::errno_text(err));
    return;
  }
  f->mapping = FileMapping(env, static_cast<const std::byte*>(data), f->stat.size);
}

// Copies [c.offset, +c.valid) from the file's mapping (Note [Mapped reads]).
// False where the mapping cannot serve it: the caller preads the chunk.
bool copy_mapped_chunk(Env* env, const OpenFile& f, const ReadChunk& c, std::byte* dest) {
  const std::byte* src = f.mapping.data() + c.offset;
  int rc;
  do {
    rc = env->populate_read(src, c.valid);
  } while (rc == -EINTR);
  // -EINVAL: a kernel before MADV_POPULATE_READ; the copy faults pages in.
  if (rc != 0 && rc != -EINVAL && rc != -ENOSYS) {
    log::debug("{}: populating [{}, {}) failed ({}), reading with pread", f.path, c.offset, c.offset + c.valid,
               log::errno_text(-rc));
    return false;
  }
  const bool copied = copy_from_mapping(dest, src, c.valid);
  // Drop the chunk's page-table entries now, in this worker, rather than all
  // at once when the file is unmapped (the page cache keeps its pages).
  env->advise(const_cast<std::byte*>(src), c.valid, MADV_DONTNEED);
  if (!copied) {
    log::debug("{}: SIGBUS copying [{}, {}) from the mapping, reading with pread", f.path, c.offset,
               c.offset + c.valid);
  }
  return copied;
}

// Opens a file for the load and decides direct or buffered (Note [Direct I/O]).
void open_for_load(Env* env, const CheckpointFile& cf, const LoadOptions& options, OpenFile* f) {
  f->path = cf.path;
  f->buffered_fd = open_or_throw(env, cf.path);
  f->stat = stat_or_throw(env, f->buffered_fd.get(), cf.path);
  if (f->stat.size != cf.stat.size) {
    throw IoError("file changed size from " + std::to_string(cf.stat.size) + " to " +
                  std::to_string(f->stat.size) + " bytes after its header was read",
                  ErrorContext{cf.path});
  }
  // The residency decides direct or buffered (kAuto) and whether a buffered
  // file is mapped (unless kPread); kOff with kPread needs neither.
  if (options.direct == DirectIo::kOff && options.cached_read == CachedRead::kPread) {
    log::debug("{}: reading buffered with pread (direct off)", cf.path);
    return;
  }
  std::string why_direct = "direct on";
  if (options.direct != DirectIo::kOn) {
    const double resident = env->resident_fraction(f->buffered_fd.get(), f->stat.size, kResidencySamples);
    const bool cached = resident >= options.resident_threshold;
    if (cached && options.cached_read != CachedRead::kPread) map_for_load(env, f);
    if (options.direct == DirectIo::kOff) {
      log::debug("{}: reading buffered{} (direct off)", cf.path, f->mapping.valid() ? " from a mapping" : "");
      return;
    }
    if (cached) {
      log::debug("{}: {:.0f}% in page cache, reading buffered{}", cf.path, resident * 100,
                 f->mapping.valid() ? " from a mapping" : "");
      return;
    }
    why_direct = fmt::format("{:.0f}% in page cache, under {:.0f}%", resident * 100, options.resident_threshold * 100);
  }
  // Reads land at page-aligned places in pool blocks (Note [Direct I/O]).
  if (f->stat.dio_mem_align > kFallbackDirectAlign) {
    const std::string why = "O_DIRECT needs " + std::to_string(f->stat.dio_mem_align) +
                            "-byte aligned memory here; pool blocks are aligned to " +
                            std::to_string(kFallbackDirectAlign);
    if (options.direct == DirectIo::kOn) throw IoError(why, ErrorContext{cf.path});
    log::debug("{}: {}, reading buffered", cf.path, why);
    return;
  }
  const int fd = env->open_read(cf.path, O_DIRECT);
  if (fd >= 0) {
    f->direct_fd = ScopedFd(env, fd);
    f->direct = true;
    log::debug("{}: {}, reading with O_DIRECT", cf.path, why_direct);
  } else if (options.direct == DirectIo::kOn) {
    throw_os_error("O_DIRECT open refused", -fd, ErrorContext{cf.path});
  } else {
    log::debug("{}: O_DIRECT refused at open ({}), reading buffered", cf.path, log::errno_text(-fd));
  }
}

[[noreturn]] void throw_read_error(const OpenFile& f, std::int64_t rc, std::uint64_t at, std::uint64_t end) {
  throw_os_error("read failed", static_cast<int>(-rc), ErrorContext{f.path, {}, at, end});
}

// Reads [offset, offset + valid) of the file to `dest` with pread, direct
// or buffered.
void read_with_pread(Env* env, OpenFile& f, const FileRead& plan, const ReadChunk& c, DirectIo mode,
                     ReadCounters* counters, std::byte* dest, bool direct) {
  std::uint64_t done = 0;
  while (done < c.valid) {
    const std::uint64_t at = c.offset + done;
    const int fd = direct ? f.direct_fd.get() : f.buffered(env);
    // Direct reads ask for the whole aligned length; buffered for what is left.
    const std::uint64_t want = direct ? c.length - done : c.valid - done;
    const std::int64_t n = env->pread(fd, dest + done, want, at);
    if (n == -EINTR || n == -EAGAIN) continue;
    if (n == -EINVAL && direct && mode != DirectIo::kOn) {
      if (f.direct.exchange(false)) {
        log::debug("{}: O_DIRECT read refused, reading buffered", f.path);
        counters->files_direct--;
        counters->files_buffered++;
      }
      direct = false;
      continue;
    }
    if (n < 0) throw_read_error(f, n, at, c.offset + c.valid);
    if (n == 0) {
      throw IoError("file ended at byte " + std::to_string(at) + " but was " + std::to_string(plan.file_size) +
                    " bytes when its header was read (truncated while loading?)",
                    ErrorContext{f.path, {}, at, c.offset + c.valid});
    }
    done += static_cast<std::uint64_t>(n);
    // A short direct read leaves an unaligned position: finish buffered.
    if (direct && done < c.valid && done % plan.alignment != 0) direct = false;
  }
}

// Executes one chunk: reads [offset, offset + valid) of the file to `dest`.
void read_chunk(Env* env, OpenFile& f, const FileRead& plan, const ReadChunk& c, DirectIo mode,
                CachedReadChooser* chooser, ReadCounters* counters, std::byte* dest) {
  const bool direct = f.direct.load(std::memory_order_relaxed);
  if (direct || !f.mapping.valid()) {
    read_with_pread(env, f, plan, c, mode, counters, dest, direct);
    return;
  }
  // A file in the page cache: Note [Mapped reads]. `chooser` null: always map.
  if (chooser == nullptr) {
    if (!copy_mapped_chunk(env, f, c, dest)) read_with_pread(env, f, plan, c, mode, counters, dest, false);
    return;
  }
  const CachedReadChooser::Method method = chooser->next();
  const Clock::time_point start = Clock::now();
  if (method == CachedReadChooser::kMap && !copy_mapped_chunk(env, f, c, dest)) {
    // Fell back: this pread says nothing about either method.
    read_with_pread(env, f, plan, c, mode, counters, dest, false);
    return;
  }
  if (method == CachedReadChooser::kPread) read_with_pread(env, f, plan, c, mode, counters, dest, false);
  chooser->record(method, c.valid, nanoseconds_since(start));
}

}  // namespace

int OpenFile::buffered(Env* env) {
  std::lock_guard lock(mu);
  if (!buffered_fd.valid()) buffered_fd = open_or_throw(env, path);
  return buffered_fd.get();
}

std::uint64_t ReadSession::bytes_done() const {
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < plan_.chunks.size(); ++i) {
    if (chunk_done(i)) n += plan_.chunks[i].valid;
  }
  return n;
}

std::vector<std::size_t> ReadSession::pending() const {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < plan_.chunks.size(); ++i) {
    if (!chunk_done(i)) out.push_back(i);
  }
  return out;
}

TemplateReads ReadSession::completed_reads(std::string destination) const {
  TemplateReads out{std::move(destination), {}};
  std::lock_guard lock(completed_mu_);
  out.reads.reserve(completed_.size());
  for (std::uint32_t i : completed_) {
    const ReadChunk& c = plan_.chunks[i];
    out.reads.push_back(TemplateRead{c.file, c.offset, c.length});
  }
  return out;
}

void ReadSession::check_idle(const char* what) const {
  if (executing_.load(std::memory_order_acquire)) {
    throw InvalidArgumentError(std::string(what) + " while execute() runs on the session");
  }
}

void ReadSession::keep_staged(std::size_t i, std::shared_ptr<Block> block) {
  // Called from execute()'s sink: each chunk once, by the worker that read it.
  staged_.at(i) = std::move(block);
}

std::shared_ptr<Block> ReadSession::take_staged(std::size_t i) {
  check_idle("take_staged()");
  return std::move(staged_.at(i));
}

void ReadSession::release_unread_blocks() {
  check_idle("release_unread_blocks()");
  if (streaming()) return;
  std::vector<bool> used(files_.size(), false);
  for (std::size_t i = 0; i < plan_.chunks.size(); ++i) {
    if (chunk_done(i)) used[plan_.chunks[i].file] = true;
  }
  for (std::size_t f = 0; f < files_.size(); ++f) {
    if (!used[f]) files_[f]->block.reset();
  }
}

void ReadSession::count_files(ReadCounters* counters) const {
  counters->files_direct = 0;
  counters->files_buffered = 0;
  for (const auto& f : files_) (f->direct ? counters->files_direct : counters->files_buffered)++;
  counters->bytes_total = plan_.total_bytes;
  counters->bytes_done = bytes_done();
}

std::unique_ptr<ReadSession> ReadSession::open(Env* env, const LoadOptions& options, Checkpoint checkpoint,
                                               std::shared_ptr<Pool> staging_pool, const TemplateReads* replay,
                                               ReadCounters* counters) {
  std::unique_ptr<ReadSession> s(new ReadSession);
  s->env_ = env;
  s->direct_mode_ = options.direct;
  s->cached_read_ = options.cached_read;
  s->checkpoint_ = std::move(checkpoint);
  s->staging_pool_ = std::move(staging_pool);
  const std::size_t n = s->checkpoint_.files.size();
  std::vector<FileRead> reads;
  s->files_.reserve(n);
  reads.reserve(n);
  for (const CheckpointFile& cf : s->checkpoint_.files) {
    auto f = std::make_unique<OpenFile>();
    open_for_load(env, cf, options, f.get());
    FileRead r;
    r.path = cf.path;
    r.file_size = cf.stat.size;
    r.data_offset = cf.header.data_offset();
    r.direct = f->direct;
    // Buffered reads use the same aligned ranges, so a file takes the same
    // block (size class) whether it was read direct or through the cache.
    r.alignment = std::max(f->stat.dio_offset_align, kFallbackDirectAlign);
    (f->direct ? counters->files_direct : counters->files_buffered)++;
    if (!f->direct && f->mapping.valid()) counters->files_mapped++;
    reads.push_back(std::move(r));
    s->files_.push_back(std::move(f));
  }
  s->plan_ = make_read_plan(std::move(reads), PlanOptions{options.block_size, options.files_in_flight});
  if (replay != nullptr) {
    if (std::optional<ReadPlan> replayed = replay_plan(s->plan_, replay->reads)) {
      s->plan_ = std::move(*replayed);
    } else {
      log::warn("the I/O template's reads for \"{}\" do not tile the checkpoint's files; using the default plan",
                replay->destination);
    }
  }
  counters->bytes_total = s->plan_.total_bytes;
  s->done_ = std::make_unique<std::atomic<bool>[]>(s->plan_.chunks.size());
  if (s->streaming()) s->staged_.resize(s->plan_.chunks.size());
  return s;
}

void ReadSession::allocate_blocks(Pool& pool, std::stop_token stop) {
  check_idle("allocate_blocks()");
  if (streaming()) return;
  // A load holds its blocks until it ends, so one that cannot fit the budget
  // fails now instead of waiting for memory only it could free.
  if (const std::uint64_t capacity = pool.options().capacity_bytes; capacity != 0) {
    std::uint64_t need = 0;
    for (const FileRead& r : plan_.files) need += Pool::size_class(std::max<std::uint64_t>(r.block_bytes(), 1));
    if (need > capacity) {
      throw OutOfMemoryError("checkpoint needs " + std::to_string(need) + " bytes of pool memory; the pool budget is " +
                             std::to_string(capacity) + " bytes");
    }
  }
  for (std::size_t i = 0; i < files_.size(); ++i) {
    if (!files_[i]->block) files_[i]->block = pool.allocate(plan_.files[i].block_bytes(), stop);
  }
}

void ReadSession::execute(const std::vector<std::size_t>& todo, unsigned threads, std::stop_token stop,
                          ReadCounters* counters, const std::vector<int>& cpus, const ChunkSink& sink) {
  if (executing_.exchange(true, std::memory_order_acq_rel)) {
    throw InvalidArgumentError("execute() while another execute() runs on the session");
  }
  struct Idle {
    std::atomic<bool>& executing;
    ~Idle() { executing.store(false, std::memory_order_release); }
  } idle{executing_};
  ReadSession& s = *this;
  std::atomic<std::size_t> next{0};
  std::stop_source abort;  // the first error, or the caller's stop, ends every worker
  std::stop_callback forward_stop(stop, [&] { abort.request_stop(); });
  FirstError first_error;
  auto worker = [&] {
    try {
      const ThreadAffinityScope near_pool(s.env_, cpus);  // Note [NUMA placement]
      for (;;) {
        if (abort.stop_requested()) return;
        const std::size_t k = next.fetch_add(1, std::memory_order_relaxed);
        if (k >= todo.size()) return;
        const std::size_t i = todo[k];
        const ReadChunk& c = s.plan_.chunks[i];
        const FileRead& r = s.plan_.files[c.file];
        OpenFile& f = *s.files_[c.file];
        // Streaming reads into a staging block of the chunk's own; the
        // others into the file's block.
        std::shared_ptr<Block> dest = s.streaming() ? s.staging_pool_->allocate(c.length, abort.get_token()) : f.block;
        const std::size_t dest_offset = s.streaming() ? 0 : c.offset - r.read_begin;
        read_chunk(s.env_, f, r, c, s.direct_mode_, s.cached_read_ == CachedRead::kAuto ? &s.chooser_ : nullptr,
                   counters, dest->data() + dest_offset);
        counters->bytes_done.fetch_add(c.valid, std::memory_order_relaxed);
        {
          std::lock_guard lock(s.completed_mu_);
          s.completed_.push_back(static_cast<std::uint32_t>(i));
        }
        s.done_[i].store(true, std::memory_order_release);
        if (sink) sink(i, std::move(dest), dest_offset);
      }
    } catch (...) {
      first_error.set(std::current_exception());
      abort.request_stop();
    }
  };
  const std::size_t thread_count = std::min<std::size_t>(std::max(threads, 1u), std::max<std::size_t>(todo.size(), 1));
  {
    std::vector<std::jthread> workers;
    workers.reserve(thread_count);
    try {
      for (std::size_t t = 1; t < thread_count; ++t) workers.emplace_back(worker);
    } catch (const std::system_error& e) {
      abort.request_stop();  // joins the ones that started, then reports
      first_error.set(std::make_exception_ptr(IoError(std::string("cannot start reader thread: ") + e.what())));
    }
    worker();  // the calling thread works too
  }
  if (chooser_.chunks() > 0) {
    log::debug("cached files: {} chunks; per chunk and thread, map {:.2f} GB/s, pread {:.2f} GB/s; faster: {}",
               chooser_.chunks(), chooser_.bytes_per_second(CachedReadChooser::kMap) / 1e9,
               chooser_.bytes_per_second(CachedReadChooser::kPread) / 1e9,
               chooser_.faster() == CachedReadChooser::kMap ? "map" : "pread");
  }
  if (auto e = first_error.get()) std::rethrow_exception(e);
}

bool same_files(const Checkpoint& a, const Checkpoint& b) {
  if (a.files.size() != b.files.size()) return false;
  for (std::size_t i = 0; i < a.files.size(); ++i) {
    const CheckpointFile& x = a.files[i];
    const CheckpointFile& y = b.files[i];
    if (x.path != y.path || x.name_prefix != y.name_prefix || x.stat.size != y.stat.size ||
        x.stat.mtime_ns != y.stat.mtime_ns || x.stat.inode != y.stat.inode) {
      return false;
    }
  }
  return true;
}

}  // namespace pinload::detail
