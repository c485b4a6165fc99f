// pinload-bench: pinload's load bandwidth next to the machine's physical limits,
// measured in the same run on the same files.
//
//   pinload-bench [options] PATH...      (files, *.safetensors.index.json, folders)
//
// Phases (--phases, default all but sweep):
//   memcpy    memcpy bandwidth, one thread and all cores: the ceiling of a warm load
//   fio       fio direct reads of the same files (bs 2M, iodepth 32 and 1; bs 8M, iodepth 8; libaio):
//             the ceiling of a cold load
//   buffered  a plain single-thread read() of the files, cold then warm
//   cold      pinload loads after dropping the page cache: a first load into a fresh
//             pool, then --repeat re-loads after an unload, each in a round with fio
//   warm      pinload loads with the files in the page cache, --repeat times
//   cached-read  in each warm round, also a load with --cached-read map and one
//             with pread (Note [Mapped reads] in loader.h), in an order rotated by round
//   pool      a fresh pool reserving the checkpoint's blocks, timed alone: what a
//             first load pays before its first read. It runs after a cache drop and
//             --pool-settle idle seconds: in a VM with free page reporting
//             (virtio-balloon), memory that has been free a while goes back to the
//             host, and faulting it in again is several times slower than memory
//             freed a moment ago.
//   sweep     cold (and warm) loads over threads {1,2,4,8,16} x block {256K,1M,2M,8M}
//             (--sweep adds it)
//   device    with --device (cuda:N, or sim, the CPU stand-in; --device adds it):
//             the physical limit, one large copy from pinned memory to the device
//             (pinned cudaMemcpy on a GPU), best of 3; the copy engine alone
//             (upload() of the checkpoint already in pinned memory); warm and cold
//             loads to the device (cached mode) next to host-only loads of the same
//             round; a cold streaming load within --staging-bytes
//   switch    switching back to a model held in a ModelCache (model_cache.h): the
//             host-side cost of a hit (re-stat the files, copy the state dict) against
//             the cold load that filled the cache, and the preads and OS reservations
//             the hits made (both should be 0); with --device, a hit to the device
//             (get_on) against a bare upload() of the same bytes. Only when named in
//             --phases.
//   verify    cold loads checked against a manifest (Note [Verified loads] in
//             manifest.h) and plain cold loads, alternating in --repeat rounds into
//             the same pool: the cost of verification. --verify adds it.
//
// fio's buffers are malloc'ed 4 KiB pages: a 2 MiB direct read then needs 512
// scatter-gather segments, more than many virtual disks take in one request
// (virtio-blk here: max_segments 254), so the kernel splits it. pinload's pool
// is THP-backed, so its reads go out whole. With --hugetlb, fio also runs with
// huge-page buffers (--iomem=shmhuge), which removes that difference.
//
// The cold target: Note [Comparing with fio] in fio_compare.h.
//
// Cold means: sync + `echo 1 > /proc/sys/vm/drop_caches` where that is writable
// (root), otherwise posix_fadvise(POSIX_FADV_DONTNEED) on every file; the report
//
// Layout: the system probes (fio, memcpy, read(), the page cache, first touch,
// the machine's description) are in system_probe.h; this file parses the
// arguments (CLI11, with the pinload command's reader options: --help lists them), runs one function per phase in the order above, then derives the
// ratios and targets and prints the table. Every phase writes its part of the
// JSON's "results" in the order the phases run.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pinload/checkpoint.h"
#include "pinload/copy_engine.h"
#include "pinload/device.h"
#include "pinload/env.h"
#include "pinload/error.h"
#include "pinload/host_memory.h"
#include "pinload/loader.h"
#include "pinload/model_cache.h"
#include "pinload/pool.h"
#include "cli/command.h"
#include "cli/load_option_args.h"
#include "cli/size_arg.h"
#include "fio_compare.h"
#include "measurement.h"
#include "system_probe.h"

namespace {

using pinload::bench::Clock;
using pinload::bench::fmt;
using pinload::bench::in_rotated_order;
using pinload::bench::json;
using pinload::bench::log_sample;
using pinload::bench::median_of;
using pinload::bench::Sample;
using pinload::bench::seconds_since;
using pinload::bench::Series;
using pinload::bench::size_name;
using pinload::bench::buffered_read;
using pinload::bench::drop_caches;
using pinload::bench::DropResult;
using pinload::bench::fio_read;
using pinload::bench::fio_variant_title;
using pinload::bench::FioVariant;
using pinload::bench::host_info;
using pinload::bench::HugeTlbReservation;
using pinload::bench::kFioVariants;
using pinload::bench::meminfo;
using pinload::bench::memcpy_gbps;
using pinload::bench::read_first_line;
using pinload::bench::residency;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::uint64_t parse_size(const std::string& text) {
  const std::optional<std::uint64_t> size = pinload::cli::parse_size_arg(text);
  if (!size) throw UsageError("not a size: '" + text + "' (bytes, or a number with K, M or G)");
  return *size;
}

struct Args {
  std::vector<std::string> paths;
  // The pool-kept scenario: every load reads into the bench's pool (Note
  // [Zero-copy loads] is measured in fresh processes: bench/fresh_host_probe.py).
  pinload::LoadOptions load = [] {
    pinload::LoadOptions o;
    o.zero_copy = pinload::ZeroCopy::kOff;
    return o;
  }();
  int repeat = 3;
  pinload::HugePages huge_pages = pinload::HugePages::kTransparent;
  std::vector<std::string> phases = {"memcpy", "fio", "buffered", "cold", "warm", "cached-read", "pool"};
  std::vector<unsigned> sweep_threads = {1, 2, 4, 8, 16};
  std::vector<std::size_t> sweep_blocks = {256u << 10, 1u << 20, 2u << 20, 8u << 20};
  int sweep_repeat = 1;
  bool sweep_warm = true;
  int fio_runtime = 0;
  std::string hugetlb = "off";
  int pool_settle = 10;
  bool lock = pinload::kHostPoolMemory.lock;  // LockedMemoryOptions::lock
  std::size_t memcpy_bytes = 512u << 20;
  std::string label;
  std::string json_out;
  std::string device;  // --device: empty for none
  pinload::CopyOptions copy;
  std::uint64_t staging_bytes = pinload::kDefaultStagingBytes;

  bool has(const std::string& phase) const {
    return std::find(phases.begin(), phases.end(), phase) != phases.end();
  }
};

const char* huge_pages_name(pinload::HugePages h) {
  switch (h) {
    case pinload::HugePages::kOff: return "off";
    case pinload::HugePages::kTransparent: return "thp";
    case pinload::HugePages::kExplicit: return "explicit";
  }
  return "?";
}

using pinload::cli::cached_read_arg_name;
using pinload::cli::direct_arg_name;
using pinload::cli::integer_range;
using pinload::cli::size_range;

constexpr const char* kPhases[] = {"memcpy", "fio", "buffered", "cold", "warm", "cached-read",
                                   "pool", "sweep", "device", "switch", "verify"};

// Parsed by CLI11 with the pinload command's reader options (src/cli/command.h):
// the same spellings and ranges. Exits with CLI11's message and code on a
// command-line mistake, or after --help.
Args parse_args(int argc, char** argv) {
  Args a;
  CLI::App app("End-to-end loads next to fio, read() and memcpy (docs/benchmarks.md)", "pinload-bench");
  app.option_defaults()->always_capture_default();
  pinload::cli::add_reader_options(app, &a.load);
  pinload::cli::add_paths(app, &a.paths);
  app.add_option("--repeat", a.repeat, "runs per measurement")->transform(integer_range(1, 1000));
  app.add_option("--huge-pages", a.huge_pages, "pool memory")
      ->transform(CLI::CheckedTransformer(std::map<std::string, pinload::HugePages>{
          {"off", pinload::HugePages::kOff}, {"thp", pinload::HugePages::kTransparent},
          {"explicit", pinload::HugePages::kExplicit}}).description(""))
      ->type_name("off|thp|explicit")
      ->default_str("thp");
  app.add_option("--lock", a.lock, "mlock the pool's memory (as the library's host pools: off)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, bool>{{"on", true}, {"off", false}}).description(""))
      ->type_name("on|off")
      ->default_str(a.lock ? "on" : "off");
  app.add_option("--phases", a.phases,
                 "comma list of memcpy, fio, buffered, cold, warm, cached-read, pool, sweep, device, switch, verify "
                 "(default all but sweep, switch and verify; device only with --device)")
      ->delimiter(',')
      ->check(CLI::IsMember(std::vector<std::string>(std::begin(kPhases), std::end(kPhases))).description(""))
      ->type_name("LIST");
  bool verify = false, sweep = false;
  app.add_flag("--verify", verify,
               "add the verify phase: cold loads checked against a manifest (Note [Verified loads]) and plain ones, "
               "alternating, same pool");
  app.add_flag("--sweep", sweep, "add the threads x block-size sweep");
  app.add_option("--sweep-threads", a.sweep_threads, "comma list")->delimiter(',')->transform(integer_range(1, 1024));
  app.add_option("--sweep-blocks", a.sweep_blocks, "comma list of sizes")
      ->delimiter(',')
      ->transform(size_range(4096, std::uint64_t{1} << 30));
  app.add_option("--sweep-repeat", a.sweep_repeat, "runs per sweep point")->transform(integer_range(1, 1000));
  app.add_option("--sweep-warm", a.sweep_warm, "also sweep warm loads")
      ->transform(CLI::CheckedTransformer(std::map<std::string, bool>{{"on", true}, {"off", false}}).description(""))
      ->type_name("on|off")
      ->default_str("on");
  app.add_option("--fio-runtime", a.fio_runtime, "cap each fio run at S seconds (0: whole files)")
      ->transform(integer_range(0, 86400));
  app.add_option("--hugetlb", a.hugetlb,
                 "as root, set vm.nr_hugepages for the run and restore it at exit: fio then also runs with "
                 "huge-page buffers (--iomem=shmhuge), and --huge-pages explicit gets its pages (auto: what those "
                 "need)")
      ->type_name("off|auto|N")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            if (text == "off" || text == "auto" || pinload::cli::parse_size_arg(text)) return {};
            return "takes off, auto or a number of pages, not '" + text + "'";
          },
          ""));
  app.add_option("--memcpy-bytes", a.memcpy_bytes, "memcpy buffer size")
      ->transform(size_range(4096, std::uint64_t{1} << 40))
      ->default_str(pinload::cli::size_text(a.memcpy_bytes));
  app.add_option("--pool-settle", a.pool_settle, "idle seconds after the cache drop before the pool phase")
      ->transform(integer_range(0, 3600));
  app.add_option("--device", a.device, "also load to cuda:N or sim (the CPU stand-in): adds the device phase");
  app.add_option("--streams", a.copy.streams, "copy streams")->transform(integer_range(1, pinload::kMaxCopyStreams));
  app.add_option("--chunk-size", a.copy.chunk_bytes, "bytes per copy")
      ->transform(size_range(4096, std::uint64_t{1} << 40))
      ->default_str(pinload::cli::size_text(a.copy.chunk_bytes));
  app.add_option("--staging-bytes", a.staging_bytes, "host budget of the streaming load")
      ->transform(size_range(1, std::uint64_t{1} << 50))
      ->default_str(pinload::cli::size_text(a.staging_bytes));
  app.add_option("--label", a.label, "free text stored in the JSON");
  app.add_option("--json", a.json_out, "write the results as JSON");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  if (verify && !a.has("verify")) a.phases.push_back("verify");
  if (sweep && !a.has("sweep")) a.phases.push_back("sweep");
  if (!a.device.empty() && !a.has("device")) a.phases.push_back("device");
  if (a.has("device") && a.device.empty()) throw UsageError("the device phase needs --device");
  return a;
}


// ---- pinload loads ----

// Counts the preads that go through it (the switch phase: a cache hit makes none).
class PreadCountingEnv : public pinload::EnvWrapper {
 public:
  PreadCountingEnv() : EnvWrapper(pinload::default_env()) {}
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override {
    preads.fetch_add(1, std::memory_order_relaxed);
    return EnvWrapper::pread(fd, buffer, bytes, offset);
  }
  std::atomic<std::uint64_t> preads{0};
};

// One pinload load; the state dict is released (unloaded) after timing.
Sample pinload_load(const std::vector<std::string>& paths, const pinload::LoadOptions& options,
                    const std::shared_ptr<pinload::Pool>& pool) {
  pinload::Loader loader(options, pool);
  const auto before = pool->stats();
  const auto t0 = Clock::now();
  pinload::LoadHandle handle = loader.load_async(paths);
  pinload::StateDict sd = handle.wait();
  Sample s;
  s.seconds = seconds_since(t0);
  const pinload::LoadProgress p = handle.progress();
  const auto after = pool->stats();
  s.gbps = static_cast<double>(sd.total_bytes()) / s.seconds / 1e9;
  s.extra["bytes"] = sd.total_bytes();
  s.extra["tensors"] = sd.size();
  s.extra["files_direct"] = p.files_direct;
  s.extra["files_buffered"] = p.files_buffered;
  s.extra["new_os_reservations"] = after.os_reservations - before.os_reservations;
  s.extra["free_list_hits"] = after.free_list_hits - before.free_list_hits;
  return s;
}

// ---- device ----

// One copy of `bytes` from pinned host memory to the device, best of `reps`
// after a warm-up: on CUDA, pinned cudaMemcpy bandwidth, the ceiling of every
// load to the device.
double pinned_copy_gbps(pinload::Device& device, std::size_t bytes, int reps) {
  auto pool = pinload::Pool::create(device.make_pinned_backend());
  std::shared_ptr<pinload::Block> block = pool->allocate(bytes);
  std::memset(block->data(), 0x5a, bytes);
  std::shared_ptr<pinload::DeviceBuffer> buffer = device.allocate(bytes);
  pinload::Stream stream = device.create_stream();
  double best = 0;
  for (int r = 0; r <= reps; ++r) {
    const auto t0 = Clock::now();
    device.copy_to_device_async(*buffer, 0, block->data(), bytes, stream);
    stream.synchronize();
    if (r > 0) best = std::max(best, static_cast<double>(bytes) / seconds_since(t0) / 1e9);
  }
  return best;
}

struct DevicePhase {
  json results = json::object();
  json ratios = json::object();
  json targets = json::object();
  std::vector<std::pair<std::string, const Series*>> rows;
  std::map<std::string, Series> series;
};

// The device phase (see the top of the file). Host-only loads of the same
// rounds go into the same pinned pool, so the ratios compare like with like.
DevicePhase device_phase(const Args& args, pinload::Device* device, const std::vector<std::string>& files,
                         const std::function<double()>& drop, double fio_best) {
  DevicePhase out;
  std::cerr << "[device] " << device->description() << "\n";
  out.results["device"] = device->description();
  const double limit = pinned_copy_gbps(*device, args.memcpy_bytes, 3);
  std::cerr << "  pinned copy to the device, " << size_name(args.memcpy_bytes) << ": " << fmt(limit) << " GB/s\n";
  out.results["pinned_copy_gbps"] = limit;
  out.results["pinned_copy_bytes"] = args.memcpy_bytes;
  out.results["streams"] = args.copy.streams;
  out.results["chunk_bytes"] = args.copy.chunk_bytes;
  out.results["staging_bytes"] = args.staging_bytes;

  auto pinned = pinload::Pool::create(device->make_pinned_backend());
  pinload::LoadOptions host = args.load;
  pinload::LoadOptions cached = args.load;
  cached.target = {device, pinload::DeviceMode::kCached, args.copy, args.staging_bytes};
  pinload::LoadOptions streaming = cached;
  streaming.target.mode = pinload::DeviceMode::kStreaming;
  Series& engine = out.series["engine"];
  Series& warm_host = out.series["warm_host"];
  Series& warm_device = out.series["warm_device"];
  Series& cold_host = out.series["cold_host"];
  Series& cold_device = out.series["cold_device"];
  Series& cold_streaming = out.series["cold_streaming"];

  buffered_read(files);  // warm: the files in the page cache
  {
    const pinload::StateDict sd = pinload::Loader(host, pinned).load(args.paths);
    for (int r = 0; r < args.repeat; ++r) {
      const auto t0 = Clock::now();
      const pinload::StateDict on_device = pinload::upload(sd, *device, args.copy);
      Sample s;
      s.seconds = seconds_since(t0);
      s.gbps = static_cast<double>(sd.total_bytes()) / s.seconds / 1e9;
      log_sample("copy engine alone (upload)", s);
      engine.runs.push_back(s);
    }
  }
  std::vector<double> warm_round, cold_round, streaming_round;
  for (int r = 0; r < args.repeat; ++r) {
    warm_host.runs.push_back(pinload_load(args.paths, host, pinned));
    warm_device.runs.push_back(pinload_load(args.paths, cached, pinned));
    log_sample("warm, host only", warm_host.runs.back());
    log_sample("warm, to the device", warm_device.runs.back());
    warm_round.push_back(warm_device.runs.back().gbps / warm_host.runs.back().gbps);
  }
  std::uint64_t staging_peak = 0;
  for (int r = 0; r < args.repeat; ++r) {
    drop();
    cold_host.runs.push_back(pinload_load(args.paths, host, pinned));
    drop();
    cold_device.runs.push_back(pinload_load(args.paths, cached, pinned));
    log_sample("cold, host only", cold_host.runs.back());
    log_sample("cold, to the device", cold_device.runs.back());
    cold_round.push_back(cold_device.runs.back().gbps / cold_host.runs.back().gbps);
    drop();
    cold_streaming.runs.push_back(pinload_load(args.paths, streaming, pinned));
    log_sample("cold, streaming to the device", cold_streaming.runs.back());
    streaming_round.push_back(cold_streaming.runs.back().gbps / cold_device.runs.back().gbps);
  }
  {
    // The staging pool's peak, from one more streaming load whose loader we keep.
    drop();
    pinload::Loader loader(streaming, pinned);
    (void)loader.load(args.paths);
    staging_peak = loader.staging_pool()->stats().peak_reserved_bytes;
  }
  for (auto& [name, series] : out.series) out.results[name] = series.to_json();
  out.results["streaming_staging_peak_reserved_bytes"] = staging_peak;

  out.ratios["device_engine_over_pinned_copy"] = engine.best() / limit;
  out.ratios["device_warm_over_pinned_copy"] = warm_device.best() / limit;
  out.ratios["device_warm_over_host_warm_same_round_median"] = median_of(warm_round);
  out.ratios["device_cold_over_host_cold_same_round_median"] = median_of(cold_round);
  // Burn after reading: a host budget instead of the whole model in the pool.
  out.ratios["device_streaming_over_cached_cold_same_round_median"] = median_of(streaming_round);
  out.ratios["device_streaming_staging_peak_over_budget"] =
      static_cast<double>(staging_peak) / static_cast<double>(args.staging_bytes);
  out.targets["device_engine_ge_0.9_pinned_copy"] = engine.best() / limit >= 0.9;
  out.targets["device_warm_ge_0.85_pinned_copy"] = warm_device.best() / limit >= 0.85;
  out.targets["device_streaming_peak_le_budget"] = staging_peak <= args.staging_bytes;
  out.targets["device_streaming_within_15pct_of_cached"] = median_of(streaming_round) >= 0.85;
  if (fio_best > 0) {
    out.ratios["device_cold_over_fio_best"] = cold_device.best() / fio_best;
    out.targets["device_cold_ge_0.9_fio"] = cold_device.best() / fio_best >= 0.9;
  }
  const std::string on = " (" + args.device + ")";
  out.rows = {{"copy engine alone, upload()" + on, &engine},
              {"warm, host only, pinned pool", &warm_host},
              {"warm, to the device, cached" + on, &warm_device},
              {"cold, host only, pinned pool", &cold_host},
              {"cold, to the device, cached" + on, &cold_device},
              {"cold, streaming, " + size_name(args.staging_bytes) + " staging" + on, &cold_streaming}};
  return out;
}

// ---- the run: what every phase shares ----

// The files of the checkpoint, the JSON's "results" (each phase adds its part,
// in the order the phases run) and the page-cache drops.
struct BenchRun {
  const Args& args;
  std::vector<std::string> files;
  std::vector<std::uint64_t> sizes;
  std::uint64_t file_bytes = 0;
  unsigned cores = 1;
  json results;
  std::string drop_method;  // the last drop's method; empty before any

  // Evicts the files from the page cache; returns the fraction left, rounded to 0.001.
  double drop() {
    const DropResult d = drop_caches(files, sizes);
    drop_method = d.method;
    if (d.resident_after > 0.05) {
      std::cerr << "  warning: " << fmt(d.resident_after * 100, 0) << "% of the files still in the page cache after "
                << d.method << "\n";
    }
    return std::round(d.resident_after * 1000) / 1000;
  }
};

// The pool every host load of the run goes into (cold rounds, warm, sweep,
// switch), and the loads it has seen: the first fills it, the others re-load.
struct LoadPool {
  pinload::LockedMemoryOptions memory;
  std::int64_t anon_huge_before = 0;
  std::int64_t huge_free_before = 0;
  std::shared_ptr<pinload::Pool> pool;
  Series cold, warm;
  std::optional<Sample> first;
  std::uint64_t reload_new_reservations = 0;
  int reloads = 0;

  explicit LoadPool(const Args& args) {
    memory.huge_pages = args.huge_pages;
    memory.lock = args.lock;
    anon_huge_before = meminfo("AnonHugePages");
    huge_free_before = meminfo("HugePages_Free");
    pool = pinload::Pool::create(pinload::make_locked_memory_backend(pinload::default_env(), memory));
  }

  // Adds a cold or warm load to *series. The first load of the run also
  // records in results["pool_memory"] how the pool's memory is backed.
  void record(BenchRun& run, Series* series, Sample s) {
    s.extra["fresh_pool"] = !first.has_value();
    if (!first) {
      first = s;
      run.results["pool_memory"] = {
          {"backend", std::string(pool->backend_name())},
          {"huge_pages_option", huge_pages_name(run.args.huge_pages)},
          {"reserved_bytes", pool->stats().reserved_bytes},
          {"anon_huge_pages_delta_bytes", meminfo("AnonHugePages") - anon_huge_before},
          {"explicit_huge_pages_used", huge_free_before - meminfo("HugePages_Free")},
      };
    } else {
      reload_new_reservations += s.extra["new_os_reservations"].get<std::uint64_t>();
      ++reloads;
    }
    series->runs.push_back(std::move(s));
  }
};

// --device opens first, so that a missing GPU fails before minutes of fio.
// The stand-in does not poison fresh memory here: a GPU's cudaMalloc writes nothing.
std::unique_ptr<pinload::Device> open_target_device(const Args& args) {
  if (args.device.empty()) return nullptr;
  // "cpu" is host memory, not a device: open_device refuses it.
  return pinload::open_device(pinload::parse_device_spec(args.device, "--device"), {.poison = false});
}

// The JSON's description of the run: tool, machine, files, options.
json describe_run(const BenchRun& run, const pinload::Checkpoint& ck) {
  const Args& args = run.args;
  json out;
  out["tool"] = "pinload-bench";
  out["label"] = args.label;
  out["host"] = host_info(run.files);
  out["paths"] = args.paths;
  json files_j = json::array();
  for (std::size_t i = 0; i < run.files.size(); ++i) {
    files_j.push_back({{"path", run.files[i]}, {"bytes", run.sizes[i]}});
  }
  out["files"] = files_j;
  out["tensors"] = ck.tensor_count();
  out["data_bytes"] = ck.data_bytes();
  out["file_bytes"] = run.file_bytes;
  out["options"] = {{"threads", args.load.threads},
                    {"block_size", args.load.block_size},
                    {"direct", direct_arg_name(args.load.direct)},
                    {"cached_read", cached_read_arg_name(args.load.cached_read)},
                    {"files_in_flight", args.load.files_in_flight},
                    {"repeat", args.repeat},
                    {"huge_pages", huge_pages_name(args.huge_pages)},
                    {"lock", args.lock},
                    {"phases", args.phases}};
  return out;
}

// --hugetlb: vm.nr_hugepages for the run (restored when *reservation goes);
// adds out["hugetlb"].
void reserve_huge_pages(const BenchRun& run, HugeTlbReservation* reservation, json* out) {
  const Args& args = run.args;
  if (args.hugetlb == "off") return;
  long pages = 0;
  if (args.hugetlb == "auto") {
    pages = 80;  // fio: 32 x 2 MiB buffers and slack
    if (args.huge_pages == pinload::HugePages::kExplicit) {
      // A block is a whole size class (pool.h); a class is a multiple of 2 MiB.
      for (std::uint64_t sz : run.sizes) {
        pages += static_cast<long>(pinload::Pool::size_class(sz + 8192) / (2u << 20)) + 1;
      }
    }
  } else {
    pages = static_cast<long>(parse_size(args.hugetlb));
  }
  json report;
  reservation->set(pages, &report);
  std::cerr << "[hugetlb] vm.nr_hugepages " << report.dump() << " (restored at exit)\n";
  (*out)["hugetlb"] = report;
}

// ---- phases, in the order they run ----

struct MemcpyLimit {
  double single = 0, multi = 0;  // GB/s; 0: not measured
  double best() const { return std::max(multi, single); }
};

// memcpy: one thread and all cores (results["memcpy"]).
MemcpyLimit memcpy_phase(BenchRun& run) {
  MemcpyLimit m;
  const Args& args = run.args;
  std::cerr << "[memcpy] " << size_name(args.memcpy_bytes) << " buffers\n";
  m.single = memcpy_gbps(args.memcpy_bytes, 1, 3);
  m.multi = memcpy_gbps(args.memcpy_bytes, run.cores, 3);
  std::cerr << "  1 thread " << fmt(m.single) << " GB/s, " << run.cores << " threads " << fmt(m.multi) << " GB/s\n";
  run.results["memcpy"] = {{"bytes", args.memcpy_bytes},
                           {"single_gbps", m.single},
                           {"multi_gbps", m.multi},
                           {"multi_threads", run.cores}};
  return m;
}

struct BufferedReadLimit {
  double cold = 0, warm = 0;  // GB/s; 0: not measured
};

// buffered: a plain single-thread read(), cold then warm (results["buffered_read"]).
BufferedReadLimit buffered_phase(BenchRun& run) {
  std::cerr << "[buffered] single-thread read(), 1 MiB buffer\n";
  const double resident = run.drop();
  Sample c = buffered_read(run.files);
  log_sample("cold", c);
  Sample w = buffered_read(run.files);
  log_sample("warm", w);
  run.results["buffered_read"] = {{"cold_gbps", c.gbps}, {"cold_seconds", c.seconds}, {"warm_gbps", w.gbps},
                                  {"warm_seconds", w.seconds}, {"resident_before_cold", resident}};
  return {c.gbps, w.gbps};
}

struct ColdRoundsResult {
  std::map<std::string, Series> fio;  // by variant name
  std::string fio_error;
  pinload::bench::FioComparison vs_fio;
  double fio_best = 0, fio_parallel_best = 0;
};

// fio and cold: fio and pinload interleaved, so that both see the same storage
// weather (this is a shared machine); ratios are taken per round. The first
// pinload load fills the fresh pool and is reported alone; each round then
// compares a re-load with fio (Note [Comparing with fio]). Adds results["fio"].
ColdRoundsResult cold_rounds_phase(BenchRun& run, LoadPool& loads) {
  const Args& args = run.args;
  ColdRoundsResult out;
  std::map<std::string, Series>& fio = out.fio;
  const bool do_fio = args.has("fio"), do_cold = args.has("cold");
  const auto rounds = static_cast<std::size_t>(std::max(args.repeat, 0));
  if (do_fio || do_cold) {
    std::cerr << "[cold rounds] " << (do_cold ? "1 first load, then " : "") << rounds << " x ("
              << (do_fio ? "fio iodepth 32, 1, parallel; " : "")
              << (do_cold ? "pinload " + std::to_string(args.load.threads) + " threads, block " +
                                size_name(args.load.block_size) + ", direct " + direct_arg_name(args.load.direct)
                          : std::string())
              << "), alternating which goes first\n";
  }
  // Each sample of a round carries extra["round"], from which the comparison
  // with fio is built.
  auto cold_load = [&](const char* what, std::optional<std::size_t> round) {
    const double resident = run.drop();
    Sample s = pinload_load(args.paths, args.load, loads.pool);
    s.extra["resident_before"] = resident;
    if (round) s.extra["round"] = *round;
    log_sample(what, s);
    loads.record(run, &loads.cold, std::move(s));
  };
  if (do_cold) cold_load("pinload cold, fresh pool", std::nullopt);
  for (std::size_t r = 0; r < rounds && (do_fio || do_cold); ++r) {
    auto run_fio = [&] {
      if (!do_fio || !out.fio_error.empty()) return;
      for (const FioVariant& v : kFioVariants) {
        if (v.hugebuf && meminfo("HugePages_Free") < 72) continue;
        run.drop();
        auto s = fio_read(run.files, v, args.fio_runtime, &out.fio_error);
        if (!s) {
          std::cerr << "  fio skipped: " << out.fio_error << "\n";
          return;
        }
        log_sample(std::string("fio ") + v.name, *s);
        s->extra["round"] = r;
        fio[v.name].runs.push_back(std::move(*s));
      }
    };
    auto run_pinload = [&] {
      if (do_cold) cold_load("pinload cold, re-load", r);
    };
    in_rotated_order(r, {run_fio, run_pinload});
  }
  pinload::bench::ColdRounds cold_rounds;
  cold_rounds.fio.resize(rounds);
  cold_rounds.pinload.assign(rounds, 0);
  for (const auto& [variant, series] : fio) {
    for (const Sample& s : series.runs) cold_rounds.fio[s.extra["round"].get<std::size_t>()][variant] = s.gbps;
  }
  for (const Sample& s : loads.cold.runs) {
    if (s.extra.contains("round")) cold_rounds.pinload[s.extra["round"].get<std::size_t>()] = s.gbps;
  }
  out.vs_fio = pinload::bench::compare_with_fio(cold_rounds);
  if (do_fio) {
    json fio_j;
    double fio_hugebuf_best = 0;
    if (!out.fio_error.empty()) fio_j["error"] = out.fio_error;
    for (const FioVariant& v : kFioVariants) {
      if (!fio.count(v.name)) continue;
      const Series& series = fio[v.name];
      fio_j[v.name] = series.to_json();
      fio_j[v.name]["command"] = series.runs.front().extra["command"];
      fio_j[v.name]["title"] = fio_variant_title(v);
      if (v.parallel) out.fio_parallel_best = series.best();
      else if (v.hugebuf) fio_hugebuf_best = std::max(fio_hugebuf_best, series.best());
    }
    out.fio_best = out.vs_fio.fio_best_any;
    fio_j["best_gbps"] = out.fio_best;  // of every iodepth 32 and 1 run, numjobs 1 (huge-page buffers included)
    fio_j["hugebuf_best_gbps"] = fio_hugebuf_best;
    fio_j["parallel_best_gbps"] = out.fio_parallel_best;
    if (!out.vs_fio.reference.empty()) {
      fio_j["reference"] = out.vs_fio.reference;  // Note [Comparing with fio]
      fio_j["reference_best_gbps"] = out.vs_fio.reference_best;
      fio_j["reference_median_gbps"] = out.vs_fio.reference_median;
    }
    run.results["fio"] = fio_j;
  }
  return out;
}

struct WarmResult {
  std::vector<double> round_ratio;          // pinload warm / memcpy of the same round
  std::map<std::string, Series> forced;     // the same rounds with each forced CachedRead
  std::vector<double> map_over_pread;       // per round
};

// warm (and cached-read): loads with the files in the page cache, each round
// with its own memcpy; with cached-read, also one load with each forced
// CachedRead (Note [Mapped reads]). Adds results["pinload_warm_cached_read_*"].
WarmResult warm_phase(BenchRun& run, LoadPool& loads) {
  const Args& args = run.args;
  WarmResult out;
  const std::pair<const char*, pinload::CachedRead> kForced[] = {{"map", pinload::CachedRead::kMap},
                                                                 {"pread", pinload::CachedRead::kPread}};
  std::cerr << "[pinload warm]\n";
  buffered_read(run.files);  // bring the files into the page cache
  const double resident = std::round(residency(run.files, run.sizes) * 1000) / 1000;
  for (int r = 0; r < args.repeat; ++r) {
    // memcpy in the same round, so the ratio sees the same CPU weather.
    const double round_memcpy = args.has("memcpy") ? std::max(memcpy_gbps(args.memcpy_bytes, 1, 1),
                                                              memcpy_gbps(args.memcpy_bytes, run.cores, 1))
                                                   : 0;
    // The load as configured, then (cached-read) one with each forced CachedRead.
    std::vector<std::function<void()>> steps = {[&] {
      Sample s = pinload_load(args.paths, args.load, loads.pool);
      s.extra["resident_before"] = resident;
      if (round_memcpy > 0) {
        s.extra["round_memcpy_gbps"] = round_memcpy;
        out.round_ratio.push_back(s.gbps / round_memcpy);
      }
      log_sample("warm", s);
      loads.record(run, &loads.warm, std::move(s));
    }};
    double forced_gbps[2] = {0, 0};
    if (args.has("cached-read")) {
      for (std::size_t m = 0; m < 2; ++m) {
        steps.push_back([&, m] {
          const auto& [name, method] = kForced[m];
          pinload::LoadOptions forced = args.load;
          forced.cached_read = method;
          Sample o = pinload_load(args.paths, forced, loads.pool);
          log_sample(std::string("warm, --cached-read ") + name, o);
          forced_gbps[m] = o.gbps;
          out.forced[name].runs.push_back(std::move(o));
        });
      }
    }
    in_rotated_order(static_cast<std::size_t>(r), steps);
    if (args.has("cached-read")) out.map_over_pread.push_back(forced_gbps[0] / forced_gbps[1]);
  }
  for (const auto& [name, series] : out.forced) run.results["pinload_warm_cached_read_" + name] = series.to_json();
  return out;
}

// The cold and warm loads of the pool (results["pinload_cold"],
// ["pinload_warm"], ["reload"]). Returns the cold loads without the
// fresh-pool one: the steady state of a server re-loading.
Series summarize_loads(BenchRun& run, const LoadPool& loads) {
  Series cold_reused;
  for (const auto& s : loads.cold.runs) {
    if (!s.extra.value("fresh_pool", false)) cold_reused.runs.push_back(s);
  }
  json& results = run.results;
  if (!loads.cold.empty()) {
    results["pinload_cold"] = loads.cold.to_json();
    results["pinload_cold"]["reused_pool_best_gbps"] = cold_reused.best();
    results["pinload_cold"]["reused_pool_median_gbps"] = cold_reused.median();
  }
  if (!loads.warm.empty()) results["pinload_warm"] = loads.warm.to_json();
  if (loads.first) {
    const auto st = loads.pool->stats();
    results["reload"] = {{"first_load_seconds", loads.first->seconds},
                         {"first_load_gbps", loads.first->gbps},
                         {"first_load_new_os_reservations", loads.first->extra["new_os_reservations"]},
                         {"reloads", loads.reloads},
                         {"reload_new_os_reservations", loads.reload_new_reservations},
                         {"pool_stats_after", {{"reserved_bytes", st.reserved_bytes},
                                               {"os_reservations", st.os_reservations},
                                               {"os_releases", st.os_releases},
                                               {"allocations", st.allocations},
                                               {"free_list_hits", st.free_list_hits}}}};
    if (!cold_reused.empty()) {
      std::vector<double> t;
      for (const auto& s : cold_reused.runs) t.push_back(s.seconds);
      results["reload"]["cold_reload_median_seconds"] = median_of(t);
    }
  }
  return cold_reused;
}

// sweep: cold (and warm) loads over threads x block size (results["sweep"]).
void sweep_phase(BenchRun& run, LoadPool& loads) {
  const Args& args = run.args;
  json sweep = json::array();
  const auto before = loads.pool->stats();
  std::cerr << "[sweep] cold";
  for (unsigned t : args.sweep_threads) {
    for (std::size_t b : args.sweep_blocks) {
      pinload::LoadOptions o = args.load;
      o.threads = t;
      o.block_size = b;
      Series c;
      for (int r = 0; r < args.sweep_repeat; ++r) {
        run.drop();
        c.runs.push_back(pinload_load(args.paths, o, loads.pool));
      }
      std::cerr << " " << fmt(c.best()) << std::flush;
      sweep.push_back({{"threads", t}, {"block_size", b}, {"cold", c.to_json()}});
    }
  }
  std::cerr << "\n";
  if (args.sweep_warm) {
    std::cerr << "[sweep] warm";
    buffered_read(run.files);
    std::size_t i = 0;
    for (unsigned t : args.sweep_threads) {
      for (std::size_t b : args.sweep_blocks) {
        pinload::LoadOptions o = args.load;
        o.threads = t;
        o.block_size = b;
        Series w;
        for (int r = 0; r < args.sweep_repeat; ++r) w.runs.push_back(pinload_load(args.paths, o, loads.pool));
        std::cerr << " " << fmt(w.best()) << std::flush;
        sweep[i++]["warm"] = w.to_json();
      }
    }
    std::cerr << "\n";
  }
  run.results["sweep"] = sweep;
  run.results["sweep_new_os_reservations"] = loads.pool->stats().os_reservations - before.os_reservations;
}

// switch: switching back to a model held in a ModelCache against the cold load
// that filled it; with a device, a hit to it (get_on) against a bare upload()
// (results["switch"]). Returns the host hit's median over the cold load.
double switch_phase(BenchRun& run, LoadPool& loads, pinload::Device* device) {
  const Args& args = run.args;
  json& results = run.results;
  PreadCountingEnv env;
  pinload::ModelCache cache(UINT64_MAX, std::make_shared<const pinload::Loader>(args.load, loads.pool, &env));
  const double resident = run.drop();
  const auto t0 = Clock::now();
  const std::uint64_t bytes = cache.get(args.paths).total_bytes();  // a miss: the cold load
  const double cold_s = seconds_since(t0);
  const std::uint64_t cold_preads = env.preads.load();
  const auto before = loads.pool->stats();
  const int hits = 20 * args.repeat;
  std::vector<double> hit_s;
  for (int i = 0; i < hits; ++i) {
    const auto t = Clock::now();
    const pinload::StateDict sd = cache.get(args.paths);
    hit_s.push_back(seconds_since(t));
  }
  const auto after = loads.pool->stats();
  const double hit_median = median_of(hit_s);
  const double switch_ratio = hit_median / cold_s;
  const pinload::ModelCacheStats cs = cache.stats();
  results["switch"] = {{"bytes", bytes},
                       {"resident_before_cold", resident},
                       {"cold_seconds", cold_s},
                       {"cold_gbps", static_cast<double>(bytes) / cold_s / 1e9},
                       {"cold_preads", cold_preads},
                       {"hits", hits},
                       {"hit_median_seconds", hit_median},
                       {"hit_best_seconds", *std::min_element(hit_s.begin(), hit_s.end())},
                       {"hit_over_cold", switch_ratio},
                       {"preads_on_hits", env.preads.load() - cold_preads},
                       {"new_os_reservations_on_hits", after.os_reservations - before.os_reservations},
                       {"allocations_on_hits", after.allocations - before.allocations},
                       {"cache_hits", cs.hits},
                       {"cache_misses", cs.misses},
                       {"cached_bytes", cs.cached_bytes}};
  std::cerr << "[switch] cold load " << fmt(cold_s, 3) << " s (" << cold_preads << " preads); switching back, "
            << hits << " hits: median " << fmt(hit_median * 1e6, 1) << " us = " << fmt(switch_ratio * 100, 4)
            << " % of the cold load, " << results["switch"]["preads_on_hits"].dump() << " preads, "
            << results["switch"]["new_os_reservations_on_hits"].dump() << " new OS reservations\n";
  if (device == nullptr) return switch_ratio;

  // A hit to the device (get_on) against a bare upload() of the same host
  // copy, alternated; host copies in the device's pinned memory, as a GPU service sets it up.
  auto pinned = pinload::Pool::create(device->make_pinned_backend());
  pinload::ModelCache on_device(UINT64_MAX, std::make_shared<const pinload::Loader>(args.load, pinned, &env));
  const pinload::StateDict host = on_device.get(args.paths);
  const std::uint64_t preads = env.preads.load();
  std::vector<double> bare_s, get_on_s;
  // Each result is freed before the next copy, and the order alternates, so that neither
  // side always gets the device memory the other has just freed.
  auto time_upload = [&] {
    const auto t = Clock::now();
    const pinload::StateDict bare = pinload::upload(host, *device, args.copy);
    bare_s.push_back(seconds_since(t));
  };
  auto time_get_on = [&] {
    const auto t = Clock::now();
    const pinload::StateDict hit = on_device.get_on(*device, args.paths, args.copy);
    get_on_s.push_back(seconds_since(t));
  };
  for (int i = 0; i < 4 * args.repeat + 1; ++i) in_rotated_order(static_cast<std::size_t>(i), {time_upload, time_get_on});
  const double bare = median_of(bare_s), hit = median_of(get_on_s);
  results["switch"]["device"] = {{"device", args.device},
                                 {"streams", args.copy.streams},
                                 {"chunk_bytes", args.copy.chunk_bytes},
                                 {"rounds", bare_s.size()},
                                 {"upload_median_seconds", bare},
                                 {"upload_gbps", static_cast<double>(bytes) / bare / 1e9},
                                 {"get_on_hit_median_seconds", hit},
                                 {"get_on_hit_gbps", static_cast<double>(bytes) / hit / 1e9},
                                 {"hit_over_upload", hit / bare},
                                 {"preads_on_hits", env.preads.load() - preads}};
  std::cerr << "[switch] to " << args.device << ": get_on hit " << fmt(hit, 4) << " s, bare upload() "
            << fmt(bare, 4) << " s of the same bytes: " << fmt(hit / bare, 3) << "x, "
            << results["switch"]["device"]["preads_on_hits"].dump() << " preads\n";
  return switch_ratio;
}

// pool: a fresh reservation of the checkpoint's blocks, timed alone, after the
// run's pool has given its memory back (results["pool_reserve"]).
void pool_phase(BenchRun& run, LoadPool& loads) {
  const Args& args = run.args;
  const std::uint64_t main_reserved = loads.pool->stats().reserved_bytes;
  loads.pool.reset();  // give its memory back first, so both do not coexist
  std::cerr << "[pool] fresh pool reserving the checkpoint's blocks after a cache drop (huge pages "
            << huge_pages_name(args.huge_pages) << ")\n";
  run.drop();
  std::this_thread::sleep_for(std::chrono::seconds(args.pool_settle));
  const pinload::bench::FirstTouch ft = pinload::bench::fresh_pool_first_touch(loads.memory, run.sizes);
  const double total_s = ft.reserve_seconds + ft.first_touch_seconds;
  run.results["pool_reserve"] = {{"reserved_bytes", ft.reserved_bytes},
                                 {"os_reservations", ft.os_reservations},
                                 {"reserve_seconds", ft.reserve_seconds},
                                 {"first_touch_seconds", ft.first_touch_seconds},
                                 {"gbps", static_cast<double>(ft.reserved_bytes) / total_s / 1e9},
                                 {"locked", ft.locked},
                                 {"settle_seconds", args.pool_settle},
                                 {"main_pool_reserved_bytes", main_reserved}};
  std::cerr << "  " << fmt(static_cast<double>(ft.reserved_bytes) / 1e9) << " GB: reserve "
            << fmt(ft.reserve_seconds, 3) << " s + first touch " << fmt(ft.first_touch_seconds, 3) << " s = "
            << fmt(static_cast<double>(ft.reserved_bytes) / total_s / 1e9) << " GB/s\n";
}

// verify: the cost of checking a load against a manifest (Note [Verified
// loads] in manifest.h). The manifest is made first (not timed); then
// --repeat rounds of three cold loads into the kept pool (plain, against the
// manifest, against the files' whole sha256), in rotated order, so that all
// see the same storage weather. Adds results["verify"]; the ratio is the
// median of the per-round verified/plain times.
std::optional<double> verify_phase(BenchRun& run, LoadPool& loads) {
  const Args& args = run.args;
  const auto t0 = Clock::now();
  pinload::ManifestOptions mo;
  mo.variant = args.load.resolve.variant;
  auto manifest = std::make_shared<const pinload::Manifest>(pinload::make_manifest(args.paths, mo));
  std::cerr << "[verify] manifest of " << run.files.size() << " file(s) in " << fmt(seconds_since(t0)) << " s; "
            << args.repeat << " x (cold: plain, against the manifest, against whole-file sha256), rotated\n";
  pinload::LoadOptions verified = args.load;
  verified.verify.manifest = manifest;
  // The whole files' digests alone, as a hub publishes them: hashed in file order.
  pinload::LoadOptions published = args.load;
  for (const pinload::ManifestFile& f : manifest->files) published.verify.file_sha256.emplace_back(f.name, f.sha256);
  // The pool is filled once first (untimed), so that no round pays its OS reservations.
  if (loads.pool->stats().reserved_bytes == 0) {
    run.drop();
    log_sample("cold, filling the pool (not counted)", pinload_load(args.paths, args.load, loads.pool));
  }
  Series plain, checked, whole;
  std::vector<double> per_round, whole_per_round;
  for (std::size_t r = 0; r < static_cast<std::size_t>(std::max(args.repeat, 1)); ++r) {
    double plain_s = 0, checked_s = 0, whole_s = 0;
    auto cold = [&](const char* what, const pinload::LoadOptions& options, Series* series, double* seconds) {
      run.drop();
      Sample s = pinload_load(args.paths, options, loads.pool);
      log_sample(what, s);
      *seconds = s.seconds;
      series->runs.push_back(std::move(s));
    };
    in_rotated_order(r, {[&] { cold("cold, plain", args.load, &plain, &plain_s); },
                         [&] { cold("cold, verified (manifest)", verified, &checked, &checked_s); },
                         [&] { cold("cold, verified (whole-file sha256)", published, &whole, &whole_s); }});
    per_round.push_back(checked_s / plain_s);
    whole_per_round.push_back(whole_s / plain_s);
  }
  const double ratio = median_of(per_round);
  run.results["verify"] = {{"plain", plain.to_json()},
                           {"verified", checked.to_json()},
                           {"file_sha256", whole.to_json()},
                           {"verified_over_plain_time_per_round", per_round},
                           {"file_sha256_over_plain_time_per_round", whole_per_round},
                           {"piece_bytes", manifest->piece_bytes}};
  std::cerr << "  time over plain, median of rounds: manifest " << fmt(ratio, 3) << ", whole-file sha256 "
            << fmt(median_of(whole_per_round), 3) << "\n";
  return ratio;
}

// ---- after the phases ----

// What the phases measured, for the ratios and the table.
struct Measured {
  MemcpyLimit memcpy;
  BufferedReadLimit buffered;
  ColdRoundsResult cold_rounds;
  WarmResult warm;
  Series cold_reused;
  std::optional<double> switch_ratio;
  std::optional<DevicePhase> device;
  std::optional<double> verify_ratio;  // verified / plain cold load time
};

// out["ratios"] and out["targets"] from what was measured.
void ratios_and_targets(const Measured& m, const LoadPool& loads, const json& results, json* ratios_out,
                        json* targets_out) {
  json& ratios = *ratios_out;
  json& targets = *targets_out;
  const pinload::bench::FioComparison& vs_fio = m.cold_rounds.vs_fio;
  const double fio_best = m.cold_rounds.fio_best;
  if (vs_fio.reference_best > 0 && vs_fio.pinload_best > 0) {
    // Note [Comparing with fio]: the target is on the reference variant.
    ratios["cold_best_over_fio_reference_best"] = vs_fio.best_over_reference_best();
    if (vs_fio.same_round_reference) {
      ratios["cold_over_fio_reference_same_round_median"] = *vs_fio.same_round_reference;
    }
    ratios["cold_best_over_fio_best"] = vs_fio.pinload_best / vs_fio.fio_best_any;
    if (vs_fio.same_round_best_variant) {
      ratios["cold_over_fio_best_variant_same_round_median"] = *vs_fio.same_round_best_variant;
    }
    targets["cold_ge_0.9_fio"] = vs_fio.meets(0.9);
  }
  if (!loads.cold.empty() && fio_best > 0 && loads.cold.runs.front().extra.value("fresh_pool", false)) {
    ratios["cold_fresh_pool_over_fio_best"] = loads.cold.runs.front().gbps / fio_best;
  }
  if (vs_fio.same_round_parallel) {
    ratios["cold_best_over_fio_parallel_best"] = vs_fio.pinload_best / m.cold_rounds.fio_parallel_best;
    ratios["cold_over_fio_parallel_same_round_median"] = *vs_fio.same_round_parallel;
  }
  if (!m.cold_reused.empty() && m.buffered.cold > 0) {
    ratios["cold_over_read_1thread_cold"] = m.cold_reused.best() / m.buffered.cold;
  }
  if (!loads.warm.empty() && m.memcpy.multi > 0) {
    // The machine's memcpy ceiling is the better of one thread and all cores.
    ratios["warm_best_over_memcpy_best"] = loads.warm.best() / m.memcpy.best();
    ratios["warm_median_over_memcpy_best"] = loads.warm.median() / m.memcpy.best();
    if (!m.warm.round_ratio.empty()) ratios["warm_over_memcpy_same_round_median"] = median_of(m.warm.round_ratio);
    targets["warm_ge_0.8_memcpy"] = loads.warm.best() / m.memcpy.best() >= 0.8;
  }
  if (!loads.warm.empty() && m.buffered.warm > 0) {
    ratios["warm_over_read_1thread_warm"] = loads.warm.best() / m.buffered.warm;
  }
  if (!m.warm.map_over_pread.empty()) {
    ratios["warm_map_over_pread_same_round_median"] = median_of(m.warm.map_over_pread);
  }
  if (loads.reloads > 0) targets["reload_zero_new_os_reservations"] = loads.reload_new_reservations == 0;
  if (m.device) {
    ratios.update(m.device->ratios);
    targets.update(m.device->targets);
  }
  if (m.verify_ratio) {
    ratios["verify_cold_time_over_plain_same_round_median"] = *m.verify_ratio;
    targets["verify_cost_le_10pct_cold"] = *m.verify_ratio <= 1.10;
  }
  if (m.switch_ratio) {
    ratios["switch_hit_over_cold"] = *m.switch_ratio;
    targets["switch_hit_le_0.01_cold"] = *m.switch_ratio <= 0.01;
    targets["switch_hit_zero_preads"] = results["switch"]["preads_on_hits"].get<std::uint64_t>() == 0;
    if (results["switch"].contains("device")) {
      const json& d = results["switch"]["device"];
      ratios["switch_device_hit_over_upload"] = d["hit_over_upload"];
      targets["switch_device_hit_le_1.10_upload"] = d["hit_over_upload"].get<double>() <= 1.10;
    }
  }
}

// The summary table on stdout: every measurement, the ratios, the targets, the sweep.
void print_table(const BenchRun& run, const Measured& m, const LoadPool& loads, const json& out) {
  const Args& args = run.args;
  const json& results = out["results"];
  const json& ratios = out["ratios"];
  const json& targets = out["targets"];
  std::printf("\n%-56s %8s %8s %8s\n", "measurement", "best", "median", "runs");
  auto row = [](const std::string& name, double best, double median, std::size_t runs) {
    std::printf("%-56s %8.2f %8s %8zu\n", name.c_str(), best, median > 0 ? fmt(median).c_str() : "", runs);
  };
  if (m.memcpy.multi > 0) {
    row("memcpy, " + std::to_string(run.cores) + " threads", m.memcpy.multi, 0, 3);
    row("memcpy, 1 thread", m.memcpy.single, 0, 3);
  }
  for (const FioVariant& v : kFioVariants) {
    const auto it = m.cold_rounds.fio.find(v.name);
    if (it == m.cold_rounds.fio.end()) continue;
    row(fio_variant_title(v), it->second.best(), it->second.median(), it->second.runs.size());
  }
  if (m.buffered.cold > 0) {
    row("read(), 1 thread, 1 MiB, cold", m.buffered.cold, 0, 1);
    row("read(), 1 thread, 1 MiB, warm", m.buffered.warm, 0, 1);
  }
  const std::string cfg = std::to_string(args.load.threads) + " thr, " + size_name(args.load.block_size) + ", direct " +
                          direct_arg_name(args.load.direct);
  if (results.contains("verify")) {
    const json& v = results["verify"];
    for (const char* k : {"plain", "verified", "file_sha256"}) {
      row(std::string("pinload cold, ") + (std::string(k) == "plain" ? "plain" : std::string(k) == "verified"
                                                                           ? "verified against a manifest"
                                                                           : "verified against whole-file sha256"),
          v[k]["best_gbps"].get<double>(), v[k]["median_gbps"].get<double>(), v[k]["runs"].size());
    }
  }
  if (!loads.cold.empty()) {
    if (loads.cold.runs.front().extra.value("fresh_pool", false)) {
      row("pinload cold, fresh pool (" + cfg + ")", loads.cold.runs.front().gbps, 0, 1);
    }
    if (!m.cold_reused.empty()) {
      row("pinload cold, re-load (" + cfg + ")", m.cold_reused.best(), m.cold_reused.median(),
          m.cold_reused.runs.size());
    }
  }
  if (!loads.warm.empty()) row("pinload warm (" + cfg + ")", loads.warm.best(), loads.warm.median(), loads.warm.runs.size());
  for (const auto& [name, series] : m.warm.forced) {
    row("pinload warm, --cached-read " + name, series.best(), series.median(), series.runs.size());
  }
  if (results.contains("pool_reserve")) {
    const json& pr = results["pool_reserve"];
    row("fresh pool: reserve" + std::string(pr["locked"].get<bool>() ? " + mlock" : "") + " + touch, no I/O",
        pr["gbps"].get<double>(), 0, 1);
  }
  if (m.device) {
    row("pinned copy to " + args.device + ", " + size_name(args.memcpy_bytes),
        m.device->results["pinned_copy_gbps"].get<double>(), 0, 3);
    for (const auto& [name, series] : m.device->rows) row(name, series->best(), series->median(), series->runs.size());
  }
  std::printf("GB/s = 1e9 B/s. cache drop: %s. loadavg at start: %s, at end: %s\n",
              run.drop_method.empty() ? "none" : run.drop_method.c_str(),
              out["host"]["loadavg_at_start"].get<std::string>().c_str(),
              out["host"]["loadavg_at_end"].get<std::string>().c_str());
  if (!ratios.empty()) {
    std::printf("ratios:\n");
    for (auto& [k, v] : ratios.items()) {
      const double r = v.get<double>();
      std::printf(r < 0.01 ? "  %-44s %.6f\n" : "  %-44s %6.2f\n", k.c_str(), r);  // the switch ratio is tiny
    }
  }
  if (loads.first) {
    std::printf("re-load after unload: %d re-load(s), %llu new OS reservations (the first load made %llu)\n",
                loads.reloads, static_cast<unsigned long long>(loads.reload_new_reservations),
                static_cast<unsigned long long>(loads.first->extra["new_os_reservations"].get<std::uint64_t>()));
  }
  if (results.contains("pool_memory")) {
    const json& pm = results["pool_memory"];
    std::printf("pool memory: huge pages %s, %.2f GB reserved, THP-backed delta %.2f GB after the first load, "
                "%.2f GB at the end (%.2f GB collapsed while idle), explicit huge pages %lld\n",
                huge_pages_name(args.huge_pages), pm["reserved_bytes"].get<double>() / 1e9,
                pm["anon_huge_pages_delta_bytes"].get<double>() / 1e9,
                pm.value("anon_huge_pages_delta_bytes_at_end", 0.0) / 1e9, pm.value("collapsed_bytes_at_end", 0.0) / 1e9,
                static_cast<long long>(pm["explicit_huge_pages_used"].get<std::int64_t>()));
  }
  if (!targets.empty()) {
    std::printf("targets:\n");
    for (auto& [k, v] : targets.items()) std::printf("  %-44s %s\n", k.c_str(), v.get<bool>() ? "met" : "MISSED");
  }
  if (results.contains("sweep")) {
    std::printf("\nsweep (GB/s, cold%s):\n%8s", args.sweep_warm ? " / warm" : "", "threads");
    for (std::size_t b : args.sweep_blocks) std::printf(" %14s", size_name(b).c_str());
    std::printf("\n");
    std::size_t i = 0;
    for (unsigned t : args.sweep_threads) {
      std::printf("%8u", t);
      for (std::size_t b = 0; b < args.sweep_blocks.size(); ++b, ++i) {
        const json& p = results["sweep"][i];
        std::string cell = fmt(p["cold"]["best_gbps"].get<double>());
        if (p.contains("warm")) cell += " / " + fmt(p["warm"]["best_gbps"].get<double>());
        std::printf(" %14s", cell.c_str());
      }
      std::printf("\n");
    }
  }
}

int run(const Args& args) {
  std::unique_ptr<pinload::Device> target_device = open_target_device(args);
  pinload::Checkpoint ck = pinload::open_checkpoint(pinload::default_env(), args.paths, args.load.resolve);
  BenchRun run{.args = args};
  for (const auto& f : ck.files) {
    run.files.push_back(f.path);
    run.sizes.push_back(f.stat.size);
    run.file_bytes += f.stat.size;
  }
  run.cores = std::max(1u, std::thread::hardware_concurrency());

  json out = describe_run(run, ck);
  std::cerr << "pinload-bench: " << run.files.size() << " file(s), " << ck.tensor_count() << " tensors, "
            << fmt(static_cast<double>(ck.data_bytes()) / 1e9, 3) << " GB of tensor data\n";
  HugeTlbReservation hugetlb;
  reserve_huge_pages(run, &hugetlb, &out);

  Measured m;
  if (args.has("memcpy")) m.memcpy = memcpy_phase(run);
  if (args.has("buffered")) m.buffered = buffered_phase(run);
  LoadPool loads(args);  // after the limits, so that its memory is measured alone
  m.cold_rounds = cold_rounds_phase(run, loads);
  if (args.has("warm")) m.warm = warm_phase(run, loads);
  m.cold_reused = summarize_loads(run, loads);
  if (args.has("sweep")) sweep_phase(run, loads);
  if (args.has("switch")) m.switch_ratio = switch_phase(run, loads, target_device.get());
  if (args.has("verify")) m.verify_ratio = verify_phase(run, loads);
  // Before the pool phase, which gives the run's pool back.
  if (run.results.contains("pool_memory")) {  // Note [Huge pages for a kept pool]: what the idle pool became
    run.results["pool_memory"]["collapsed_bytes_at_end"] = loads.pool->stats().collapsed_bytes;
    run.results["pool_memory"]["anon_huge_pages_delta_bytes_at_end"] = meminfo("AnonHugePages") - loads.anon_huge_before;
  }
  if (args.has("pool")) pool_phase(run, loads);
  if (args.has("device")) {
    m.device = device_phase(args, target_device.get(), run.files, [&] { return run.drop(); }, m.cold_rounds.fio_best);
    run.results["device"] = m.device->results;
  }

  out["drop_cache_method"] = run.drop_method.empty() ? "none" : run.drop_method;
  out["host"]["loadavg_at_end"] = read_first_line("/proc/loadavg");
  out["results"] = run.results;
  json ratios, targets;
  ratios_and_targets(m, loads, run.results, &ratios, &targets);
  out["ratios"] = ratios;
  out["targets"] = targets;

  print_table(run, m, loads, out);
  if (!args.json_out.empty()) {
    std::ofstream f(args.json_out);
    f << out.dump(2) << "\n";
    if (!f) throw std::runtime_error("cannot write " + args.json_out);
    std::printf("\nwrote %s\n", args.json_out.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const UsageError& e) {
    std::cerr << "pinload-bench: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "pinload-bench: " << e.what() << "\n";
    return 1;
  }
}
