// `pinload convert`: an FP8 copy of a checkpoint (convert.h).
#include "cli/convert_command.h"

#include <chrono>
#include <cstdio>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "cli/size_arg.h"
#include "pinload/convert.h"
#include "pinload/error.h"

namespace pinload::cli {
namespace {

constexpr const char* kConvertUsage =
    "usage: pinload convert [--to fp8-e4m3fn|fp8-e5m2] [--scale per-tensor|per-row] [--keep PATTERN]...\n"
    "                       [--threads N] [--variant V] [-v] INPUT OUTPUT\n"
    "INPUT: a .safetensors file, a *.safetensors.index.json, a model or pipeline folder.\n"
    "OUTPUT: a file for a file INPUT, else a new folder. --keep: a glob or dotted name kept as stored.\n";

struct ConvertUsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace

int run_convert_command(int argc, char** argv) {
  try {
    ConvertOptions options;
    std::vector<std::string> paths;
    bool verbose = false;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw ConvertUsageError(a + " needs a value");
        return argv[++i];
      };
      if (a == "--to") {
        const std::string v = value();
        if (v == "fp8-e4m3fn" || v == "fp8" || v == "F8_E4M3") options.to = DType::kF8_E4M3;
        else if (v == "fp8-e5m2" || v == "F8_E5M2") options.to = DType::kF8_E5M2;
        else throw ConvertUsageError("--to takes fp8-e4m3fn or fp8-e5m2");
      } else if (a == "--scale") {
        const std::string v = value();
        if (v == "per-tensor") options.scale = ScaleMode::kPerTensor;
        else if (v == "per-row") options.scale = ScaleMode::kPerRow;
        else throw ConvertUsageError("--scale takes per-tensor or per-row");
      } else if (a == "--keep") {
        options.keep.push_back(value());
      } else if (a == "--threads") {
        const std::optional<std::uint64_t> n = parse_size_arg(value());
        if (!n || *n == 0 || *n > 1024) throw ConvertUsageError("--threads must be 1..1024");
        options.threads = static_cast<unsigned>(*n);
      } else if (a == "--variant") {
        options.resolve.variant = value();
      } else if (a == "-v" || a == "--verbose") {
        verbose = true;
      } else if (a.size() > 1 && a[0] == '-') {
        throw ConvertUsageError("unknown option '" + a + "'");
      } else {
        paths.push_back(a);
      }
    }
    if (paths.size() != 2) throw ConvertUsageError("convert takes INPUT and OUTPUT");
    const auto start = std::chrono::steady_clock::now();
    const ConvertStats stats = convert_checkpoint(paths[0], paths[1], options);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (verbose) {
      std::fprintf(stderr, "%s: %llu files, %llu tensors quantised, %llu kept; %.3f GB -> %.3f GB (%.3fx) in %.2f s\n",
                   paths[1].c_str(), static_cast<unsigned long long>(stats.files),
                   static_cast<unsigned long long>(stats.tensors_quantized),
                   static_cast<unsigned long long>(stats.tensors_kept), stats.bytes_in / 1e9, stats.bytes_out / 1e9,
                   stats.bytes_in ? static_cast<double>(stats.bytes_out) / static_cast<double>(stats.bytes_in) : 0.0,
                   seconds);
    }
    return 0;
  } catch (const ConvertUsageError& e) {
    std::fprintf(stderr, "pinload: error: %s\n%s", e.what(), kConvertUsage);
    return 2;
  } catch (const Error& e) {
    std::fprintf(stderr, "pinload: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "pinload: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pinload: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace pinload::cli
