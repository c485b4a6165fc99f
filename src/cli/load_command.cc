// pinload load [options] PATH...: loads each PATH in one parallel load and
// prints a one-line summary (stderr), optionally digests of every tensor
// (stdout), pool and device details (-v) and a progress bar (a terminal).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include "cli/command.h"
#include "cli/dtype_arg.h"
#include "cli/progress.h"
#include "pinload/checkpoint.h"
#include "pinload/device.h"
#include "pinload/session.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "load/verify.h"  // detail::file_named
#include "pinload/manifest.h"

namespace pinload::cli {
namespace {

struct LoadArgs {
  std::vector<std::string> paths;
  bool digest = false, verbose = false, quiet = false, no_progress = false;
  std::string device = "cpu";  // cpu: host memory only; sim: the CPU stand-in device
  std::uint64_t staging_bytes = 0;
  std::string dtype;  // --dtype: "" as stored
  std::string verify;  // --verify: a manifest
  std::vector<std::string> sha256;  // --sha256 FILE=HEX
  LoadOptions load;
};

// SHA-256 of a tensor's bytes, read back from the device when it has no host copy.
std::string tensor_digest(const Tensor& t, Device* device) {
  if (t.on_host()) return sha256_hex(t.bytes());
  std::vector<std::byte> bytes(t.nbytes());
  if (!bytes.empty()) device->copy_to_host(bytes.data(), *t.device_buffer(), t.device_offset(), bytes.size());
  return sha256_hex(bytes);
}

void print_details(const Loader& loader, const LoadProgress& p, Device* device) {
  const PoolStats s = loader.pool()->stats();
  std::fprintf(stderr,
               "  files: %llu direct, %llu buffered (%llu of them mapped), %llu zero-copy, %llu from the store\n"
               "  pool[%s]: reserved %.3f GB, in use %.3f GB, peak %.3f GB, %llu allocations "
               "(%llu from free lists, %llu OS reservations)\n",
               static_cast<unsigned long long>(p.files_direct), static_cast<unsigned long long>(p.files_buffered),
               static_cast<unsigned long long>(p.files_mapped), static_cast<unsigned long long>(p.files_zero_copy),
               static_cast<unsigned long long>(p.files_store),
               std::string(loader.pool()->backend_name()).c_str(),
               s.reserved_bytes / 1e9, s.in_use_bytes / 1e9, s.peak_in_use_bytes / 1e9,
               static_cast<unsigned long long>(s.allocations), static_cast<unsigned long long>(s.free_list_hits),
               static_cast<unsigned long long>(s.os_reservations));
  const NumaPlacement& numa = loader.numa_placement();
  if (numa.active()) {
    std::fprintf(stderr, "  numa: pool and readers on node %d (CPUs %s)\n", numa.node,
                 format_cpulist(numa.cpus).c_str());
  }
  if (device != nullptr) {
    std::string staging;
    if (loader.staging_pool()) {
      staging = ", staging peak " + std::to_string(loader.staging_pool()->stats().peak_reserved_bytes / 1e9) + " GB";
    }
    std::fprintf(stderr, "  device %s: %.3f GB copied%s\n", device->description().c_str(), p.bytes_copied / 1e9,
                 staging.c_str());
  }
}

void run_load(const LoadArgs& args) {
  LoadOptions options = args.load;
  const DeviceSpec spec = parse_device_spec(args.device, "--device");
  if (args.staging_bytes != 0 && spec.is_host()) throw UsageError("--staging-bytes needs --device");
  // A device load streams through pinned staging (Note [Device loads] in
  // loader.h): each run is a fresh process, which would otherwise pin a host
  // copy of the whole model first.
  if (!spec.is_host()) {
    options.target.mode = DeviceMode::kStreaming;
    if (args.staging_bytes != 0) options.target.staging_bytes = args.staging_bytes;
  }
  if (!args.dtype.empty()) options.dtype.to = parse_conversion_dtype(args.dtype);  // checked by CLI11
  if (!options.dtype.keep.empty() && !options.dtype.to) throw UsageError("--keep needs --dtype");
  // Note [Verified loads] (manifest.h).
  if (!args.verify.empty()) options.verify.manifest = std::make_shared<Manifest>(load_manifest(args.verify));
  for (const std::string& pair : args.sha256) {
    const std::size_t eq = pair.rfind('=');
    if (eq == std::string::npos || eq == 0) throw UsageError("--sha256 takes FILE=HEX, not '" + pair + "'");
    options.verify.file_sha256.emplace_back(pair.substr(0, eq), pair.substr(eq + 1));
  }
  // The process's session (Note [Sessions]): its device and the pools of the
  // options' budget and NUMA node, shared by every PATH's load.
  Device* device = Session::process().device(spec.name());
  options.target.device = device;
  Loader loader = Session::process().loader(spec.name(), options);
  // Each PATH is its own load, and a load refuses a --sha256 that names none
  // of its files: with several PATHs, each gets the digests of its own files.
  std::vector<std::optional<Loader>> own(args.paths.size());
  if (!options.verify.file_sha256.empty() && args.paths.size() > 1) {
    std::vector<bool> used(options.verify.file_sha256.size(), false);
    for (std::size_t i = 0; i < args.paths.size(); ++i) {
      LoadOptions mine = options;
      mine.verify.file_sha256.clear();
      for (const CheckpointFile& f : open_checkpoint(default_env(), {args.paths[i]}, options.resolve).files) {
        for (std::size_t k = 0; k < used.size(); ++k) {
          if (!detail::file_named(f.path, options.verify.file_sha256[k].first)) continue;
          mine.verify.file_sha256.push_back(options.verify.file_sha256[k]);
          used[k] = true;
        }
      }
      own[i].emplace(mine, loader.pool(), nullptr, loader.staging_pool());
    }
    for (std::size_t k = 0; k < used.size(); ++k) {
      if (!used[k]) throw UsageError("--sha256: no file of any PATH is named '" + options.verify.file_sha256[k].first + "'");
    }
  }
  for (std::size_t i = 0; i < args.paths.size(); ++i) {
    const std::string& path = args.paths[i];
    const auto start = std::chrono::steady_clock::now();
    LoadHandle handle = (own[i] ? *own[i] : loader).load_async({path});
    ProgressBar bar(args.no_progress ? ProgressBar::kNever : ProgressBar::kOnTerminal);
    while (!handle.done()) {
      const LoadProgress p = handle.progress();
      bar.update(p.bytes_done, p.bytes_total);
      // Short polls first, so that a small load is timed closely.
      const auto elapsed = std::chrono::steady_clock::now() - start;
      std::this_thread::sleep_for(std::clamp<std::chrono::steady_clock::duration>(
          elapsed / 20, std::chrono::milliseconds(1), std::chrono::milliseconds(50)));
    }
    StateDict sd = handle.wait();
    const LoadProgress p = handle.progress();
    bar.finish(p.bytes_done, p.bytes_total);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (args.digest) {
      for (const Tensor& t : sd) {
        std::cout << printable(t.name()) << '\t' << dtype_name(t.dtype()) << '\t' << shape_text(t.shape()) << '\t'
                  << tensor_digest(t, device) << '\n';
      }
      std::cout.flush();
    }
    if (!args.quiet) {
      std::fprintf(stderr, "%s: %zu tensors, %.3f GB in %.3f s = %.2f GB/s\n", printable(path).c_str(), sd.size(),
                   p.bytes_total / 1e9, seconds, seconds > 0 ? p.bytes_total / 1e9 / seconds : 0.0);
    }
    if (args.verbose) print_details(loader, p, device);
  }
}

}  // namespace

void add_load_command(CLI::App& app) {
  auto args = std::make_shared<LoadArgs>();
  CLI::App* command = app.add_subcommand(
      "load", "Load checkpoints into host or device memory and time it");
  command->add_flag("--digest", args->digest, "print name, dtype, shape and SHA-256 of every tensor on stdout");
  command->add_flag("-v,--verbose", args->verbose, "also print how files were read and the pool's statistics");
  command->add_flag("-q,--quiet", args->quiet, "no summary line");
  command->add_flag("--no-progress", args->no_progress, "no progress bar (shown on a terminal after a second)");
  add_reader_options(*command, &args->load);
  command->add_option("--device", args->device, "cpu (host memory only), sim (the CPU stand-in device) or cuda:N")
      ->type_name("DEVICE")
      ->capture_default_str();
  command->add_option("--streams", args->load.target.copy.streams, "host-to-device copy streams")
      ->transform(integer_range(1, kMaxCopyStreams))
      ->type_name("1..64")
      ->capture_default_str();
  command->add_option("--chunk-size", args->load.target.copy.chunk_bytes, "bytes per host-to-device copy")
      ->transform(size_range(1, std::uint64_t{1} << 40))
      ->type_name("SIZE")
      ->default_str(size_text(args->load.target.copy.chunk_bytes));
  command->add_option("--staging-bytes", args->staging_bytes,
                      "pinned memory a device load streams through (default 256M)")
      ->transform(size_range(1, std::uint64_t{1} << 50))
      ->type_name("SIZE");
  command->add_option("--dtype", args->dtype,
                      "floating tensors out in this dtype, FP8 dequantised (docs/fp8.md)")
      ->check(dtype_validator())
      ->type_name("bf16|fp16|fp32");
  command->add_option("--keep", args->load.dtype.keep, "a tensor pattern (glob or dotted name) --dtype leaves as stored")
      ->type_name("PATTERN")
      ->take_all()
      ->expected(1)
      ->allow_extra_args(false);  // the PATHs after it are not patterns
  // Note [Memory limits] (memory_limit.h): a load that cannot fit fails before reading.
  command->add_option("--pool-bytes", args->load.pool_bytes, "cap the host (or pinned) pool at this many bytes")
      ->transform(size_range(1, std::uint64_t{1} << 50))
      ->type_name("SIZE");
  command->add_option("--verify", args->verify,
                      "check every byte read against this manifest (pinload manifest)")
      ->type_name("MANIFEST");
  command->add_option("--sha256", args->sha256,
                      "check the file named FILE against this published SHA-256")
      ->type_name("FILE=HEX")
      ->take_all()
      ->expected(1)
      ->allow_extra_args(false);  // the PATHs after it are not its values
  // Note [Store clients] (store.h): files mapped from the node store.
  command->add_option("--store", args->load.store.socket,
                      "map files from the node store on SOCKET (or 'default')")
      ->type_name("SOCKET");
  command->add_flag("--store-required", args->load.store.required,
                    "exit 1 where the store cannot be reached, not load without it");
  add_paths(*command, &args->paths);
  command->callback([args] {
    StoreOptions& store = args->load.store;
    if (store.socket == "default") store.socket = default_store_socket();
    if (store.required && store.socket.empty()) {
      store = StoreOptions::from_environment(store);
      if (store.socket.empty()) store.socket = default_store_socket();
    }
    run_load(*args);
  });
}

}  // namespace pinload::cli
