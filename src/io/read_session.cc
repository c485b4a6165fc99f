#include "io/read_session.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "base/log.h"
#include "source/sources.h"
#include "memory/first_touch.h"
#include "memory/huge_page_collapse.h"
#include "os/read_full.h"
#include "pinload/error.h"
#include "pinload/file_identity.h"
#include "pinload/memory_limit.h"
#include "pinload/numa.h"

namespace pinload::detail {

namespace {

using Clock = std::chrono::steady_clock;


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

// Whether the load's last file will be read direct, as its source decides it
// at open (Note [Tapered tail] in read_plan.h): a cached file is copied from
// a mapping, where small chunks cost more (Note [Block size] in loader.h).
bool ends_in_direct_reads(Env* env, const ReadOptions& options, const OpenFile& last) {
  if (last.remote || last.source->network_filesystem() || options.direct == DirectIo::kOff) return false;
  if (options.direct == DirectIo::kOn) return true;
  FileStat st;
  const ScopedFd fd = open_regular_or_throw(env, last.source->path(), &st);
  return env->resident_fraction(fd.get(), st.size, kResidencySamples) < options.resident_threshold;
}

// Executes one chunk: reads [offset, offset + valid) of the file to `dest`,
// from the source's mapping where it has one (Note [Mapped reads]) and
// `chooser` (null: always map) picks it. A direct read that fell back to
// buffered counts the file as buffered.
void read_chunk(OpenFile& f, const ReadChunk& c, CachedReadChooser* chooser, ReadCounters* counters, std::byte* dest) {
  ByteSource& source = *f.source;
  if (!source.mapped()) {
    source.read(c.offset, c.valid, dest, c.length);
    if (f.counted_direct.load(std::memory_order_relaxed) && !source.direct() && f.counted_direct.exchange(false)) {
      counters->files_direct--;
      counters->files_buffered++;
    }
    return;
  }
  if (chooser == nullptr) {
    if (!source.copy_mapped(c.offset, c.valid, dest)) source.read(c.offset, c.valid, dest, c.valid);
    return;
  }
  const CachedReadChooser::Method method = chooser->next();
  const Clock::time_point start = Clock::now();
  if (method == CachedReadChooser::kMap && !source.copy_mapped(c.offset, c.valid, dest)) {
    // Fell back: this pread says nothing about either method.
    source.read(c.offset, c.valid, dest, c.valid);
    return;
  }
  if (method == CachedReadChooser::kPread) source.read(c.offset, c.valid, dest, c.valid);
  chooser->record(method, c.valid, nanoseconds_since(start));
}

}  // namespace

void ReadSession::open_in_flight(std::size_t index, std::stop_token stop, ReadCounters* counters) {
  OpenFile& f = *files_[index];
  if (f.opened.load(std::memory_order_acquire)) return;
  std::lock_guard lock(f.mu);
  if (f.opened.load(std::memory_order_relaxed) || f.closed) return;
  {
    std::unique_lock open_lock(open_mu_);
    if (!open_cv_.wait(open_lock, stop, [&] { return open_files_ < max_open_files_; })) {
      throw CancelledError("load cancelled", ErrorContext{f.path});
    }
    ++open_files_;
  }
  try {
    f.source->open();
  } catch (...) {
    {
      std::lock_guard open_lock(open_mu_);
      --open_files_;
    }
    open_cv_.notify_all();
    throw;
  }
  const bool direct = f.source->direct();
  f.counted_direct.store(direct, std::memory_order_relaxed);
  (direct ? counters->files_direct : counters->files_buffered)++;
  if (!direct && f.source->mapped()) counters->files_mapped++;
  f.opened.store(true, std::memory_order_release);
}

void ReadSession::close_in_flight(std::size_t index) {
  OpenFile& f = *files_[index];
  {
    std::lock_guard lock(f.mu);
    if (f.closed || !f.opened.load(std::memory_order_relaxed)) return;
    f.source->close();
    f.closed = true;
  }
  {
    std::lock_guard open_lock(open_mu_);
    --open_files_;
  }
  open_cv_.notify_all();
}

namespace {

// The most files whose chunks interleave in the claim order of `plan`
// (Note [Files in flight]); at least 1.
std::size_t interleaved_files(const ReadPlan& plan) {
  const std::size_t n = plan.files.size();
  std::vector<std::size_t> first(n, SIZE_MAX), last(n, 0);
  for (std::size_t k = 0; k < plan.chunks.size(); ++k) {
    const std::uint32_t f = plan.chunks[k].file;
    first[f] = std::min(first[f], k);
    last[f] = k;
  }
  std::vector<std::int64_t> delta(plan.chunks.size() + 1, 0);
  for (std::size_t f = 0; f < n; ++f) {
    if (first[f] == SIZE_MAX) continue;
    ++delta[first[f]];
    --delta[last[f] + 1];
  }
  std::int64_t open = 0, most = 1;
  for (std::int64_t d : delta) most = std::max(most, open += d);
  return static_cast<std::size_t>(most);
}

}  // namespace

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

void ReadSession::release_block(std::size_t file) {
  // Called from execute()'s sink after the file's last chunk: no reader
  // touches the block again.
  files_.at(file)->block.reset();
}

void ReadSession::count_files(ReadCounters* counters) const {
  counters->files_direct = 0;
  counters->files_buffered = 0;
  for (const auto& f : files_) {
    if (f->opened) (f->counted_direct ? counters->files_direct : counters->files_buffered)++;  // the rest count as they open
  }
  counters->bytes_total = plan_.total_bytes;
  counters->bytes_done = bytes_done();
}

std::unique_ptr<ReadSession> ReadSession::open(Env* env, const ReadOptions& options, Checkpoint checkpoint,
                                               std::shared_ptr<Pool> staging_pool, const TemplateReads* replay,
                                               ReadCounters* counters) {
  std::unique_ptr<ReadSession> s(new ReadSession);
  s->env_ = env;
  s->options_ = options;
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
    f->path = cf.path;
    FileRead r;
    r.path = cf.path;
    r.file_size = cf.stat.size;
    r.data_offset = cf.header.data_offset();
    // Buffered and direct reads use the same aligned ranges, so a file takes
    // the same block (size class) whether it is read direct or through the
    // cache; the alignment comes from the header read's stat of the same file.
    r.alignment = std::max(cf.stat.dio_offset_align, kFallbackDirectAlign);
    // Readers are decided here, from the paths, not from opened files (those
    // open at their first chunk: Note [Files in flight]).
    f->source = open_byte_source(env, source_file(cf),
                                 SourceOptions{options.direct, options.cached_read, options.resident_threshold, options.remote});
    if (options.wrap_source) f->source = options.wrap_source(std::move(f->source));
    f->remote = f->source->connections() != 0;
    if (f->remote) s->remote_threads_ = f->source->connections();
    if (f->source->network_filesystem()) s->min_threads_ = effective_connections(options.remote);
    reads.push_back(std::move(r));
    s->files_.push_back(std::move(f));
  }
  PlanOptions plan_options{options.block_size, options.files_in_flight};
  s->plan_ = make_read_plan(std::move(reads), plan_options);
  // Note [Tapered tail] in read_plan.h: where the load ends in direct reads
  // into pool blocks, not into staging blocks (each is the block size
  // whatever the read, so short reads would leave fewer in flight).
  const std::uint64_t taper_bytes = std::uint64_t{kDirectReadsInFlight} * kTaperBlockSize;
  if (s->plan_.total_bytes > 4 * taper_bytes && !s->streaming() && s->remote_threads_ == 0 && s->min_threads_ == 0 &&
      ends_in_direct_reads(env, options, *s->files_[s->plan_.chunks.back().file])) {
    plan_options.taper_bytes = taper_bytes;
    plan_options.taper_block_size = kTaperBlockSize;
    taper_tail(s->plan_, plan_options);
  }
  if (replay != nullptr) {
    if (std::optional<ReadPlan> replayed = replay_plan(s->plan_, replay->reads)) {
      s->plan_ = std::move(*replayed);
    } else {
      log::warn("the I/O template's reads for \"{}\" do not tile the checkpoint's files; using the default plan",
                replay->destination);
    }
  }
  counters->bytes_total = s->plan_.total_bytes;
  for (const ReadChunk& c : s->plan_.chunks) {
    s->files_[c.file]->chunks_left.fetch_add(1, std::memory_order_relaxed);
    s->files_[c.file]->chunks_in_hand.fetch_add(1, std::memory_order_relaxed);
  }
  // Files of one chunk each interleave with none: files_in_flight of them
  // may still be open at once (Note [Files in flight]).
  s->max_open_files_ = std::max(interleaved_files(s->plan_), std::min(options.files_in_flight, s->files_.size()));
  s->done_ = std::make_unique<std::atomic<bool>[]>(s->plan_.chunks.size());
  if (s->streaming()) s->staged_.resize(s->plan_.chunks.size());
  return s;
}

void ReadSession::set_budget(std::unique_ptr<StreamBudget> budget) {
  check_idle("set_budget()");
  budget_ = std::move(budget);
}

void ReadSession::take_blocks_up_to(std::size_t file, std::stop_token stop) {
  if (file < blocks_taken_.load(std::memory_order_acquire)) return;
  // One worker waits for the budget at a time; the others wait only for the
  // block of their own file, so readers of files already given one go on.
  std::unique_lock lock(budget_mu_);
  while (file >= blocks_taken_.load(std::memory_order_relaxed) && file < files_.size()) {
    if (taking_block_) {
      if (!budget_cv_.wait(lock, stop, [&] { return !taking_block_ || file < blocks_taken_.load(); })) {
        throw CancelledError("load cancelled", ErrorContext{files_[file]->path});
      }
      continue;
    }
    const std::size_t i = blocks_taken_.load(std::memory_order_relaxed);
    OpenFile& f = *files_[i];
    taking_block_ = true;
    lock.unlock();
    std::shared_ptr<Block> block;
    try {
      block = budget_->allocate(plan_.files[i].block_bytes(), f.path, stop);
    } catch (...) {
      lock.lock();
      taking_block_ = false;
      budget_cv_.notify_all();
      throw;
    }
    lock.lock();
    f.block = std::move(block);
    if (f.chunks_left.load(std::memory_order_relaxed) > 0) budget_->file_started();
    blocks_taken_.store(i + 1, std::memory_order_release);
    taking_block_ = false;
    budget_cv_.notify_all();
  }
}

namespace {

// Note [Memory limits]: what a load may still take of host memory, with what
// the pool holds idle (it is reused; the rest is new). Through the
// process-wide Env: a test Env that injects faults into the checkpoint's
// reads must not see these.
struct MemoryRoom {
  std::uint64_t bytes = 0;
  HostMemoryLimit limit;
};

std::optional<MemoryRoom> memory_room(const Pool& pool) {
  std::optional<HostMemoryLimit> limit = read_host_memory_limit(default_env());
  if (!limit) return std::nullopt;
  const PoolStats stats = pool.stats();
  const std::uint64_t idle = stats.reserved_bytes > stats.in_use_bytes ? stats.reserved_bytes - stats.in_use_bytes : 0;
  return MemoryRoom{limit->available_bytes + idle, std::move(*limit)};
}

[[noreturn]] void throw_out_of_host_memory(const MemoryRoom& room, std::uint64_t block_bytes,
                                           std::uint64_t beside_bytes, const std::string& path) {
  std::string parts;
  if (beside_bytes != 0) {
    parts = " (" + std::to_string(block_bytes) + " for the files' blocks, " + std::to_string(beside_bytes) +
            " beside them: converted output, staging or a stand-in device's memory)";
  }
  throw OutOfMemoryError("checkpoint needs " + std::to_string(block_bytes + beside_bytes) + " bytes of host memory" +
                             parts + ", more than the " + std::to_string(room.limit.available_bytes) +
                             " bytes the memory limit leaves (" + room.limit.source + ")",
                         ErrorContext{path});
}

}  // namespace

void ReadSession::allocate_blocks(Pool& pool, std::stop_token stop, std::uint64_t beside_bytes) {
  check_idle("allocate_blocks()");
  if (streaming() || budget_) {
    if (budget_) {  // Note [Streaming within a budget]
      for (std::size_t i = 0; i < files_.size(); ++i) budget_->check_fits(plan_.files[i].block_bytes(), files_[i]->path);
    }
    const std::optional<MemoryRoom> room = beside_bytes != 0 ? memory_room(pool) : std::nullopt;
    if (room && beside_bytes > room->bytes) {
      throw_out_of_host_memory(*room, 0, beside_bytes, files_.empty() ? std::string{} : files_.front()->path);
    }
    return;
  }
  // A load holds its blocks until it ends, so one that cannot fit the budget
  // fails now instead of waiting for memory only it could free. The error
  // names the file whose block crosses the line.
  std::uint64_t need = 0;
  std::size_t crossing = 0;
  auto blocks_up_to = [&](std::uint64_t limit) {
    need = 0;
    crossing = files_.size();
    for (std::size_t i = 0; i < files_.size(); ++i) {
      if (files_[i]->block) continue;
      need += Pool::size_class(std::max<std::uint64_t>(plan_.files[i].block_bytes(), 1));
      if (need > limit && crossing == files_.size()) crossing = i;
    }
    return crossing == files_.size();
  };
  auto file_at = [&](std::size_t i) { return crossing < files_.size() ? files_[i]->path : std::string{}; };
  if (const std::uint64_t capacity = pool.options().capacity_bytes; capacity != 0 && !blocks_up_to(capacity)) {
    throw OutOfMemoryError("checkpoint needs " + std::to_string(need) + " bytes of pool memory; the pool budget is " +
                               std::to_string(capacity) + " bytes",
                           ErrorContext{file_at(crossing)});
  }
  if (const std::optional<MemoryRoom> room = memory_room(pool)) {
    const std::uint64_t left = room->bytes > beside_bytes ? room->bytes - beside_bytes : 0;
    if (!blocks_up_to(left)) throw_out_of_host_memory(*room, need, beside_bytes, file_at(crossing));
  }
  for (std::size_t i = 0; i < files_.size(); ++i) {
    if (files_[i]->block) continue;
    try {
      files_[i]->block = pool.allocate(plan_.files[i].block_bytes(), stop);
    } catch (const OutOfMemoryError& e) {  // the pool's budget, held by other loads: name the file
      if (!e.context().file.empty()) throw;
      throw OutOfMemoryError(e.message(), ErrorContext{files_[i]->path});
    }
  }
}

namespace {

// A load's `threads` slots for work on the CPU. Not std::counting_semaphore:
// libstdc++'s release() skips the wake-up where the count is already
// positive, so two waiters and two releases can leave one asleep for good
// (GCC bug 98033; a reader of convert_test hung on it, every slot free).
class CpuSlots {
 public:
  explicit CpuSlots(unsigned count) : free_(count) {}
  void acquire() {
    std::unique_lock lock(mu_);
    freed_.wait(lock, [&] { return free_ > 0; });
    --free_;
  }
  void release() {
    {
      std::lock_guard lock(mu_);
      ++free_;
    }
    freed_.notify_one();
  }

 private:
  std::mutex mu_;
  std::condition_variable freed_;
  unsigned free_;
};

// One of the slots, held while it lasts.
class CpuSlot {
 public:
  explicit CpuSlot(CpuSlots& slots) : slots_(slots) { slots_.acquire(); }
  ~CpuSlot() { slots_.release(); }
  CpuSlot(const CpuSlot&) = delete;
  CpuSlot& operator=(const CpuSlot&) = delete;

 private:
  CpuSlots& slots_;
};

}  // namespace

std::uint64_t LoadStages::now() noexcept {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count());
}

void LoadStages::reset() noexcept {
  for (std::atomic<std::uint64_t>* a : {&gate, &staging, &slot, &fault_in, &read, &sink, &queued, &convert, &idle,
                                        &plan, &finish, &edges, &chunks, &converted, &last_read_end,
                                        &last_convert_end}) {
    a->store(0, std::memory_order_relaxed);
  }
  first_read_start.store(UINT64_MAX, std::memory_order_relaxed);
}

void LoadStages::add_read_span(std::uint64_t start, std::uint64_t end) noexcept {
  std::uint64_t first = first_read_start.load(std::memory_order_relaxed);
  while (start < first && !first_read_start.compare_exchange_weak(first, start, std::memory_order_relaxed)) {
  }
  std::uint64_t last = last_read_end.load(std::memory_order_relaxed);
  while (end > last && !last_read_end.compare_exchange_weak(last, end, std::memory_order_relaxed)) {
  }
}

void LoadStages::add_convert_end(std::uint64_t end) noexcept {
  std::uint64_t last = last_convert_end.load(std::memory_order_relaxed);
  while (end > last && !last_convert_end.compare_exchange_weak(last, end, std::memory_order_relaxed)) {
  }
}

LoadStages& load_stages() noexcept {
  static LoadStages stages;
  return stages;
}

void ReadSession::execute(const std::vector<std::size_t>& todo, unsigned threads, std::stop_token stop,
                          ReadCounters* counters, const std::vector<int>& cpus, const ChunkSink& sink,
                          const ChunkGate& gate) {
  if (executing_.exchange(true, std::memory_order_acq_rel)) {
    throw InvalidArgumentError("execute() while another execute() runs on the session");
  }
  struct Idle {
    std::atomic<bool>& executing;
    ~Idle() { executing.store(false, std::memory_order_release); }
  } idle{executing_};
  const detail::ReadsInFlight reading;  // Note [Huge pages for a kept pool]
  if (const unsigned network = network_readers(threads); network != 0) threads = network;  // Note [Remote reads]
  threads = std::max(threads, 1u);
  CpuSlots cpu_slots(threads);
  // Note [Direct reads in flight]: readers beyond `threads` only wait on the device.
  const unsigned reader_count =
      remote_threads_ == 0 && direct_mode_ != DirectIo::kOff ? std::max(threads, kDirectReadsInFlight) : threads;
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
        if (s.budget_) s.take_blocks_up_to(c.file, abort.get_token());  // Note [Streaming within a budget]
        s.open_in_flight(c.file, abort.get_token(), counters);
        // Note [Load stages]: t[k] ends stage k.
        std::uint64_t t0 = LoadStages::now();
        if (gate) {
          gate(abort.get_token());
          if (abort.stop_requested()) return;
        }
        const std::uint64_t t_gate = LoadStages::now();
        // Streaming reads into a staging block of the chunk's own, of one
        // size for every chunk (a short chunk reuses a block any other load
        // left idle); the others into the file's block.
        std::shared_ptr<Block> dest =
            s.streaming() ? s.staging_pool_->allocate(std::max<std::size_t>(c.length, s.options_.block_size), abort.get_token())
                          : f.block;
        const std::size_t dest_offset = s.streaming() ? 0 : c.offset - r.read_begin;
        const std::uint64_t t_staging = LoadStages::now();
        // Note [Direct reads in flight]: a read that waits on the device or
        // the network takes no slot; a copy out of the page cache does.
        std::optional<CpuSlot> slot;
        if (!f.source->direct() && !f.remote && !f.source->network_filesystem()) slot.emplace(cpu_slots);
        const std::uint64_t t_slot = LoadStages::now();
        // Note [Page size of fresh memory]
        FirstTouch::process().fault_in(s.env_, *dest, dest->data() + dest_offset, c.valid);
        const std::uint64_t t_fault = LoadStages::now();
        read_chunk(f, c, s.cached_read_ == CachedRead::kAuto ? &s.chooser_ : nullptr, counters,
                   dest->data() + dest_offset);
        const std::uint64_t t_read = LoadStages::now();
        LoadStages& stages = load_stages();
        stages.gate.fetch_add(t_gate - t0, std::memory_order_relaxed);
        stages.staging.fetch_add(t_staging - t_gate, std::memory_order_relaxed);
        stages.slot.fetch_add(t_slot - t_staging, std::memory_order_relaxed);
        stages.fault_in.fetch_add(t_fault - t_slot, std::memory_order_relaxed);
        stages.read.fetch_add(t_read - t_fault, std::memory_order_relaxed);
        stages.chunks.fetch_add(1, std::memory_order_relaxed);
        stages.add_read_span(t_fault, t_read);
        counters->bytes_done.fetch_add(c.valid, std::memory_order_relaxed);
        {
          std::lock_guard lock(s.completed_mu_);
          s.completed_.push_back(static_cast<std::uint32_t>(i));
        }
        s.done_[i].store(true, std::memory_order_release);
        const bool file_read = f.chunks_left.fetch_sub(1, std::memory_order_acq_rel) == 1;
        if (file_read) s.close_in_flight(c.file);
        t0 = LoadStages::now();
        if (!slot) slot.emplace(cpu_slots);  // the sink's work (conversions, hand-out) is the CPU's
        const std::uint64_t t_sink_slot = LoadStages::now();
        if (sink) sink(i, std::move(dest), dest_offset);
        dest.reset();
        slot.reset();
        stages.slot.fetch_add(t_sink_slot - t0, std::memory_order_relaxed);
        stages.sink.fetch_add(LoadStages::now() - t_sink_slot, std::memory_order_relaxed);
        // Its tensors are out and no reader holds its block: only the
        // consumer can give it back now (Note [Streaming within a budget]).
        if (s.budget_ && f.chunks_in_hand.fetch_sub(1, std::memory_order_acq_rel) == 1) s.budget_->file_finished();
      }
    } catch (...) {
      first_error.set(std::current_exception());
      abort.request_stop();
    }
  };
  const std::size_t thread_count = std::min<std::size_t>(reader_count, std::max<std::size_t>(todo.size(), 1));
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

unsigned ReadSession::network_readers(unsigned threads) const noexcept {
  if (remote_threads_ != 0) return remote_threads_;
  return min_threads_ != 0 ? std::max(threads, min_threads_) : 0;
}

std::uint64_t file_block_charge(const Pool& pool, const CheckpointFile& cf) {
  return pool.own_reservation_for(cf.stat.size + std::max<std::uint64_t>(cf.stat.dio_offset_align, kFallbackDirectAlign));
}

bool same_files(const Checkpoint& a, const Checkpoint& b) {
  if (a.files.size() != b.files.size()) return false;
  for (std::size_t i = 0; i < a.files.size(); ++i) {
    const CheckpointFile& x = a.files[i];
    const CheckpointFile& y = b.files[i];
    if (x.path != y.path || x.name_prefix != y.name_prefix || FileIdentity::of(x.stat) != FileIdentity::of(y.stat)) {
      return false;
    }
  }
  return true;
}

}  // namespace pinload::detail
