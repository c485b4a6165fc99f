#include "load/convert_on_load.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <unordered_map>

#include "format/dtype_convert.h"
#include "io/read_session.h"
#include "memory/first_touch.h"
#include "pinload/byte_source.h"
#include "pinload/error.h"
#include "pinload/loader.h"

namespace pinload::detail {
namespace {

constexpr std::uint64_t kOutAlignment = 64;  // each converted tensor in its output block

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_fp8(DType d) { return d == DType::kF8_E4M3 || d == DType::kF8_E5M2; }

std::string shape_text(const std::vector<std::uint64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

struct Where {
  std::size_t file;
  std::size_t tensor;
};

// The layers a file's _quantization_metadata declares quantised, prefixed.
void declared_layers(const CheckpointFile& cf, std::set<std::string>* out) {
  for (const auto& [key, value] : cf.header.metadata) {
    if (key != "_quantization_metadata") continue;
    const nlohmann::json j = nlohmann::json::parse(value, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("layers") || !j["layers"].is_object()) return;
    for (auto it = j["layers"].begin(); it != j["layers"].end(); ++it) out->insert(cf.name_prefix + it.key());
  }
}

// Reads small tensors' bytes through their files' sources (Note [Byte
// sources] in byte_source.h); an error names the tensor too.
class ScaleReader {
 public:
  explicit ScaleReader(Env* env) : env_(env) {}
  std::vector<float> read(const CheckpointFile& cf, const TensorInfo& t) {
    auto it = sources_.find(cf.path);
    if (it == sources_.end()) {
      it = sources_.emplace(cf.path, open_byte_source(env_, source_file(cf), SourceOptions{})).first;
    }
    std::vector<float> values(t.numel());
    auto* p = reinterpret_cast<std::byte*>(values.data());
    const std::uint64_t at = cf.header.data_offset() + t.begin;
    try {
      it->second->read(at, t.nbytes(), p, t.nbytes());
    } catch (const Error& e) {
      ErrorContext context = e.context();
      context.tensor = cf.name_prefix + t.name;
      throw_error(e.code(), e.message(), std::move(context));
    }
    return values;
  }

 private:
  Env* env_;
  std::map<std::string, std::unique_ptr<ByteSource>> sources_;
};

}  // namespace

ElementConversion TensorConversion::conversion(std::uint64_t first, std::uint64_t count) const noexcept {
  ElementConversion c;
  c.from = from;
  c.to = to;
  c.elements = count;
  c.scale = scale;
  c.row_scales = row_scales.empty() ? nullptr : row_scales.data();
  c.row_elements = row_scales.empty() ? 0 : row_elements;
  c.first = first;
  return c;
}

namespace {

// Whether `name` matches one of the options' keep patterns.
bool kept_by(const DTypeOptions& options, const std::string& name) {
  return std::any_of(options.keep.begin(), options.keep.end(),
                     [&](const std::string& p) { return keep_pattern_matches(p, name); });
}

// The dtype a floating, non-FP8 tensor `name` is asked in: nullopt keeps it as stored.
std::optional<DType> float_target(const DTypeOptions& options, const std::string& name) {
  return kept_by(options, name) ? options.keep_to : options.to;
}

void check_dtype_options(const DTypeOptions& options) {
  if (!is_convertible(DType::kF32, *options.to)) {
    throw InvalidFileError("dtype must be BF16, F16 or F32, not " + std::string(dtype_name(*options.to)));
  }
  const DType keep_to = options.keep_to.value_or(DType::kF32);
  if (!is_convertible(DType::kF32, keep_to)) {
    throw InvalidFileError("keep dtype must be BF16, F16 or F32, not " + std::string(dtype_name(keep_to)));
  }
}

}  // namespace

// Note [A dtype that changes nothing]: the hooks pass the model's dtype to
// every load (Note [dtype through the conversion] in hooks.py), and it mostly
// equals the stored one. Such a load must stay a plain load, so that it can
// be handed out from a mapping or the store with no byte copied: it converts
// only where plan_conversions would convert something. That is an FP8 tensor
// (dequantised, its scale dropped) or a floating tensor whose target differs
// from its stored dtype; anything else leaves every tensor as stored.
bool conversion_changes_anything(const Checkpoint& checkpoint, const DTypeOptions& options) {
  if (!options.to) return false;
  check_dtype_options(options);
  for (const CheckpointFile& cf : checkpoint.files) {
    for (const TensorInfo& t : cf.header.tensors) {
      if (is_fp8(t.dtype)) return true;
      if (!is_float_dtype(t.dtype)) continue;
      const std::optional<DType> target = float_target(options, cf.name_prefix + t.name);
      if (target && *target != t.dtype) return true;
    }
  }
  return false;
}

ConversionPlan plan_conversions(Env* env, const Checkpoint& checkpoint, const DTypeOptions& options,
                                bool may_stage) {
  struct PlanTime {  // Note [Load stages] in read_session.h
    std::uint64_t start = LoadStages::now();
    ~PlanTime() { load_stages().plan.fetch_add(LoadStages::now() - start, std::memory_order_relaxed); }
  } plan_time;
  ConversionPlan plan;
  const std::size_t n = checkpoint.files.size();
  plan.by_file.resize(n);
  plan.out_bytes.assign(n, 0);
  plan.role.resize(n);
  if (!options.to) return plan;
  check_dtype_options(options);
  const DType keep_to = options.keep_to.value_or(DType::kF32);
  std::unordered_map<std::string, Where> by_name;
  std::set<std::string> declared;
  for (std::size_t f = 0; f < n; ++f) {
    const CheckpointFile& cf = checkpoint.files[f];
    plan.role[f].assign(cf.header.tensors.size(), kKeptTensor);
    for (std::size_t t = 0; t < cf.header.tensors.size(); ++t) by_name[cf.name_prefix + cf.header.tensors[t].name] = {f, t};
    declared_layers(cf, &declared);
  }
  auto add = [&](TensorConversion tc) {
    const std::size_t f = tc.file;
    tc.out_offset = (plan.out_bytes[f] + kOutAlignment - 1) / kOutAlignment * kOutAlignment;
    plan.out_bytes[f] = tc.out_offset + tc.out_bytes();
    plan.role[f][tc.tensor] = static_cast<std::int64_t>(plan.tensors.size());
    plan.tensors.push_back(std::move(tc));
  };
  ScaleReader reader(env);
  // FP8 tensors first: they decide which scales and markers are used up.
  for (std::size_t f = 0; f < n; ++f) {
    const CheckpointFile& cf = checkpoint.files[f];
    for (std::size_t i = 0; i < cf.header.tensors.size(); ++i) {
      const TensorInfo& t = cf.header.tensors[i];
      if (!is_fp8(t.dtype)) continue;
      const std::string name = cf.name_prefix + t.name;
      TensorConversion tc;
      tc.file = f;
      tc.tensor = i;
      tc.from = t.dtype;
      tc.to = kept_by(options, name) ? keep_to : *options.to;
      tc.in_begin = cf.header.data_offset() + t.begin;
      tc.elements = t.numel();
      const bool is_weight = ends_with(name, ".weight");
      const std::string layer = is_weight ? name.substr(0, name.size() - 7) : name;
      const Where* scale = nullptr;
      if (is_weight) {
        for (const char* suffix : {".weight_scale", ".scale_weight"}) {
          if (auto it = by_name.find(layer + suffix); it != by_name.end()) {
            scale = &it->second;
            break;
          }
        }
      }
      const auto marker = by_name.find(layer + ".comfy_quant");
      if (scale == nullptr) {
        if (marker != by_name.end() || declared.contains(layer)) {
          throw InvalidFileError("quantised layer '" + layer + "' has no scale (expected '" + layer +
                                 ".weight_scale', F32)", ErrorContext{cf.path, name});
        }
      } else {
        const CheckpointFile& sf = checkpoint.files[scale->file];
        const TensorInfo& s = sf.header.tensors[scale->tensor];
        const std::string sname = sf.name_prefix + s.name;
        if (s.dtype != DType::kF32) {
          throw InvalidFileError("scale '" + sname + "' of FP8 weight '" + name + "' is " +
                                 std::string(dtype_name(s.dtype)) + "; FP8 scales must be F32",
                                 ErrorContext{sf.path, sname});
        }
        const std::uint64_t rows = t.shape.empty() ? 1 : t.shape[0];
        const std::uint64_t count = s.numel();
        const bool row_shape = s.shape == std::vector<std::uint64_t>{rows} ||
                               s.shape == std::vector<std::uint64_t>{rows, 1};
        if (count == 1 && s.shape.size() <= 2) {
          tc.scale = reader.read(sf, s)[0];
        } else if (t.shape.size() >= 2 && row_shape && rows > 0) {
          tc.row_scales = reader.read(sf, s);
          tc.row_elements = t.numel() / rows;
        } else {
          throw InvalidFileError("scale '" + sname + "' has shape " + shape_text(s.shape) + "; FP8 weight '" + name +
                                     "' of shape " + shape_text(t.shape) + " needs [] or [1] (per tensor) or [" +
                                     std::to_string(rows) + ", 1] (per row)",
                                 ErrorContext{sf.path, sname});
        }
        plan.role[scale->file][scale->tensor] = kDroppedTensor;
        if (marker != by_name.end()) plan.role[marker->second.file][marker->second.tensor] = kDroppedTensor;
      }
      add(std::move(tc));
    }
  }
  // Then the other floating tensors.
  for (std::size_t f = 0; f < n; ++f) {
    const CheckpointFile& cf = checkpoint.files[f];
    for (std::size_t i = 0; i < cf.header.tensors.size(); ++i) {
      const TensorInfo& t = cf.header.tensors[i];
      if (is_fp8(t.dtype) || !is_float_dtype(t.dtype) || plan.role[f][i] != kKeptTensor) continue;
      const std::string name = cf.name_prefix + t.name;
      const std::optional<DType> target = float_target(options, name);
      if (!target || *target == t.dtype) continue;
      TensorConversion tc;
      tc.file = f;
      tc.tensor = i;
      tc.from = t.dtype;
      tc.to = *target;
      tc.in_begin = cf.header.data_offset() + t.begin;
      tc.elements = t.numel();
      add(std::move(tc));
    }
  }
  // Note [Staged conversion]: kept tensors are copied into the output blocks.
  if (may_stage) {
    std::uint64_t converted = 0, as_stored = 0;
    for (const TensorConversion& t : plan.tensors) converted += t.in_bytes();
    for (std::size_t f = 0; f < n; ++f) {
      for (std::size_t i = 0; i < plan.role[f].size(); ++i) {
        if (plan.role[f][i] == kKeptTensor) as_stored += checkpoint.files[f].header.tensors[i].nbytes();
      }
    }
    plan.staged = converted > 0 && as_stored <= converted;
    for (std::size_t f = 0; f < n && plan.staged; ++f) {
      const CheckpointFile& cf = checkpoint.files[f];
      for (std::size_t i = 0; i < cf.header.tensors.size(); ++i) {
        if (plan.role[f][i] != kKeptTensor) continue;
        const TensorInfo& t = cf.header.tensors[i];
        TensorConversion tc;
        tc.file = f;
        tc.tensor = i;
        tc.from = tc.to = t.dtype;
        tc.copy = true;
        tc.in_begin = cf.header.data_offset() + t.begin;
        tc.elements = t.nbytes();
        add(std::move(tc));
      }
    }
  }
  for (std::size_t k = 0; k < plan.tensors.size(); ++k) plan.by_file[plan.tensors[k].file].push_back(k);
  for (auto& list : plan.by_file) {
    std::sort(list.begin(), list.end(),
              [&](std::size_t a, std::size_t b) { return plan.tensors[a].in_begin < plan.tensors[b].in_begin; });
  }
  return plan;
}

void convert_chunk(Env* env, const ConversionPlan& plan, const ReadChunk& c, const std::byte* chunk_data,
                   const std::vector<std::shared_ptr<Block>>& out_blocks) {
  const std::vector<std::size_t>& list = plan.by_file[c.file];
  if (list.empty()) return;
  const std::uint64_t chunk_end = c.offset + c.valid;
  // The first tensor ending after the chunk's start (tensors do not overlap).
  const auto begin = std::partition_point(list.begin(), list.end(), [&](std::size_t k) {
    const TensorConversion& t = plan.tensors[k];
    return t.in_begin + t.in_bytes() <= c.offset;
  });
  // Calls piece(t, first, last) for each planned tensor's whole elements in the chunk.
  auto for_each_piece = [&](auto&& piece) {
    for (auto it = begin; it != list.end(); ++it) {
      const TensorConversion& t = plan.tensors[*it];
      if (t.in_begin >= chunk_end) break;
      const unsigned in_size = t.in_unit();
      const std::uint64_t lo = std::max(t.in_begin, c.offset);
      const std::uint64_t hi = std::min(t.in_begin + t.in_bytes(), chunk_end);
      const std::uint64_t first = (lo - t.in_begin + in_size - 1) / in_size;
      const std::uint64_t last = (hi - t.in_begin) / in_size;
      if (last > first) piece(t, first, last);
    }
  };
  Block& out_block = *out_blocks[c.file];
  // The chunk's output bytes, faulted in at once where they are fresh.
  std::uint64_t out_lo = UINT64_MAX, out_hi = 0;
  for_each_piece([&](const TensorConversion& t, std::uint64_t first, std::uint64_t last) {
    const unsigned out_size = t.out_unit();
    out_lo = std::min(out_lo, t.out_offset + first * out_size);
    out_hi = std::max(out_hi, t.out_offset + last * out_size);
  });
  if (out_hi > out_lo) FirstTouch::process().fault_in(env, out_block, out_block.data() + out_lo, out_hi - out_lo);
  for_each_piece([&](const TensorConversion& t, std::uint64_t first, std::uint64_t last) {
    if (t.copy) {
      std::memcpy(out_block.data() + t.out_offset + first, chunk_data + (t.in_begin + first - c.offset), last - first);
      return;
    }
    const unsigned in_size = t.in_unit();
    const unsigned out_size = t.out_unit();
    convert_elements(t.conversion(first, last - first), chunk_data + (t.in_begin + first * in_size - c.offset),
                     out_block.data() + t.out_offset + first * out_size);
  });
}

// Converts the elements of planned tensors that straddle a chunk start: an
// element begins before the chunk at `edge` and ends inside it.
// fetch(file, element, edge, bytes, dst) gives the element's stored bytes.
template <class Fetch>
void convert_across_edges(const ConversionPlan& plan, const ReadPlan& read_plan,
                          const std::vector<std::shared_ptr<Block>>& out_blocks, Fetch fetch) {
  std::vector<std::vector<std::uint64_t>> starts(read_plan.files.size());
  for (const ReadChunk& c : read_plan.chunks) starts[c.file].push_back(c.offset);
  for (const TensorConversion& t : plan.tensors) {
    const unsigned in_size = t.in_unit();
    if (in_size == 1) continue;  // bytes (fp8, copies) never straddle
    const unsigned out_size = t.out_unit();
    const std::uint64_t end = t.in_begin + t.in_bytes();
    for (std::uint64_t b : starts[t.file]) {
      if (b <= t.in_begin || b >= end || (b - t.in_begin) % in_size == 0) continue;
      const std::uint64_t k = (b - t.in_begin) / in_size;
      std::array<std::byte, 8> element;
      fetch(t.file, t.in_begin + k * in_size, b, in_size, element.data());
      convert_elements(t.conversion(k, 1), element.data(), out_blocks[t.file]->data() + t.out_offset + k * out_size);
    }
  }
}

// Note [Converting beside the reads]
// A reader that converted its chunk itself left no read in flight for that
// time. The conversion is memory-bound (a 906 MB fp32 -> bf16 load took about
// 0.16 s of CPU) and the readers share the same CPUs, so the chunks go to a
// queue served by one converting thread per CPU: a reader issues its next
// read as soon as its chunk is queued, and the disk never waits on a
// conversion. What stays after the last read is the queue's backlog.
// fp8-bench, both pools in huge pages, rounds alternating with the build
// that converted on the readers: FP8 -> bf16 0.502 x the bf16 load against
// 0.521 (36 rounds each), fp32 -> bf16 1.013 x the fp32 load against 1.031
// (48 rounds each); docs/fp8.md.
//
// Note [Staged conversion]
// A host load that reads afresh (no prefetch to adopt) and whose
// conversions are at least half its bytes is staged: the session streams
// each chunk into a staging block of the load's own pool (ReadSession's
// streaming mode, as a device load with a staging budget), the converting
// threads write the chunk's tensors (kept ones copied as they are) into the
// output blocks and release the staging block at once. The few elements
// across a chunk edge convert at the end from 8 bytes kept at each edge.
// Before each read a reader waits, holding nothing, until fewer than the
// ring's chunks are admitted and not yet converted (Note [Conversion
// ring]); a chunk's block is back in the pool before its slot is. Waiting
// in the sink instead, holding a CPU slot, had the other readers spinning
// on the slots (sched_yield); hence the gate before the read.
// The pool never holds a file's stored bytes whole: a fp32 -> bf16 load of
// a 906 MB file holds its 453 MB output and the ring (at most 192 MiB), not
// 1.41 GB (whole-file reads).
//
// Note [Conversion ring]
// Where a read lands matters on a VM: the host copies each direct read
// into guest memory, and into a few MiB it has just written it copies
// faster than into new memory (bench/dest_memory.py: 2.9-3.2 GB/s into one
// reused 2 MiB buffer, 2.1-2.2 GB/s into distinct memory, same 2 MiB
// preads). A staged load's chunks are therefore admitted into a ring of
// staging blocks, which the pool's free list hands back block by block
// (last freed, first reused), and converting threads read each chunk from
// cache, not from memory. The ring also bounds the reads in flight: a
// chunk holds its slot from before its read until its conversion ends.
// At 32 MiB (four 8 MiB chunks) an AMD EPYC VM's disk, which a plain load
// keeps 31 reads deep, ran 3.1-3.6 reads deep and the staged loads lost
// there, not in the conversions (fp8-bench's stages: span of the reads
// 72 ms against 64 ms for the FP8 file read as stored, the conversions
// 26 ms of thread time beside it and a 1 ms tail; the disk delivers with
// the bytes in flight, and 2 MiB reads within the same 32 MiB did no
// better than 8 MiB ones, 1 MiB ones worse). Rings of 4, 8, 16 and 32
// chunks of 8 MiB, same-round ratios, AVX2: FP8 -> bf16 / bf16 0.68,
// 0.60-0.65, 0.58-0.59, 0.65-0.70; fp32 -> bf16 / fp32 1.14-1.18,
// 1.08-1.09, 1.05-1.08, 0.97-1.06 (a shared VM, load average 11-18).
// The disk also completes its reads in bursts, and a chunk read waits for
// a converting thread (5 ms on average behind a burst) while holding its
// slot, so a ring of 16 kept 11-12 reads in flight. Hence two bounds: at
// most kConversionRingReads (16) chunks admitted and not yet read, and
// kConversionRingChunks (24) admitted and not yet converted, within
// kConversionRingBytes (192 MiB); with larger blocks two thirds of the
// ring's chunks. Against one bound of 16, same-round ratios over 7 runs
// alternating: FP8 -> bf16 / bf16 0.573-0.607 against 0.594-0.622, fp32 ->
// bf16 / fp32 0.98-1.09 against 0.99-1.08. The pool still never holds a
// file's stored bytes whole: a 453 MB fp32 file loaded as bf16 holds its
// 226 MB output and the ring.
// Remote and network-filesystem reads are many connections waiting on the
// network: their ring holds a chunk per reader and two per converting
// thread, so that no connection waits for a slot.
std::size_t conversion_ring_chunks(std::size_t chunk_bytes, unsigned network_readers, unsigned threads) noexcept {
  if (network_readers != 0) return std::size_t{network_readers} + 2 * std::size_t{threads};
  const std::size_t within_bytes = kConversionRingBytes / std::max<std::size_t>(chunk_bytes, 1);
  return std::max<std::size_t>(2, std::min(kConversionRingChunks, within_bytes));
}

std::size_t conversion_ring_reads(std::size_t chunk_bytes, unsigned network_readers) noexcept {
  if (network_readers != 0) return SIZE_MAX;
  const std::size_t chunks = conversion_ring_chunks(chunk_bytes, 0, 1);
  return std::max<std::size_t>(1, chunks - chunks / 3);
}

HostConversions::HostConversions(Env* env, const ConversionPlan& plan, const ReadPlan& read_plan,
                                 const std::vector<std::shared_ptr<Block>>& out_blocks, unsigned threads,
                                 std::size_t ring_chunks, std::size_t ring_reads)
    : env_(env),
      plan_(plan),
      read_plan_(read_plan),
      out_blocks_(out_blocks),
      max_admitted_(ring_chunks),
      max_reading_(ring_reads),
      edges_(plan.staged ? read_plan.chunks.size() : 0) {
  threads_.reserve(threads);
  for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this](std::stop_token stop) { run(stop); });
}

// The threads, destroyed first, are stopped and joined by std::jthread; their
// wait on `ready_` ends at the stop request.
HostConversions::~HostConversions() { wait(); }

void HostConversions::admit(std::stop_token stop) {
  std::unique_lock lock(mu_);
  if (room_.wait(lock, stop, [&] { return admitted_ < max_admitted_ && reading_ < max_reading_; })) {
    ++admitted_;
    ++reading_;
  }
}

void HostConversions::submit(const ReadChunk& c, std::shared_ptr<Block> block, std::size_t offset) {
  {
    std::lock_guard lock(mu_);
    jobs_.push_back(Job{&c, std::move(block), offset, LoadStages::now()});
    if (!plan_.staged || reading_ == 0) {
      ready_.notify_one();
      return;
    }
    --reading_;
  }
  ready_.notify_one();
  room_.notify_one();  // a read's slot is free (Note [Conversion ring])
}

void HostConversions::wait() {
  std::unique_lock lock(mu_);
  drained_.wait(lock, [&] { return jobs_.empty() && busy_ == 0; });
}

void HostConversions::finish() {
  LoadStages& stages = load_stages();  // Note [Load stages]
  const std::uint64_t t0 = LoadStages::now();
  wait();
  const std::uint64_t t_wait = LoadStages::now();
  stages.finish.fetch_add(t_wait - t0, std::memory_order_relaxed);
  {
    std::lock_guard lock(mu_);
    if (error_) std::rethrow_exception(error_);
  }
  if (!plan_.staged) return;
  struct EdgesTime {
    std::uint64_t start;
    ~EdgesTime() { load_stages().edges.fetch_add(LoadStages::now() - start, std::memory_order_relaxed); }
  } edges_time{t_wait};
  // The chunk starting at each offset, per file.
  std::vector<std::map<std::uint64_t, std::size_t>> chunk_at(read_plan_.files.size());
  for (std::size_t i = 0; i < read_plan_.chunks.size(); ++i) {
    chunk_at[read_plan_.chunks[i].file][read_plan_.chunks[i].offset] = i;
  }
  convert_across_edges(plan_, read_plan_, out_blocks_,
                       [&](std::size_t file, std::uint64_t element, std::uint64_t edge, unsigned bytes, std::byte* dst) {
                         const auto next = chunk_at[file].find(edge);
                         const auto before = std::prev(next);  // the chunk that ends at `edge`
                         const std::size_t from_before = edge - element;
                         std::memcpy(dst, edges_[before->second].tail.data() + (8 - from_before), from_before);
                         std::memcpy(dst + from_before, edges_[next->second].head.data(), bytes - from_before);
                       });
}

void HostConversions::run(std::stop_token stop) {
  LoadStages& stages = load_stages();  // Note [Load stages]
  std::unique_lock lock(mu_);
  for (;;) {
    const std::uint64_t t_idle = LoadStages::now();
    if (!ready_.wait(lock, stop, [&] { return !jobs_.empty(); })) return;
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    ++busy_;
    lock.unlock();
    const std::uint64_t t_start = LoadStages::now();
    stages.idle.fetch_add(t_start - t_idle, std::memory_order_relaxed);
    stages.queued.fetch_add(t_start - std::min(t_start, job.submitted), std::memory_order_relaxed);
    std::exception_ptr error;
    try {
      const std::byte* data = job.block->data() + job.offset;
      if (plan_.staged) {
        const ReadChunk& c = *job.chunk;
        Edges& e = edges_[static_cast<std::size_t>(&c - read_plan_.chunks.data())];
        const std::size_t n = std::min<std::size_t>(8, c.valid);
        std::memcpy(e.head.data(), data, n);
        std::memcpy(e.tail.data() + (8 - n), data + c.valid - n, n);
      }
      convert_chunk(env_, plan_, *job.chunk, data, out_blocks_);
    } catch (...) {
      error = std::current_exception();
    }
    job.block.reset();  // staged: the staging block goes back to the pool
    const std::uint64_t t_end = LoadStages::now();
    stages.convert.fetch_add(t_end - t_start, std::memory_order_relaxed);
    stages.converted.fetch_add(1, std::memory_order_relaxed);
    stages.add_convert_end(t_end);
    lock.lock();
    if (error && !error_) error_ = error;
    if (plan_.staged && admitted_ > 0) {
      --admitted_;
      room_.notify_one();
    }
    --busy_;
    if (jobs_.empty() && busy_ == 0) drained_.notify_all();
  }
}

void convert_straddlers(const ConversionPlan& plan, const ReadPlan& read_plan,
                        const std::vector<std::shared_ptr<Block>>& file_blocks,
                        const std::vector<std::shared_ptr<Block>>& out_blocks) {
  convert_across_edges(plan, read_plan, out_blocks,
                       [&](std::size_t file, std::uint64_t element, std::uint64_t, unsigned bytes, std::byte* dst) {
                         std::memcpy(dst, file_blocks[file]->data() + (element - read_plan.files[file].read_begin),
                                     bytes);
                       });
}

// Note [Device conversion pipeline]
// A device load copies the stored (smaller) bytes and converts them on the
// device. The conversions do not wait for the whole load: when the copy of a
// tensor's last stored bytes has been submitted (by whichever reader thread
// read them), an event is recorded on every copy stream, the conversion
// stream waits for those events (Device::wait: cudaStreamWaitEvent), and the
// tensor's conversion is queued behind them. Stream order then guarantees it
// runs after every copy of its bytes, and the copy streams go on with the
// next chunks meanwhile: the kernel (or sim's host loop, on the conversion
// stream's thread) overlaps the copies. The conversion stream is a stream of
// its own rather than copy stream 0, so that no copy queues behind a
// kernel. finish() only waits.
DeviceConversions::DeviceConversions(const ConversionPlan& plan, const Checkpoint& checkpoint, Device& device,
                                     CopyEngine& engine, std::vector<std::shared_ptr<DeviceBuffer>> in,
                                     std::vector<std::shared_ptr<DeviceBuffer>> out)
    : plan_(plan),
      checkpoint_(checkpoint),
      device_(device),
      engine_(engine),
      in_(std::move(in)),
      out_(std::move(out)),
      stream_(device.create_stream()),
      row_scales_(plan.tensors.size()),
      missing_(plan.tensors.size()),
      launched_(plan.tensors.size(), false) {
  for (std::size_t k = 0; k < plan.tensors.size(); ++k) {
    const TensorConversion& t = plan.tensors[k];
    missing_[k] = t.in_bytes();
    // Per-row scales go up from their host copies (read at planning): the
    // scale tensor's own bytes on the device need not be 4-byte aligned.
    if (!t.row_scales.empty()) {
      const std::size_t bytes = t.row_scales.size() * sizeof(float);
      row_scales_[k] = device.allocate(bytes);
      device.copy_to_device_async(*row_scales_[k], 0, t.row_scales.data(), bytes, stream_);
    }
  }
}

DeviceConversions::~DeviceConversions() {
  try {
    stream_.synchronize();
  } catch (...) {  // the load reports its own error; the buffers stay valid either way
  }
}

void DeviceConversions::launch(std::size_t k) {
  const TensorConversion& t = plan_.tensors[k];
  launched_[k] = true;
  if (!finished_) {
    for (std::size_t s = 0; s < engine_.options().streams; ++s) {
      const Event copied = device_.record(engine_.stream(s));
      device_.wait(stream_, copied);
    }
  }
  ElementConversion c = t.conversion(0, t.elements);
  if (row_scales_[k]) c.row_scales = static_cast<const float*>(row_scales_[k]->data());
  const std::uint64_t src_offset = t.in_begin - checkpoint_.files[t.file].header.data_offset();
  device_.convert_async(*out_[t.file], t.out_offset, *in_[t.file], src_offset, c, stream_);
}

void DeviceConversions::copied(std::size_t file, std::uint64_t begin, std::uint64_t end) {
  const std::vector<std::size_t>& list = plan_.by_file[file];
  if (list.empty() || end <= begin) return;
  const std::uint64_t base = checkpoint_.files[file].header.data_offset();
  begin += base;
  end += base;
  auto it = std::partition_point(list.begin(), list.end(), [&](std::size_t k) {
    const TensorConversion& t = plan_.tensors[k];
    return t.in_begin + t.in_bytes() <= begin;
  });
  std::lock_guard lock(mu_);
  for (; it != list.end(); ++it) {
    const TensorConversion& t = plan_.tensors[*it];
    if (t.in_begin >= end) break;
    const std::uint64_t overlap = std::min(t.in_begin + t.in_bytes(), end) - std::max(t.in_begin, begin);
    missing_[*it] -= std::min(missing_[*it], overlap);
    if (missing_[*it] == 0 && !launched_[*it]) {
      launch(*it);
      ++queued_early_;
    }
  }
}

void DeviceConversions::finish() {
  {
    std::lock_guard lock(mu_);
    finished_ = true;  // every copy has completed: no events needed
    for (std::size_t k = 0; k < plan_.tensors.size(); ++k) {
      if (!launched_[k]) launch(k);
    }
  }
  stream_.synchronize();
}

}  // namespace pinload::detail
