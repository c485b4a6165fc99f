// fp8-bench: the same model stored in bf16 and converted to FP8, loaded cold
// to bf16 tensors in one run; host conversion throughput against memcpy of
// the same bytes; fp32 -> bf16 loads against plain fp32 loads (convert.h,
// Note [Conversion on load]).
//
//   fp8-bench [--dir DIR] [--size-mib N] [--rounds R] [--threads T] [--block-size-kib K] [--json FILE]
//             [--device cuda:0|sim] [--cases NAME,...]
//
// DIR (default /tmp/pinload-fp8-bench) receives bf16.safetensors (N MiB of
// transformer-shaped bf16 weights, random), fp8.safetensors (its `pinload
// convert`) and fp32.safetensors (N MiB of fp32), made once and reused.
// Cases (wall time, and the process's CPU time: user + system), each cold
// (page cache dropped: drop_caches as root, else
// posix_fadvise DONTNEED after fsync), in rotated order, R rounds:
//   bf16            the bf16 file as stored, pool kept (the kept cases
//                   share one pool, filled and settled in huge pages before
//                   the rounds)
//   fp8->bf16       the FP8 file with dtype=bf16, pool kept
//   fp8             the FP8 file as stored, pool kept: the read alone, the
//                   floor of fp8->bf16
//   fp32            the fp32 file as stored, pool kept
//   fp32->bf16      the fp32 file with dtype=bf16, pool kept
//   fp32->bf16 budget   the same into a pool whose budget holds the bf16
//                   output and the conversion ring, not the fp32 file
//                   besides (Note [Conversion ring]); host loads only
//   fresh bf16 / fresh fp8->bf16 / fresh fp32 / fresh fp32->bf16
//                   a new Loader and pool per load (new memory, as in a
//                   fresh process)
// beside
//   first-touch     mmap + touch of the bf16 bytes by T threads: the
//                   fresh-memory limit
// and, in memory: fp8->bf16 conversion by T threads against memcpy of the
// same output bytes by T threads (best of R); then, per SIMD target this
// build and CPU run (each forced in turn, Note [SIMD targets]), fp8->bf16
// and fp32->bf16 conversions of 64 MiB of output by T threads against the
// same memcpy (best of R). The loads run on the best target, or on
// PINLOAD_SIMD's.
// With --device, the loads go to the device (kCached: FP8 crosses to the
// device at half the bytes and the kernel converts it there), and
// "pinned copy" is the bf16 bytes copied from a pinned pool block with one
// copy_to_device_async: the link's limit in the same run.
// --cases runs only the named load cases (e.g. fp32,fp32->bf16: more rounds
// of one comparison in the same time); ratios needing another case are left
// out. Each load case's stages (Note [Load stages] in io/read_session.h:
// where the readers, converting threads and the load's thread spent their
// time) are printed as a table, per load, and written to --json.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "format/dtype_bits.h"
#include "format/dtype_convert.h"
#include "format/simd.h"
#include "io/read_session.h"
#include "load/convert_on_load.h"
#include "memory/huge_page_collapse.h"
#include "cli/command.h"
#include "pinload/convert.h"
#include "pinload/device.h"
#include "pinload/loader.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace pinload;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The process's CPU time (user + system) so far: what a load cost in CPU,
// which other processes' load does not change as it does the wall time.
double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// A transformer-like bf16 or fp32 checkpoint of about `bytes`: blocks of
// q, k, v, o (3072 x 3072) and two MLP matrices, plus norms and biases.
void write_model(const std::string& path, std::uint64_t bytes, DType dtype) {
  const unsigned esize = dtype_bits(dtype) / 8;
  struct T {
    std::string name;
    std::vector<std::uint64_t> shape;
  };
  std::vector<T> tensors;
  constexpr std::uint64_t d = 3072;
  std::uint64_t total = 0;
  for (int b = 0; total < bytes; ++b) {
    const std::string p = "transformer_blocks." + std::to_string(b) + ".";
    for (const char* n : {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"}) {
      tensors.push_back({p + n + ".weight", {d, d}});
      tensors.push_back({p + n + ".bias", {d}});
    }
    tensors.push_back({p + "ff.net.0.proj.weight", {4 * d, d}});
    tensors.push_back({p + "ff.net.2.weight", {d, 4 * d}});
    tensors.push_back({p + "norm1.weight", {d}});
    total += (4 * d * d + 4 * d + 8 * d * d + d) * esize;
  }
  nlohmann::ordered_json header;
  std::uint64_t at = 0;
  for (const T& t : tensors) {
    std::uint64_t n = esize;
    for (auto s : t.shape) n *= s;
    header[t.name] = {{"dtype", std::string(dtype_name(dtype))}, {"shape", t.shape}, {"data_offsets", {at, at + n}}};
    at += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t len = text.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  std::vector<char> buffer(8u << 20);
  std::uint64_t state = 0x9E3779B97F4A7C15ull;
  for (std::uint64_t done = 0; done < at; done += buffer.size()) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), at - done));
    for (std::size_t i = 0; i + esize <= n; i += esize) {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      // Roughly normal weights of scale 0.02: a sum of uniforms.
      const float u = (static_cast<float>(state & 0xFFFF) + static_cast<float>((state >> 16) & 0xFFFF) +
                       static_cast<float>((state >> 32) & 0xFFFF) - 98302.5f) / 65536.0f * 0.035f;
      if (esize == 2) {
        const std::uint16_t h = bits::f32_to_bf16(u);
        std::memcpy(&buffer[i], &h, 2);
      } else {
        std::memcpy(&buffer[i], &u, 4);
      }
    }
    out.write(buffer.data(), static_cast<std::streamsize>(n));
  }
}

std::string drop_cache(const std::vector<std::string>& files) {
  ::sync();
  const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
  if (fd >= 0 && ::write(fd, "1", 1) == 1) {
    ::close(fd);
    return "drop_caches";
  }
  if (fd >= 0) ::close(fd);
  for (const std::string& f : files) {
    const int file = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (file < 0) continue;
    ::fdatasync(file);
    ::posix_fadvise(file, 0, 0, POSIX_FADV_DONTNEED);
    ::close(file);
  }
  return "fadvise";
}

template <class Fn>
void on_threads(unsigned threads, Fn fn) {
  std::vector<std::jthread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back([&, t] { fn(t); });
  fn(0);
}

struct Series {
  std::vector<double> seconds;
  double best() const { return seconds.empty() ? 0 : *std::min_element(seconds.begin(), seconds.end()); }
  double median() const {
    if (seconds.empty()) return 0;
    std::vector<double> s = seconds;
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
  }
};

// One load's stages (Note [Load stages] in read_session.h), in seconds:
// sums over the threads that passed them, and spans.
struct Stages {
  double gate = 0, staging = 0, slot = 0, fault_in = 0, read = 0, sink = 0, queued = 0, convert = 0, idle = 0,
         plan = 0, finish = 0, edges = 0;
  double before = 0;     // the load's start to the first read's start
  double read_span = 0;  // the first read's start to the last read's end
  double tail = 0;       // the last read's end to the last conversion's end
  double after = 0;      // the last read or conversion to the load's return
  double chunks = 0;
  static Stages take(std::uint64_t start, std::uint64_t end) {
    const detail::LoadStages& s = detail::load_stages();
    auto sec = [](const std::atomic<std::uint64_t>& a) { return static_cast<double>(a.load()) / 1e9; };
    Stages t;
    t.gate = sec(s.gate), t.staging = sec(s.staging), t.slot = sec(s.slot), t.fault_in = sec(s.fault_in);
    t.read = sec(s.read), t.sink = sec(s.sink), t.queued = sec(s.queued), t.convert = sec(s.convert);
    t.idle = sec(s.idle), t.plan = sec(s.plan), t.finish = sec(s.finish), t.edges = sec(s.edges);
    t.chunks = static_cast<double>(s.chunks.load());
    const std::uint64_t first = s.first_read_start.load(), last = s.last_read_end.load(),
                        converted = s.last_convert_end.load();
    if (last > first) t.read_span = static_cast<double>(last - first) / 1e9;
    if (converted > last) t.tail = static_cast<double>(converted - last) / 1e9;
    if (first != UINT64_MAX && first > start) t.before = static_cast<double>(first - start) / 1e9;
    if (end > std::max(last, converted)) t.after = static_cast<double>(end - std::max(last, converted)) / 1e9;
    return t;
  }
  void add(const Stages& o) {
    for (auto [a, b] : {std::pair{&gate, o.gate}, {&staging, o.staging}, {&slot, o.slot}, {&fault_in, o.fault_in},
                        {&read, o.read}, {&sink, o.sink}, {&queued, o.queued}, {&convert, o.convert},
                        {&idle, o.idle}, {&plan, o.plan}, {&finish, o.finish}, {&edges, o.edges}, {&before, o.before}, {&read_span, o.read_span}, {&tail, o.tail},
                        {&after, o.after}, {&chunks, o.chunks}}) {
      *a += b;
    }
  }
};

// The median over rounds of a's time over b's in the same round: the two ran
// minutes apart at most, so drift in the disk's speed between rounds cancels.
double same_round_ratio(const Series& a, const Series& b) {
  Series ratios;
  for (std::size_t r = 0; r < std::min(a.seconds.size(), b.seconds.size()); ++r) {
    ratios.seconds.push_back(a.seconds[r] / b.seconds[r]);
  }
  return ratios.median();
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp/pinload-fp8-bench";
  std::uint64_t size_mib = 512;
  int rounds = 3;
  unsigned threads = kDefaultThreads;
  std::uint64_t block_kib = kDefaultBlockSize >> 10;
  std::string json_path;
  std::string device_spec;
  std::string only_cases;
  // Parsed by CLI11, as the pinload command (src/cli/command.h).
  CLI::App app("FP8 against bf16 loads, conversions against memcpy (docs/fp8.md)", "fp8-bench");
  app.option_defaults()->always_capture_default();
  app.add_option("--dir", dir, "where the generated checkpoints are kept");
  app.add_option("--size-mib", size_mib, "MiB of bf16 weights in the generated checkpoint")
      ->transform(cli::integer_range(1, 1 << 20));
  app.add_option("--rounds", rounds, "rounds, each case once per round in a rotated order")
      ->transform(cli::integer_range(1, 1000));
  app.add_option("--threads", threads, "reader threads")->transform(cli::integer_range(1, kMaxThreads));
  app.add_option("--block-size-kib", block_kib, "KiB per read")->transform(cli::integer_range(4, 1 << 20));
  app.add_option("--json", json_path, "write the results as JSON");
  app.add_option("--device", device_spec, "cpu (host memory), sim or cuda:N");
  app.add_option("--cases", only_cases, "comma list of the cases to run (default all)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (!only_cases.empty()) only_cases = "," + only_cases + ",";
  try {
    fs::create_directories(dir);
    const std::string bf16 = dir + "/bf16.safetensors", fp8 = dir + "/fp8.safetensors", fp32 = dir + "/fp32.safetensors";
    if (!fs::exists(bf16)) write_model(bf16, size_mib << 20, DType::kBF16);
    if (!fs::exists(fp32)) write_model(fp32, size_mib << 20, DType::kF32);
    double convert_seconds = 0;
    if (!fs::exists(fp8)) {
      const auto t = Clock::now();
      ConvertOptions c;
      c.threads = threads;
      convert_checkpoint(bf16, fp8, c);
      convert_seconds = seconds_since(t);
    }
    const double size_ratio = static_cast<double>(fs::file_size(fp8)) / static_cast<double>(fs::file_size(bf16));

    // "cpu" (or no --device) is host memory: no Device (parse_device_spec in device.h).
    const DeviceSpec spec = parse_device_spec(device_spec.empty() ? "cpu" : device_spec, "--device");
    std::unique_ptr<Device> device = spec.is_host() ? nullptr : open_device(spec);
    LoadOptions plain;
    plain.threads = threads;
    plain.block_size = block_kib << 10;
    plain.target.device = device.get();
    // The kept cases read into the kept pool: a plain load of a cold file
    // would otherwise be handed out as a mapping that the page cache keeps
    // (Note [Keeping the page cache]), and the pool would stay empty.
    plain.zero_copy = ZeroCopy::kOff;
    LoadOptions to_bf16 = plain;
    to_bf16.dtype.to = DType::kBF16;
    // The kept cases share one pool, as the loads of one service do: a plain
    // load and a converting load of the same file read into the same block,
    // so the comparison is of the loads, not of where the memory they read
    // into happens to lie (with a pool per case, fp32->bf16 / fp32 went from
    // 0.87 to 1.02 between runs of the same build).
    const std::shared_ptr<Pool> kept_pool = Pool::create_default();
    const Loader bf16_loader(plain, kept_pool), fp8_loader(to_bf16, kept_pool), fp8_plain_loader(plain, kept_pool),
        fp32_loader(plain, kept_pool), fp32_bf16_loader(to_bf16, kept_pool);
    // A pool budget that holds the bf16 output and the conversion ring (Note
    // [Conversion ring]), not the fp32 file besides.
    const std::uint64_t fp32_bytes = fs::file_size(fp32);
    PoolOptions budget;
    budget.capacity_bytes = fp32_bytes / 2 + detail::kConversionRingBytes + (32u << 20);
    const Loader budget_loader(to_bf16, Pool::create_default(budget));
    struct Case {
      std::string name;
      const Loader* loader;  // null: a fresh Loader per load
      LoadOptions fresh;
      std::string file;
    };
    std::vector<Case> cases = {{"bf16", &bf16_loader, {}, bf16},
                               {"fp8->bf16", &fp8_loader, {}, fp8},
                               {"fp8", &fp8_plain_loader, {}, fp8},
                               {"fp32", &fp32_loader, {}, fp32},
                               {"fp32->bf16", &fp32_bf16_loader, {}, fp32},
                               {"fp32->bf16 budget", &budget_loader, {}, fp32},
                               {"fresh bf16", nullptr, plain, bf16},
                               {"fresh fp8->bf16", nullptr, to_bf16, fp8},
                               {"fresh fp32", nullptr, plain, fp32},
                               {"fresh fp32->bf16", nullptr, to_bf16, fp32}};
    // Device loads are never staged (a file's bytes cross whole): the budget case is the host's.
    if (device) std::erase_if(cases, [](const Case& c) { return c.name == "fp32->bf16 budget"; });
    if (!only_cases.empty()) {
      std::erase_if(cases, [&](const Case& c) { return only_cases.find("," + c.name + ",") == std::string::npos; });
      if (cases.empty()) throw std::invalid_argument("--cases names none of the cases");
    }
    // Pool kept: one untimed load per kept case into a pool of its own gives
    // the memory that load needs (its pool's peak); one more into the kept
    // pool fills it. Then the kept pool's idle blocks are left to collapse
    // into huge pages (Note [Huge pages for a kept pool]), the state a
    // long-lived process's pool settles in, so that no collapse runs between
    // the rounds and each round reads into the same pages.
    std::map<std::string, double> peak_bytes;
    for (const Case& c : cases) {
      if (c.loader == nullptr) continue;
      const Loader own(c.loader->options(), Pool::create_default(c.loader->pool()->options()));
      (void)drop_cache({bf16, fp8, fp32});  // cold, as timed: read, not mapped (Note [Zero-copy loads])
      (void)own.load({c.file});
      peak_bytes[c.name] = static_cast<double>(own.pool()->stats().peak_in_use_bytes);
      (void)c.loader->load({c.file});
    }
    detail::IdleBlocks::wait_idle();
    std::map<std::string, Series> series, cpu_series;
    std::map<std::string, Stages> stages;  // per case, summed over rounds
    std::string drop_method;
    std::uint64_t bf16_bytes = 0;
    for (int r = 0; r < rounds; ++r) {
      for (std::size_t k = 0; k < cases.size(); ++k) {
        const Case& c = cases[(k + static_cast<std::size_t>(r)) % cases.size()];
        drop_method = drop_cache({bf16, fp8, fp32});
        detail::load_stages().reset();
        const std::uint64_t stage_start = detail::LoadStages::now();
        const auto t = Clock::now();
        const double cpu = cpu_seconds();
        std::uint64_t total = 0;
        if (c.loader != nullptr) {
          total = c.loader->load({c.file}).total_bytes();
        } else {
          const Loader fresh(c.fresh);
          total = fresh.load({c.file}).total_bytes();
        }
        series[c.name].seconds.push_back(seconds_since(t));
        cpu_series[c.name].seconds.push_back(cpu_seconds() - cpu);
        stages[c.name].add(Stages::take(stage_start, detail::LoadStages::now()));
        if (c.name == "bf16") bf16_bytes = total;
      }
      if (!only_cases.empty()) continue;
      // The fresh-memory limit: mmap and first touch of the bf16 bytes.
      const auto t = Clock::now();
      void* p = ::mmap(nullptr, bf16_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
      on_threads(threads, [&](unsigned i) {
        const std::uint64_t part = (bf16_bytes / threads + 4095) / 4096 * 4096;
        const std::uint64_t begin = std::min<std::uint64_t>(bf16_bytes, part * i);
        const std::uint64_t end = std::min<std::uint64_t>(bf16_bytes, begin + part);
        for (std::uint64_t o = begin; o < end; o += 4096) static_cast<char*>(p)[o] = 1;
      });
      series["first-touch"].seconds.push_back(seconds_since(t));
      ::munmap(p, bf16_bytes);
      if (device) {
        // The link's limit: the bf16 bytes from pinned memory in one copy.
        static std::shared_ptr<Pool> pinned = Pool::create(device->make_pinned_backend());
        static std::shared_ptr<Block> block = pinned->allocate(bf16_bytes);
        static std::shared_ptr<DeviceBuffer> target = device->allocate(bf16_bytes);
        Stream stream = device->create_stream();
        const auto c = Clock::now();
        device->copy_to_device_async(*target, 0, block->data(), bf16_bytes, stream);
        stream.synchronize();
        series["pinned copy"].seconds.push_back(seconds_since(c));
      }
    }

    // Host conversion throughput against memcpy, in memory, same threads,
    // with no collapse of idle pool memory running beside them (one that did
    // had memcpy at a quarter of its rate, and both series scattered 3x).
    detail::IdleBlocks::wait_idle();
    const int memory_rounds = only_cases.empty() ? rounds : 0;
    const std::size_t elements = std::min<std::uint64_t>(bf16_bytes / 2, 256u << 20);
    std::vector<std::uint8_t> src(elements);
    for (std::size_t i = 0; i < elements; ++i) src[i] = static_cast<std::uint8_t>((i * 2654435761u) >> 24) & 0x7E;
    std::vector<std::uint16_t> out(elements), copy_src(elements, 1), copy_dst(elements);
    for (int r = 0; r < memory_rounds; ++r) {
      auto t = Clock::now();
      on_threads(threads, [&](unsigned i) {
        const std::size_t part = elements / threads;
        const std::size_t begin = part * i, n = i + 1 == threads ? elements - begin : part;
        convert_elements(ElementConversion{DType::kF8_E4M3, DType::kBF16, n, 0.01f}, src.data() + begin,
                         out.data() + begin);
      });
      series["convert fp8->bf16 (memory)"].seconds.push_back(seconds_since(t));
      t = Clock::now();
      on_threads(threads, [&](unsigned i) {
        const std::size_t part = elements / threads;
        const std::size_t begin = part * i, n = i + 1 == threads ? elements - begin : part;
        std::memcpy(copy_dst.data() + begin, copy_src.data() + begin, n * 2);
      });
      series["memcpy (memory)"].seconds.push_back(seconds_since(t));
    }

    // Per SIMD target: the same conversion, and fp32 -> bf16, on fewer
    // elements (its fp32 source is 4 bytes each), against memcpy of their
    // output (best of 3 x R each).
    const std::string load_target = simd::target();
    struct TargetFigures {
      double fp8_gbps = 0, fp32_gbps = 0, memcpy_gbps = 0;
    };
    std::vector<std::pair<std::string, TargetFigures>> per_target;
    if (memory_rounds > 0) {
      const std::size_t m = std::min<std::size_t>(elements, 32u << 20);
      std::vector<float> f32(m);
      for (std::size_t i = 0; i < m; ++i) f32[i] = bits::bf16_to_f32(static_cast<std::uint16_t>(0x3C00 + (i * 2654435761u >> 20) % 0x600));
      // Rounds interleave the targets (and memcpy beside each), so that
      // another process's burst weighs on all of them alike; best of
      // 3 x R rounds each.
      auto timed = [&](auto fn) {
        const auto t = Clock::now();
        on_threads(threads, [&](unsigned i) {
          const std::size_t part = m / threads;
          const std::size_t begin = part * i, n = i + 1 == threads ? m - begin : part;
          fn(begin, n);
        });
        return static_cast<double>(m) * 2 / 1e9 / seconds_since(t);
      };
      for (const std::string& target : simd::runnable_targets()) per_target.emplace_back(target, TargetFigures{});
      for (int r = 0; r < 3 * memory_rounds; ++r) {
        for (auto& [target, f] : per_target) {
          simd::set_target(target);
          f.fp8_gbps = std::max(f.fp8_gbps, timed([&](std::size_t begin, std::size_t n) {
            convert_elements(ElementConversion{DType::kF8_E4M3, DType::kBF16, n, 0.01f}, src.data() + begin,
                             out.data() + begin);
          }));
          f.fp32_gbps = std::max(f.fp32_gbps, timed([&](std::size_t begin, std::size_t n) {
            convert_elements(ElementConversion{DType::kF32, DType::kBF16, n, 1.0f}, f32.data() + begin,
                             out.data() + begin);
          }));
          f.memcpy_gbps = std::max(f.memcpy_gbps, timed([&](std::size_t begin, std::size_t n) {
            std::memcpy(copy_dst.data() + begin, copy_src.data() + begin, n * 2);
          }));
        }
      }
      simd::set_target(load_target);
    }

    const double out_gb = static_cast<double>(elements) * 2 / 1e9;
    std::printf("fp8-bench: %s%s%s, %llu MiB bf16 model, %d rounds, %u threads, cold by %s%s\n", dir.c_str(),
                device ? " to " : "", device ? device->description().c_str() : "",
                static_cast<unsigned long long>(size_mib), rounds, threads, drop_method.c_str(),
                convert_seconds > 0 ? (", converted in " + std::to_string(convert_seconds) + " s").c_str() : "");
    std::printf("SIMD target of the loads: %s (runnable here:", load_target.c_str());
    for (const std::string& t : simd::runnable_targets()) std::printf(" %s", t.c_str());
    std::printf("; PINLOAD_SIMD forces one)\n");
    std::printf("%-28s %10s %10s %10s\n", "case", "best s", "median s", "cpu s");
    for (const auto& [name, s] : series) {
      std::printf("%-28s %10.3f %10.3f", name.c_str(), s.best(), s.median());
      if (cpu_series.contains(name)) std::printf(" %10.3f", cpu_series[name].median());
      std::printf("\n");
    }
    // Where each load's time went (Note [Load stages]), per load (mean over
    // the rounds), in ms: wall = before + span + tail + after; inflt is the
    // mean reads in flight over the span; the other columns are thread time
    // summed over the threads (docs/fp8.md#load-stages).
    std::printf("stages per load, ms (mean of the rounds; docs/fp8.md#load-stages)\n");
    std::printf("%-18s %6s %6s %6s %6s %6s %6s %6s %6s %6s %6s %6s %6s %6s %6s %6s %6s %6s %6s\n", "case", "wall",
                "before", "span", "tail", "after", "inflt", "chunks", "read", "gate", "stage", "slot", "fault", "sink",
                "queue", "conv", "idle", "finish", "plan");
    nlohmann::ordered_json stage_json;
    for (const auto& [name, st] : stages) {
      const double n = static_cast<double>(series[name].seconds.size());
      double wall = 0;
      for (double x : series[name].seconds) wall += x;
      const double in_flight = st.read_span > 0 ? st.read / st.read_span : 0;
      auto ms = [&](double x) { return x / n * 1e3; };
      std::printf("%-18s %6.1f %6.1f %6.1f %6.1f %6.1f %6.1f %6.0f %6.0f %6.1f %6.1f %6.1f %6.1f %6.1f %6.1f %6.1f %6.1f "
                  "%6.1f %6.1f\n",
                  name.c_str(), ms(wall), ms(st.before), ms(st.read_span), ms(st.tail), ms(st.after), in_flight,
                  st.chunks / n, ms(st.read), ms(st.gate), ms(st.staging), ms(st.slot), ms(st.fault_in), ms(st.sink),
                  ms(st.queued), ms(st.convert), ms(st.idle), ms(st.finish), ms(st.plan));
      stage_json[name] = {{"wall_ms", ms(wall)},      {"before_ms", ms(st.before)},
                          {"read_span_ms", ms(st.read_span)}, {"tail_ms", ms(st.tail)},
                          {"after_ms", ms(st.after)},  {"reads_in_flight", in_flight},
                          {"chunks", st.chunks / n},   {"read_ms", ms(st.read)},
                          {"gate_ms", ms(st.gate)},    {"staging_ms", ms(st.staging)},
                          {"slot_ms", ms(st.slot)},    {"fault_in_ms", ms(st.fault_in)},
                          {"sink_ms", ms(st.sink)},    {"queued_ms", ms(st.queued)},
                          {"convert_ms", ms(st.convert)}, {"idle_ms", ms(st.idle)},
                          {"finish_ms", ms(st.finish)}, {"plan_ms", ms(st.plan)},
                          {"edges_ms", ms(st.edges)}};
    }
    // A ratio of two series' medians (and the median of their same-round
    // ratios), where both ran.
    auto have = [&](const char* name) { return series.contains(name); };
    auto median_ratio = [&](const char* a, const char* b) { return series[a].median() / series[b].median(); };
    nlohmann::ordered_json ratios;
    ratios["file_fp8_over_bf16"] = size_ratio;
    std::printf("file fp8/bf16 bytes            %.3f  (target <= 0.52)\n", size_ratio);
    if (have("fp8->bf16") && have("bf16")) {
      ratios["load_fp8_over_bf16"] = median_ratio("fp8->bf16", "bf16");
      ratios["load_fp8_over_bf16_same_round"] = same_round_ratio(series["fp8->bf16"], series["bf16"]);
      std::printf("cold load fp8->bf16 / bf16     %.3f  (target <= 0.55, pool kept, medians; same round %.3f)\n",
                  ratios["load_fp8_over_bf16"].get<double>(), ratios["load_fp8_over_bf16_same_round"].get<double>());
    }
    if (have("fp8") && have("bf16")) {
      std::printf("cold load fp8 as stored / bf16 %.3f  (the read alone, same round %.3f)\n",
                  median_ratio("fp8", "bf16"), same_round_ratio(series["fp8"], series["bf16"]));
    }
    if (have("fresh fp8->bf16") && have("fresh bf16") && have("first-touch")) {
      ratios["fresh_fp8_over_bf16"] = median_ratio("fresh fp8->bf16", "fresh bf16");
      std::printf("fresh load fp8->bf16 / bf16    %.3f  (first-touch of the bf16 bytes: %.3f s)\n",
                  ratios["fresh_fp8_over_bf16"].get<double>(), series["first-touch"].median());
    }
    if (memory_rounds > 0) {
      const double convert_vs_memcpy = series["memcpy (memory)"].best() / series["convert fp8->bf16 (memory)"].best();
      ratios["convert_over_memcpy"] = convert_vs_memcpy;
      std::printf("conversion / memcpy throughput %.3f  (target >= 1.0; %.2f vs %.2f GB/s of output)\n",
                  convert_vs_memcpy, out_gb / series["convert fp8->bf16 (memory)"].best(),
                  out_gb / series["memcpy (memory)"].best());
    }
    for (const auto& [target, f] : per_target) {
      ratios["simd"][target] = {{"fp8_bf16_gbps", f.fp8_gbps}, {"fp32_bf16_gbps", f.fp32_gbps},
                                {"memcpy_gbps", f.memcpy_gbps}};
      std::printf("  %-11s fp8->bf16 %6.2f GB/s (%.2f x memcpy), fp32->bf16 %6.2f GB/s (%.2f x), memcpy %6.2f GB/s\n",
                  target.c_str(), f.fp8_gbps, f.fp8_gbps / f.memcpy_gbps, f.fp32_gbps, f.fp32_gbps / f.memcpy_gbps,
                  f.memcpy_gbps);
    }
    if (have("fp32->bf16") && have("fp32")) {
      ratios["load_fp32_bf16_over_fp32"] = median_ratio("fp32->bf16", "fp32");
      ratios["load_fp32_bf16_over_fp32_same_round"] = same_round_ratio(series["fp32->bf16"], series["fp32"]);
      std::printf("cold load fp32->bf16 / fp32    %.3f  (target <= 1.0, medians; same round %.3f)\n",
                  ratios["load_fp32_bf16_over_fp32"].get<double>(),
                  ratios["load_fp32_bf16_over_fp32_same_round"].get<double>());
    }
    if (have("fp32->bf16 budget") && have("fp32")) {
      ratios["load_fp32_bf16_budget_over_fp32"] = median_ratio("fp32->bf16 budget", "fp32");
      std::printf("budget fp32->bf16 / fp32       %.3f  (a budget of %.0f MB; medians; same round %.3f)\n",
                  ratios["load_fp32_bf16_budget_over_fp32"].get<double>(), static_cast<double>(budget.capacity_bytes) / 1e6,
                  same_round_ratio(series["fp32->bf16 budget"], series["fp32"]));
    }
    if (have("fresh fp32->bf16") && have("fresh fp32")) {
      ratios["fresh_fp32_bf16_over_fp32"] = median_ratio("fresh fp32->bf16", "fresh fp32");
      std::printf("fresh load fp32->bf16 / fp32   %.3f  (target <= 1.0, medians; same round %.3f)\n",
                  ratios["fresh_fp32_bf16_over_fp32"].get<double>(),
                  same_round_ratio(series["fresh fp32->bf16"], series["fresh fp32"]));
    }
    // What each kept case's load held at most: the memory it needs.
    for (const auto& [name, peak] : peak_bytes) {
      ratios["peak_pool_bytes"][name] = peak;
      std::printf("peak pool bytes %-14s %8.0f MB\n", name.c_str(), peak / 1e6);
    }
    if (device && have("bf16") && have("fp8->bf16") && have("pinned copy")) {
      std::printf("pinned copy of the bf16 bytes  %.2f GB/s; bf16 load %.2f GB/s, fp8->bf16 load %.2f GB/s of bf16\n",
                  bf16_bytes / 1e9 / series["pinned copy"].best(), bf16_bytes / 1e9 / series["bf16"].best(),
                  bf16_bytes / 1e9 / series["fp8->bf16"].best());
    }
    if (!json_path.empty()) {
      nlohmann::ordered_json j;
      j["size_mib"] = size_mib;
      j["rounds"] = rounds;
      j["threads"] = threads;
      j["cold_method"] = drop_method;
      j["device"] = device ? device->description() : "host";
      j["simd_target"] = load_target;
      for (const auto& [name, s] : series) j["series"][name] = s.seconds;
      for (const auto& [name, s] : cpu_series) j["cpu_seconds"][name] = s.seconds;
      if (!only_cases.empty()) j["cases"] = only_cases.substr(1, only_cases.size() - 2);
      j["ratios"] = ratios;
      j["stages"] = stage_json;
      std::ofstream(json_path) << j.dump(2) << "\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp8-bench: error: %s\n", e.what());
    return 1;
  }
}
