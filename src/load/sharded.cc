#include "pinload/shard.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <regex>
#include <thread>

#include "base/log.h"
#include "pinload/error.h"

namespace pinload {

namespace {

constexpr std::uint64_t kDestAlign = 256;       // each tensor part's offset in its batch
constexpr std::uint32_t kDefaultDirectAlign = 4096;

std::uint64_t round_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }
std::uint64_t product(const std::vector<std::uint64_t>& v, std::size_t from, std::size_t to) {
  std::uint64_t p = 1;
  for (std::size_t i = from; i < to; ++i) p *= v[i];
  return p;
}

// The rule index matching `name`, or -1.
int match_rule(const std::vector<std::regex>& rules, const std::string& name) {
  for (std::size_t i = 0; i < rules.size(); ++i)
    if (std::regex_search(name, rules[i])) return static_cast<int>(i);
  return -1;
}

// Appends the pieces of tensor `t` (this rank's part) at dest_offset, each
// at most `max_piece` long.
void add_pieces(const ShardTensor& t, std::uint64_t max_piece, std::vector<ShardPiece>* out) {
  auto push = [&](std::uint64_t offset, std::uint64_t length, std::uint64_t dest) {
    for (std::uint64_t done = 0; done < length; done += max_piece)
      out->push_back(ShardPiece{offset + done, std::min(max_piece, length - done), dest + done});
  };
  if (t.nbytes == 0) return;
  if (t.dim == kReplicated) {
    push(t.file_offset, t.nbytes, t.dest_offset);
    return;
  }
  const auto d = static_cast<std::size_t>(t.dim);
  const std::uint64_t inner_bits = product(t.shape, d + 1, t.shape.size()) * dtype_bits(t.dtype);
  const std::uint64_t row_bytes = inner_bits / 8;  // one index of `dim`
  const std::uint64_t outer = product(t.shape, 0, d);
  const std::uint64_t stride = t.shape[d] * row_bytes;
  const std::uint64_t part = (t.end - t.begin) * row_bytes;
  for (std::uint64_t o = 0; o < outer; ++o) push(t.file_offset + o * stride + t.begin * row_bytes, part, t.dest_offset + o * part);
}

}  // namespace

std::vector<std::uint64_t> ShardTensor::part_shape() const {
  std::vector<std::uint64_t> s = shape;
  if (dim != kReplicated) s[static_cast<std::size_t>(dim)] = end - begin;
  return s;
}

ShardPlan make_shard_plan(const Checkpoint& checkpoint, const ShardSpec& spec, std::vector<FileRead> files,
                          const ShardPlanOptions& options) {
  if (spec.world_size < 1 || spec.rank < 0 || spec.rank >= spec.world_size)
    throw InvalidFileError("shard spec: rank " + std::to_string(spec.rank) + " outside world size " +
                           std::to_string(spec.world_size));
  std::vector<std::regex> rules;
  for (const ShardRule& r : spec.rules) {
    try {
      rules.emplace_back(r.pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw InvalidFileError("shard rule: bad pattern '" + r.pattern + "': " + e.what());
    }
  }
  ShardPlan plan;
  plan.spec = spec;
  if (files.empty()) {
    for (const CheckpointFile& f : checkpoint.files) {
      FileRead r;
      r.path = f.path;
      r.file_size = f.header.file_size;
      r.data_offset = f.header.data_offset();
      files.push_back(std::move(r));
    }
  }
  if (files.size() != checkpoint.files.size()) throw InvalidFileError("shard plan: one FileRead per file expected");
  const auto world = static_cast<std::uint64_t>(spec.world_size);
  const auto rank = static_cast<std::uint64_t>(spec.rank);

  // Every tensor, in load order, with its split.
  std::uint64_t replicated_bytes = 0;
  for (std::uint32_t fi = 0; fi < checkpoint.files.size(); ++fi) {
    const CheckpointFile& cf = checkpoint.files[fi];
    for (const TensorInfo& info : cf.header.tensors) {
      ShardTensor t;
      t.name = cf.name_prefix + info.name;
      t.file = fi;
      t.dtype = info.dtype;
      t.shape = info.shape;
      t.file_offset = cf.header.data_offset() + info.begin;
      const int rule = match_rule(rules, t.name);
      t.dim = rule < 0 ? kReplicated : spec.rules[static_cast<std::size_t>(rule)].dim;
      if (t.dim != kReplicated) {
        if (t.dim < 0 || static_cast<std::size_t>(t.dim) >= t.shape.size())
          throw InvalidFileError("shard rule '" + spec.rules[static_cast<std::size_t>(rule)].pattern + "': dim " +
                                     std::to_string(t.dim) + " outside the tensor's " +
                                     std::to_string(t.shape.size()) + " dimensions",
                                 ErrorContext{cf.path, t.name});
        const auto d = static_cast<std::size_t>(t.dim);
        if (product(t.shape, d + 1, t.shape.size()) * dtype_bits(t.dtype) % 8 != 0)
          throw InvalidFileError("shard rule: a split on dim " + std::to_string(t.dim) +
                                     " cuts the tensor's elements inside a byte",
                                 ErrorContext{cf.path, t.name});
        const std::uint64_t n = t.shape[d];
        t.begin = n * rank / world;
        t.end = n * (rank + 1) / world;
        t.nbytes = product(t.shape, 0, d) * (t.end - t.begin) * (product(t.shape, d + 1, t.shape.size()) *
                                                                  dtype_bits(t.dtype) / 8);
        t.read = true;
      } else {
        t.nbytes = info.nbytes();
        if (spec.mode == ShardMode::kSlice) t.read = true;
        else replicated_bytes += t.nbytes;
      }
      plan.tensors.push_back(std::move(t));
    }
  }

  // kShare: windows of replicated bytes in load order; in each, owners balance the ranks' bytes.
  if (spec.mode == ShardMode::kShare) {
    const std::uint64_t window = spec.window_bytes == 0 ? ~std::uint64_t{0} : spec.window_bytes;
    std::vector<std::vector<std::uint32_t>> windows(1);
    std::uint64_t in_window = 0;
    std::uint32_t current = 0;
    for (std::uint32_t i = 0; i < plan.tensors.size(); ++i) {
      ShardTensor& t = plan.tensors[i];
      if (t.dim == kReplicated) {
        if (in_window != 0 && in_window + t.nbytes > window) {
          windows.emplace_back();
          ++current;
          in_window = 0;
        }
        windows.back().push_back(i);
        in_window += t.nbytes;
      }
      t.window = current;
    }
    std::vector<std::uint64_t> load(static_cast<std::size_t>(spec.world_size), 0);
    for (std::vector<std::uint32_t>& w : windows) {
      if (spec.window_bytes == 0) {
        // One window: contiguous ranges of about equal bytes, each rank one sequential sweep.
        std::uint64_t at = 0;
        for (std::uint32_t i : w) {
          ShardTensor& t = plan.tensors[i];
          t.owner = static_cast<int>(std::min<std::uint64_t>(world - 1, at * world / std::max<std::uint64_t>(replicated_bytes, 1)));
          at += t.nbytes;
        }
        continue;
      }
      // Largest first, each to the rank with the fewest bytes so far (ties: the lowest rank).
      std::vector<std::uint32_t> order = w;
      std::stable_sort(order.begin(), order.end(),
                       [&](std::uint32_t x, std::uint32_t y) { return plan.tensors[x].nbytes > plan.tensors[y].nbytes; });
      for (std::uint32_t i : order) {
        const auto r = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
        plan.tensors[i].owner = static_cast<int>(r);
        load[r] += plan.tensors[i].nbytes;
      }
    }
    for (ShardTensor& t : plan.tensors)
      if (t.dim == kReplicated) t.read = t.owner == spec.rank;
  }

  // Batches: destination offsets; a new batch at a window change or once full.
  const std::uint64_t max_piece = std::max<std::uint64_t>(options.block_size, 4096);
  std::optional<std::uint32_t> last_window;
  for (std::uint32_t i = 0; i < plan.tensors.size(); ++i) {
    ShardTensor& t = plan.tensors[i];
    if (!t.read) continue;
    const bool new_window = spec.mode == ShardMode::kShare && last_window && *last_window != t.window;
    if (plan.batches.empty() || new_window ||
        (options.batch_bytes != 0 && plan.batches.back().dest_bytes != 0 &&
         plan.batches.back().dest_bytes + t.nbytes > options.batch_bytes)) {
      plan.batches.emplace_back();
    }
    last_window = t.window;
    ShardBatch& b = plan.batches.back();
    t.batch = static_cast<std::uint32_t>(plan.batches.size() - 1);
    t.dest_offset = b.dest_bytes;
    b.dest_bytes = round_up(b.dest_bytes + t.nbytes, kDestAlign);
    b.tensors.push_back(i);
  }

  // Pieces and merged aligned reads, batch by batch, file by file.
  for (std::uint32_t bi = 0; bi < plan.batches.size(); ++bi) {
    ShardBatch& b = plan.batches[bi];
    plan.dest_bytes += b.dest_bytes;
    b.first_read = static_cast<std::uint32_t>(plan.reads.size());
    std::vector<std::pair<std::uint32_t, ShardPiece>> pieces;  // (file, piece)
    for (std::uint32_t ti : b.tensors) {
      std::vector<ShardPiece> own;
      add_pieces(plan.tensors[ti], max_piece, &own);
      for (const ShardPiece& p : own) pieces.emplace_back(plan.tensors[ti].file, p);
    }
    std::stable_sort(pieces.begin(), pieces.end(), [](const auto& x, const auto& y) {
      return x.first != y.first ? x.first < y.first : x.second.file_offset < y.second.file_offset;
    });
    for (const auto& [fi, piece] : pieces) {
      const FileRead& f = files[fi];
      const std::uint64_t align = std::max<std::uint32_t>(f.alignment, 1);
      const std::uint64_t lo = piece.file_offset / align * align;
      const std::uint64_t hi = round_up(piece.file_offset + piece.length, align);
      ShardRead* last = plan.reads.size() > b.first_read ? &plan.reads.back() : nullptr;
      if (last != nullptr && last->file == fi && lo <= last->offset + last->length + options.max_gap &&
          std::max(hi, last->offset + last->length) - last->offset <= max_piece + 2 * align) {
        last->length = std::max(hi, last->offset + last->length) - last->offset;
        ++last->piece_count;
      } else {
        ShardRead r;
        r.file = fi;
        r.offset = lo;
        r.length = hi - lo;
        r.first_piece = static_cast<std::uint32_t>(plan.pieces.size());
        r.piece_count = 1;
        plan.reads.push_back(r);
      }
      plan.pieces.push_back(piece);
    }
    b.read_count = static_cast<std::uint32_t>(plan.reads.size()) - b.first_read;
  }
  for (ShardRead& r : plan.reads) {
    r.valid = std::min(r.offset + r.length, files[r.file].file_size) - r.offset;
    plan.read_bytes += r.valid;
  }
  plan.files = std::move(files);
  return plan;
}

// ---- execution ----

struct ShardLoad::State {
  Env* env = nullptr;
  ShardLoadOptions options;
  std::shared_ptr<Pool> pool;
  Checkpoint checkpoint;
  ShardPlan plan;
  std::vector<std::unique_ptr<ByteSource>> sources;  // per file, open (Note [Byte sources])
  std::size_t staging_bytes = 0;
  std::atomic<std::uint64_t> bytes_read{0};

  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::optional<StateDict>> ready;  // per batch, until handed out
  std::size_t next_out = 0;
  std::exception_ptr error;
  std::stop_source stop;
  std::jthread producer;

  // Reads batch `bi` into a block of its own and returns its tensors.
  StateDict read_batch(std::uint32_t bi);
  void read_one(const ShardRead& r, std::byte* staging, std::byte* dest);
  void run();
};

void ShardLoad::State::read_one(const ShardRead& r, std::byte* staging, std::byte* dest) {
  sources[r.file]->read(r.offset, r.valid, staging, r.length);
  const std::uint64_t got = r.valid;
  bytes_read.fetch_add(got, std::memory_order_relaxed);
  for (std::uint32_t k = 0; k < r.piece_count; ++k) {
    const ShardPiece& p = plan.pieces[r.first_piece + k];
    std::memcpy(dest + p.dest_offset, staging + (p.file_offset - r.offset), static_cast<std::size_t>(p.length));
  }
}

StateDict ShardLoad::State::read_batch(std::uint32_t bi) {
  const ShardBatch& b = plan.batches[bi];
  std::shared_ptr<Block> block = pool->allocate(std::max<std::uint64_t>(b.dest_bytes, 1), stop.get_token());
  std::atomic<std::uint32_t> next{0};
  std::mutex err_mu;
  std::exception_ptr err;
  auto worker = [&] {
    int map_err = 0;
    void* staging = env->map_anonymous(staging_bytes, 0, &map_err);
    if (staging == nullptr) {
      std::lock_guard lock(err_mu);
      if (!err) err = std::make_exception_ptr(OutOfMemoryError("shard staging buffer: " + std::string(std::strerror(map_err))));
      return;
    }
    try {
      for (;;) {
        if (stop.stop_requested()) throw CancelledError("shard load stopped");
        {
          std::lock_guard lock(err_mu);
          if (err) break;
        }
        const std::uint32_t k = next.fetch_add(1);
        if (k >= b.read_count) break;
        read_one(plan.reads[b.first_read + k], static_cast<std::byte*>(staging), block->data());
      }
    } catch (...) {
      std::lock_guard lock(err_mu);
      if (!err) err = std::current_exception();
    }
    env->unmap(staging, staging_bytes);
  };
  {
    const unsigned n = std::max(1u, std::min<unsigned>(options.threads, b.read_count));
    std::vector<std::jthread> workers;
    for (unsigned i = 1; i < n; ++i) workers.emplace_back(worker);
    worker();
  }
  if (err) std::rethrow_exception(err);
  std::vector<Tensor> tensors;
  for (std::uint32_t ti : b.tensors) {
    const ShardTensor& t = plan.tensors[ti];
    tensors.emplace_back(t.name, t.dtype, t.part_shape(), block, static_cast<std::size_t>(t.dest_offset), t.nbytes);
  }
  StateDict out(std::move(tensors));
  std::vector<std::string> paths;  // StateDict::at names them
  for (const CheckpointFile& f : checkpoint.files) paths.push_back(f.path);
  out.set_files(std::move(paths));
  return out;
}

void ShardLoad::State::run() {
  // At most one batch read ahead of the one handed out (Note [Shard batches]).
  for (std::uint32_t bi = 0; bi < plan.batches.size(); ++bi) {
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return stop.stop_requested() || bi <= next_out + 1; });
      if (stop.stop_requested()) return;
    }
    try {
      StateDict sd = read_batch(bi);
      std::lock_guard lock(mu);
      ready[bi] = std::move(sd);
    } catch (...) {
      std::lock_guard lock(mu);
      error = std::current_exception();
      cv.notify_all();
      return;
    }
    cv.notify_all();
  }
}

ShardLoad::ShardLoad(const std::vector<std::string>& paths, const ShardSpec& spec, const ShardLoadOptions& options,
                     std::shared_ptr<Pool> pool, Env* env) {
  if (env == nullptr) env = default_env();
  Checkpoint checkpoint = open_checkpoint(env, paths);
  state_ = std::make_unique<State>();
  State& s = *state_;
  s.env = env;
  s.options = options;
  s.pool = pool ? std::move(pool) : Pool::create_default();
  std::vector<FileRead> files;
  std::uint32_t max_align = 1;
  for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
    const CheckpointFile& cf = checkpoint.files[i];
    FileRead r;
    r.path = cf.path;
    r.file_size = cf.header.file_size;
    r.data_offset = cf.header.data_offset();
    // Direct where the options ask and the file is not cached (Note [Direct
    // I/O] in loader.h); the source goes buffered if O_DIRECT is refused.
    SourceOptions so;
    so.direct = options.direct ? DirectIo::kAuto : DirectIo::kOff;
    std::unique_ptr<ByteSource> source =
        open_byte_source(env, source_file(cf), so);
    if (options.wrap_source) source = options.wrap_source(std::move(source));
    source->open();
    if (source->direct()) {
      r.direct = true;
      r.alignment = std::max(cf.stat.dio_offset_align, kDefaultDirectAlign);
    }
    s.sources.push_back(std::move(source));
    max_align = std::max(max_align, r.alignment);
    files.push_back(std::move(r));
  }
  ShardPlanOptions po;
  po.block_size = options.block_size;
  po.max_gap = options.max_gap;
  po.batch_bytes = options.batch_bytes;
  s.plan = make_shard_plan(checkpoint, spec, std::move(files), po);
  s.checkpoint = std::move(checkpoint);
  s.staging_bytes = static_cast<std::size_t>(round_up(std::max<std::uint64_t>(options.block_size, 4096) + 2 * max_align, 4096));
  s.ready.resize(s.plan.batches.size());
  s.producer = std::jthread([&s] { s.run(); });
}

ShardLoad::~ShardLoad() {
  if (!state_) return;
  state_->stop.request_stop();
  {
    std::lock_guard lock(state_->mu);
  }
  state_->cv.notify_all();
  if (state_->producer.joinable()) state_->producer.join();
}

StateDict ShardLoad::next() {
  State& s = *state_;
  std::unique_lock lock(s.mu);
  if (s.next_out >= s.plan.batches.size()) return {};
  s.cv.wait(lock, [&] { return s.error || s.ready[s.next_out].has_value(); });
  if (s.ready[s.next_out].has_value()) {
    StateDict out = std::move(*s.ready[s.next_out]);
    s.ready[s.next_out].reset();
    ++s.next_out;
    s.cv.notify_all();
    return out;
  }
  s.next_out = s.plan.batches.size();  // a failed load hands out nothing more
  std::rethrow_exception(s.error);
}

const ShardPlan& ShardLoad::plan() const noexcept { return state_->plan; }
std::uint64_t ShardLoad::bytes_read() const noexcept { return state_->bytes_read.load(std::memory_order_relaxed); }

StateDict load_shard(const std::vector<std::string>& paths, const ShardSpec& spec, const ShardLoadOptions& options,
                     std::shared_ptr<Pool> pool, Env* env) {
  ShardLoad load(paths, spec, options, std::move(pool), env);
  std::vector<Tensor> all;
  std::vector<std::string> files;
  for (StateDict sd = load.next(); !sd.empty(); sd = load.next()) {
    for (const Tensor& t : sd) all.push_back(t);
    files = sd.files();
  }
  StateDict out(std::move(all));
  out.set_files(std::move(files));
  return out;
}

}  // namespace pinload
