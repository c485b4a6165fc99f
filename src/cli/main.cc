// The pinload command-line program: inspect and load safetensors checkpoints.
#include <openssl/evp.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli/load_option_args.h"
#include "cli/progress.h"
#include "cli/size_arg.h"
#include "pinload/checkpoint.h"
#include "pinload/device.h"
#include "pinload/error.h"
#include "pinload/loader.h"

namespace pinload::cli {
namespace {

constexpr const char* kUsage =
    "usage: pinload inspect [--json] [--variant V] PATH...\n"
    "       pinload load [--digest] [-v] [--threads N] [--block-size BYTES[K|M]]\n"
    "                    [--direct auto|on|off] [--cached-read auto|map|pread] [--variant V]\n"
    "                    [--device cpu|sim|cuda:N] [--streams K] [--chunk-size BYTES]\n"
    "                    [--staging-bytes BYTES]"
    " [--numa-node auto|none|N] PATH...\n"
    "PATH: a .safetensors file, a *.safetensors.index.json, or a folder.\n";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Args {
  std::string command;
  std::vector<std::string> paths;
  bool json = false, digest = false, verbose = false;
  std::string device = "cpu";  // cpu: host memory only; sim: the CPU stand-in device
  LoadOptions load;
};

std::uint64_t parse_size(const std::string& text) {
  const std::optional<std::uint64_t> size = parse_size_arg(text);
  if (!size) throw UsageError("not a size: '" + text + "' (bytes, or a number with K, M or G)");
  return *size;
}

// auto: the device's node; none: leave placement to the OS; N: node N.
int parse_numa_node(const std::string& text) {
  if (text == "auto") return kNumaAuto;
  if (text == "none") return kNumaNone;
  int node = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), node);
  if (ec != std::errc() || end != text.data() + text.size() || node < 0 || node > 4095) {
    throw UsageError("--numa-node takes auto, none or a node number");
  }
  return node;
}

Args parse_args(int argc, char** argv) {
  if (argc < 2) throw UsageError("missing command");
  Args args;
  args.command = argv[1];
  if (args.command != "inspect" && args.command != "load") throw UsageError("unknown command '" + args.command + "'");
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(a + " needs a value");
      return argv[++i];
    };
    if (a == "--json") args.json = true;
    else if (a == "--digest") args.digest = true;
    else if (a == "-v" || a == "--verbose") args.verbose = true;
    else if (a == "--threads") args.load.threads = static_cast<unsigned>(parse_size(value()));
    else if (a == "--block-size") args.load.block_size = parse_size(value());
    else if (a == "--variant") args.load.resolve.variant = value();
    else if (a == "--device") args.device = value();
    else if (a == "--streams") args.load.target.copy.streams = parse_size(value());
    else if (a == "--chunk-size") args.load.target.copy.chunk_bytes = parse_size(value());
    else if (a == "--staging-bytes") {
      args.load.target.staging_bytes = parse_size(value());
      args.load.target.mode = DeviceMode::kStreaming;
    }
    else if (a == "--numa-node") args.load.numa.node = parse_numa_node(value());
    else if (a == "--direct") {
      const auto d = parse_direct_arg(value());
      if (!d) throw UsageError("--direct takes auto, on or off");
      args.load.direct = *d;
    } else if (a == "--cached-read") {
      const auto c = parse_cached_read_arg(value());
      if (!c) throw UsageError("--cached-read takes auto, map or pread");
      args.load.cached_read = *c;
    } else if (a == "--") {
      for (++i; i < argc; ++i) args.paths.emplace_back(argv[i]);
    } else if (a.size() > 1 && a[0] == '-') {
      throw UsageError("unknown option '" + a + "'");
    } else {
      args.paths.push_back(a);
    }
  }
  if (args.paths.empty()) throw UsageError("no PATH given");
  try {
    args.load.validate();
  } catch (const InvalidArgumentError& e) {
    throw UsageError(e.message());
  }
  return args;
}

std::string shape_text(const std::vector<std::uint64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string sha256_hex(std::span<const std::byte> bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("SHA-256 failed in libcrypto");
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(2 * length, '0');
  for (unsigned i = 0; i < length; ++i) {
    out[2 * i] = kHex[digest[i] >> 4];
    out[2 * i + 1] = kHex[digest[i] & 15];
  }
  return out;
}

int run_inspect(const Args& args) {
  const Checkpoint checkpoint = open_checkpoint(default_env(), args.paths, args.load.resolve);
  if (args.json) {
    nlohmann::ordered_json out;
    out["files"] = nlohmann::ordered_json::array();
    for (const CheckpointFile& f : checkpoint.files) {
      nlohmann::ordered_json file;
      file["path"] = f.path;
      file["file_bytes"] = f.stat.size;
      file["header_bytes"] = f.header.json_size;
      file["metadata"] = nlohmann::ordered_json::object();
      for (const auto& [k, v] : f.header.metadata) file["metadata"][k] = v;
      file["tensors"] = nlohmann::ordered_json::array();
      for (const TensorInfo& t : f.header.tensors) {
        file["tensors"].push_back({{"name", f.name_prefix + t.name},
                                   {"dtype", dtype_name(t.dtype)},
                                   {"shape", t.shape},
                                   {"bytes", t.nbytes()},
                                   {"data_offsets", {t.begin, t.end}},
                                   {"file_offsets", {f.header.data_offset() + t.begin, f.header.data_offset() + t.end}}});
      }
      out["files"].push_back(std::move(file));
    }
    out["index_files"] = checkpoint.index_files;
    out["total_tensors"] = checkpoint.tensor_count();
    out["total_bytes"] = checkpoint.data_bytes();
    std::cout << out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    return 0;
  }
  for (const CheckpointFile& f : checkpoint.files) {
    std::cout << f.path << ": " << f.header.tensors.size() << " tensors, " << f.header.data_size()
              << " data bytes, header " << f.header.json_size << " bytes\n";
    for (const TensorInfo& t : f.header.tensors) {
      const std::uint64_t base = f.header.data_offset();
      std::cout << "  " << f.name_prefix << t.name << "\t" << dtype_name(t.dtype) << "\t" << shape_text(t.shape)
                << "\t" << t.nbytes() << " B\t[" << base + t.begin << ", " << base + t.end << ")\n";
    }
    for (const auto& [k, v] : f.header.metadata) std::cout << "  metadata " << k << " = " << v << "\n";
  }
  std::cout << "total: " << checkpoint.tensor_count() << " tensors, " << checkpoint.data_bytes() << " bytes in "
            << checkpoint.files.size() << " file(s)\n";
  return 0;
}

// SHA-256 of a tensor's bytes, read back from the device when it has no host copy.
std::string tensor_digest(const Tensor& t, Device* device) {
  if (t.on_host()) return sha256_hex(t.bytes());
  std::vector<std::byte> bytes(t.nbytes());
  if (!bytes.empty()) device->copy_to_host(bytes.data(), *t.device_buffer(), t.device_offset(), bytes.size());
  return sha256_hex(bytes);
}

int run_load(const Args& args) {
  std::unique_ptr<Device> device;
  LoadOptions options = args.load;
  if (const DeviceSpec spec = parse_device_spec(args.device, "--device"); !spec.is_host()) {
    device = open_device(spec);
    options.target.device = device.get();
  } else if (options.target.mode == DeviceMode::kStreaming) {
    throw UsageError("--staging-bytes needs --device");
  }
  Loader loader(options);
  for (const std::string& path : args.paths) {
    const auto start = std::chrono::steady_clock::now();
    LoadHandle handle = loader.load_async({path});
    ProgressBar bar;
    while (!handle.done()) {
      const LoadProgress p = handle.progress();
      bar.update(p.bytes_done, p.bytes_total);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    bar.finish();
    const LoadProgress p = handle.progress();
    StateDict sd = handle.wait();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (args.digest) {
      for (const Tensor& t : sd) {
        std::cout << t.name() << '\t' << dtype_name(t.dtype()) << '\t' << shape_text(t.shape()) << '\t'
                  << tensor_digest(t, device.get()) << '\n';
      }
    }
    if (args.verbose) {
      const PoolStats s = loader.pool()->stats();
      std::fprintf(stderr,
                   "%s: %zu tensors, %.3f GB in %.3f s = %.2f GB/s (%llu direct, %llu buffered files, %llu of them mapped)\n"
                   "pool[%s]: reserved %.1f MiB, in use %.1f MiB, peak %.1f MiB, %llu allocations "
                   "(%llu from free lists, %llu OS reservations)\n",
                   path.c_str(), sd.size(), p.bytes_total / 1e9, seconds, p.bytes_total / 1e9 / seconds,
                   static_cast<unsigned long long>(p.files_direct), static_cast<unsigned long long>(p.files_buffered),
                   static_cast<unsigned long long>(p.files_mapped),
                   std::string(loader.pool()->backend_name()).c_str(), s.reserved_bytes / 1048576.0,
                   s.in_use_bytes / 1048576.0, s.peak_in_use_bytes / 1048576.0,
                   static_cast<unsigned long long>(s.allocations), static_cast<unsigned long long>(s.free_list_hits),
                   static_cast<unsigned long long>(s.os_reservations));
      const NumaPlacement& numa = loader.numa_placement();
      if (numa.active()) {
        std::fprintf(stderr, "numa: pool and readers on node %d (CPUs %s)\n", numa.node,
                     format_cpulist(numa.cpus).c_str());
      }
      if (device) {
        std::fprintf(stderr, "device %s: %.3f GB copied%s\n", device->description().c_str(), p.bytes_copied / 1e9,
                     loader.staging_pool()
                         ? (", staging peak " + std::to_string(loader.staging_pool()->stats().peak_reserved_bytes >> 20) +
                            " MiB").c_str()
                         : "");
      }
    }
  }
  std::cout.flush();
  return 0;
}

// One printable line: control bytes and invalid UTF-8 become \xNN.
std::string printable(const std::string& text) {
  std::string out;
  static constexpr char kHex[] = "0123456789abcdef";
  auto escape = [&](unsigned char c) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c == 0x7f) {
      escape(c);
      ++i;
      continue;
    }
    std::size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    bool valid = len != 0 && i + len <= text.size();
    for (std::size_t k = 1; valid && k < len; ++k) valid = (static_cast<unsigned char>(text[i + k]) >> 6) == 2;
    if (!valid) {
      escape(c);
      ++i;
      continue;
    }
    out.append(text, i, len);
    i += len;
  }
  return out;
}

}  // namespace
}  // namespace pinload::cli

int main(int argc, char** argv) {
  using namespace pinload::cli;
  std::ios::sync_with_stdio(false);
  try {
    const Args args = parse_args(argc, argv);
    return args.command == "inspect" ? run_inspect(args) : run_load(args);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "pinload: error: %s\n%s", e.what(), kUsage);
    return 2;
  } catch (const pinload::Error& e) {
    std::fprintf(stderr, "pinload: error: %s\n", printable(e.what()).c_str());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "pinload: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pinload: error: %s\n", printable(e.what()).c_str());
    return 1;
  }
}
