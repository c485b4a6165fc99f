// Micro-benchmarks of pinload's building blocks (Google Benchmark).
//
//   BM_ParseHeader        parse_header on a synthetic header of 1,000 to
//                         750,000 tensors (94 MB, near the 100 MB limit,
//                         kMaxHeaderSize) with FLUX-like names and shapes
//                         (header JSON only). The reference safetensors' figure
//                         for the same headers: bench/header_parse_peer.py
//                         (Note [Header parsing] in src/format/safetensors.cc).
//   BM_ParseSafetensors   parse_safetensors over a whole in-memory file of
//                         1000 tiny tensors (prefix + header + data checks).
//   BM_PoolFresh          a new pool per iteration: every allocate() is an OS
//                         reservation (mmap + mlock, which faults the pages in).
//   BM_PoolReuse          one pool: allocate/free cycles hit the free list.
//   BM_Load/<where>       Loader::load of a 64 MiB file in /dev/shm (tmpfs,
//                         buffered), on disk with the file in the page cache
//                         (warm), and on disk after POSIX_FADV_DONTNEED (cold).
//
// Files live in /dev/shm and in $PINLOAD_BENCH_DIR (default /var/tmp) and are
// removed at exit. Run: build-bench/bench/pinload_micro_bench
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "pinload/env.h"
#include "pinload/loader.h"
#include "pinload/pool.h"
#include "pinload/safetensors.h"

namespace {

// A header JSON and the file size it implies: `n` BF16 tensors with
// transformer-like names, sorted by name and contiguous, padded to 8 bytes.
struct SyntheticHeader {
  std::string json;
  std::uint64_t data_bytes = 0;
  std::uint64_t file_size() const { return 8 + json.size() + data_bytes; }
};

SyntheticHeader make_header(int n, bool tiny) {
  std::vector<std::pair<std::string, std::vector<std::uint64_t>>> tensors;
  const char* kinds[] = {"attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight", "attn.to_out.0.bias",
                         "ff.net.0.proj.weight", "ff.net.2.weight", "norm1.linear.weight", "attn.norm_q.weight"};
  for (int i = 0; i < n; ++i) {
    std::string name = "transformer_blocks." + std::to_string(i / 8) + "." + kinds[i % 8];
    std::vector<std::uint64_t> shape;
    if (tiny) shape = {4, 4};
    else if (i % 8 == 3 || i % 8 == 7) shape = {3072};
    else shape = {3072, 3072};
    tensors.emplace_back(std::move(name), std::move(shape));
  }
  std::sort(tensors.begin(), tensors.end());
  SyntheticHeader h;
  h.json = "{\"__metadata__\":{\"format\":\"pt\"}";
  std::uint64_t off = 0;
  for (const auto& [name, shape] : tensors) {
    std::uint64_t bytes = 2;
    std::string s;
    for (std::uint64_t d : shape) {
      bytes *= d;
      if (!s.empty()) s += ',';
      s += std::to_string(d);
    }
    h.json += ",\"" + name + "\":{\"dtype\":\"BF16\",\"shape\":[" + s + "],\"data_offsets\":[" +
              std::to_string(off) + "," + std::to_string(off + bytes) + "]}";
    off += bytes;
  }
  h.json += "}";
  while (h.json.size() % 8 != 0) h.json += ' ';
  h.data_bytes = off;
  return h;
}

void BM_ParseHeader(benchmark::State& state) {
  const SyntheticHeader h = make_header(static_cast<int>(state.range(0)), false);
  if (h.json.size() > pinload::kMaxHeaderSize) {
    state.SkipWithError("header above kMaxHeaderSize");
    return;
  }
  const auto* p = reinterpret_cast<const std::byte*>(h.json.data());
  for (auto _ : state) {
    pinload::Header header = pinload::parse_header({p, h.json.size()}, h.file_size(), "synthetic");
    benchmark::DoNotOptimize(header.tensors.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * h.json.size()));
  state.counters["tensors"] = static_cast<double>(state.range(0));
  state.counters["header_bytes"] = static_cast<double>(h.json.size());
}
BENCHMARK(BM_ParseHeader)->Arg(1000)->Arg(10000)->Arg(200000)->Arg(750000)->Unit(benchmark::kMillisecond);

void BM_ParseSafetensors(benchmark::State& state) {
  const SyntheticHeader h = make_header(1000, true);
  std::vector<std::byte> file(h.file_size());
  const std::uint64_t n = h.json.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  std::memcpy(file.data() + 8, h.json.data(), n);
  for (auto _ : state) {
    pinload::Header header = pinload::parse_safetensors(file, "synthetic");
    benchmark::DoNotOptimize(header.tensors.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * file.size()));
}
BENCHMARK(BM_ParseSafetensors)->Unit(benchmark::kMicrosecond);

// ---- pool ----

void touch(pinload::Block& b) {
  // One write per page, as a loader filling the block would cause.
  for (std::size_t i = 0; i < b.size(); i += 4096) b.data()[i] = std::byte{1};
}

void BM_PoolFresh(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    auto pool = pinload::Pool::create_default();
    auto block = pool->allocate(bytes);
    touch(*block);
    benchmark::DoNotOptimize(block->data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_PoolFresh)->Arg(64 << 10)->Arg(2 << 20)->Arg(64 << 20)->Arg(256 << 20)->Unit(benchmark::kMicrosecond);

void BM_PoolReuse(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto pool = pinload::Pool::create_default();
  { auto warm = pool->allocate(bytes); touch(*warm); }
  const auto before = pool->stats();
  for (auto _ : state) {
    auto block = pool->allocate(bytes);
    touch(*block);
    benchmark::DoNotOptimize(block->data());
  }
  const auto after = pool->stats();
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
  state.counters["new_os_reservations"] = static_cast<double>(after.os_reservations - before.os_reservations);
}
BENCHMARK(BM_PoolReuse)->Arg(64 << 10)->Arg(2 << 20)->Arg(64 << 20)->Arg(256 << 20)->Unit(benchmark::kMicrosecond);

// Allocation alone (no page touching): the bookkeeping cost of a free-list hit.
void BM_PoolReuseNoTouch(benchmark::State& state) {
  auto pool = pinload::Pool::create_default();
  { auto warm = pool->allocate(2 << 20); }
  for (auto _ : state) {
    auto block = pool->allocate(2 << 20);
    benchmark::DoNotOptimize(block->data());
  }
}
BENCHMARK(BM_PoolReuseNoTouch);

// ---- loader ----

constexpr std::uint64_t kLoadFileBytes = 64u << 20;

std::string write_file(const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/pinload_micro_" + std::to_string(::getpid()) + ".safetensors";
  // 64 BF16 tensors of 1 MiB each.
  std::string json = "{";
  const std::uint64_t per = kLoadFileBytes / 64;
  for (int i = 0; i < 64; ++i) {
    char name[32];
    std::snprintf(name, sizeof name, "w.%02d", i);
    json += std::string(i ? "," : "") + "\"" + name + "\":{\"dtype\":\"BF16\",\"shape\":[" + std::to_string(per / 2) +
            "],\"data_offsets\":[" + std::to_string(i * per) + "," + std::to_string((i + 1) * per) + "]}";
  }
  json += "}";
  while (json.size() % 8 != 0) json += ' ';
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return {};
  const std::uint64_t n = json.size();
  std::fwrite(&n, 8, 1, f);  // little-endian host
  std::fwrite(json.data(), 1, json.size(), f);
  std::vector<std::uint64_t> buf(1 << 17);
  std::mt19937_64 rng(42);
  for (std::uint64_t done = 0; done < kLoadFileBytes; done += buf.size() * 8) {
    for (auto& x : buf) x = rng();
    std::fwrite(buf.data(), 8, buf.size(), f);
  }
  std::fclose(f);
  return path;
}

struct LoadFiles {
  std::string shm, disk;
  LoadFiles() {
    shm = write_file("/dev/shm");
    const char* d = std::getenv("PINLOAD_BENCH_DIR");
    disk = write_file(d != nullptr ? d : "/var/tmp");
    ::sync();
  }
  ~LoadFiles() {
    if (!shm.empty()) std::remove(shm.c_str());
    if (!disk.empty()) std::remove(disk.c_str());
  }
};

LoadFiles& files() {
  static LoadFiles f;
  return f;
}

void drop_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

enum Where { kShm = 0, kDiskWarm = 1, kDiskCold = 2 };

void BM_Load(benchmark::State& state) {
  const auto where = static_cast<Where>(state.range(0));
  const std::string& path = where == kShm ? files().shm : files().disk;
  if (path.empty()) {
    state.SkipWithError("could not write the test file");
    return;
  }
  pinload::LoadOptions options;
  options.threads = static_cast<unsigned>(state.range(1));
  pinload::Loader loader(options);
  {  // fill the pool (and the page cache for the warm case)
    pinload::StateDict sd = loader.load({path});
  }
  if (where == kDiskWarm) {
    pinload::LoadOptions buffered = options;
    buffered.direct = pinload::DirectIo::kOff;
    pinload::Loader(buffered, loader.pool()).load({path});
  }
  const auto before = loader.pool()->stats();
  for (auto _ : state) {
    if (where == kDiskCold) {
      state.PauseTiming();
      drop_file(path);
      state.ResumeTiming();
    }
    pinload::StateDict sd = loader.load({path});
    benchmark::DoNotOptimize(sd.total_bytes());
  }
  const auto after = loader.pool()->stats();
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kLoadFileBytes));
  state.counters["new_os_reservations"] = static_cast<double>(after.os_reservations - before.os_reservations);
  state.SetLabel(where == kShm ? "shm" : where == kDiskWarm ? "disk-warm" : "disk-cold");
}
BENCHMARK(BM_Load)
    ->ArgNames({"where", "threads"})
    ->ArgsProduct({{kShm, kDiskWarm, kDiskCold}, {1, 2, 8}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
