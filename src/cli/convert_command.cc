// pinload convert [options] INPUT OUTPUT: an FP8 copy of a checkpoint in
// ComfyUI's layout (convert.h, docs/fp8.md), written atomically.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "pinload/convert.h"
#include "pinload/error.h"
#include "pinload/read_options.h"

namespace pinload::cli {
namespace {

struct ConvertArgs {
  std::string input, output;
  std::string to = "fp8-e4m3fn";
  std::string scale = "per-tensor";
  bool verbose = false;
  ConvertOptions options;
};

// Bytes in the unit that shows them: B, kB, MB or GB (10^3 steps, as the summaries' GB).
std::string bytes_text(std::uint64_t bytes) {
  char out[32];
  if (bytes >= 1'000'000'000) {
    std::snprintf(out, sizeof out, "%.3f GB", bytes / 1e9);
  } else if (bytes >= 1'000'000) {
    std::snprintf(out, sizeof out, "%.1f MB", bytes / 1e6);
  } else if (bytes >= 1'000) {
    std::snprintf(out, sizeof out, "%.1f kB", bytes / 1e3);
  } else {
    std::snprintf(out, sizeof out, "%llu B", static_cast<unsigned long long>(bytes));
  }
  return out;
}

// SIGINT and SIGTERM stop the conversion between pieces, so that its
// temporary output is removed; the signal is then raised again, and the
// process ends by it as it would have without the handler.
std::atomic<bool> g_stop{false};
volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_stop_signal(int sig) {
  g_signal = sig;
  g_stop.store(true, std::memory_order_relaxed);
}

void run_convert(ConvertArgs& args) {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  args.options.stop = &g_stop;
  args.options.to = args.to == "fp8-e5m2" ? DType::kF8_E5M2 : DType::kF8_E4M3;  // checked by CLI11
  args.options.scale = args.scale == "per-row" ? ScaleMode::kPerRow : ScaleMode::kPerTensor;
  const auto start = std::chrono::steady_clock::now();
  ConvertStats stats;
  try {
    stats = convert_checkpoint(args.input, args.output, args.options);
  } catch (const CancelledError&) {
    if (g_signal == 0) throw;
    const int sig = g_signal;
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    throw;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (args.verbose) {
    // The output's size as a fraction of the input's; a file of few small tensors can come out
    // larger (its header grows by the scales and quantisation entries), and says so.
    const double ratio =
        stats.bytes_in ? static_cast<double>(stats.bytes_out) / static_cast<double>(stats.bytes_in) : 0.0;
    std::fprintf(stderr, "%s: %llu files, %llu tensors quantised, %llu kept; %s -> %s (%.3f x the input%s) in %.2f s\n",
                 args.output.c_str(), static_cast<unsigned long long>(stats.files),
                 static_cast<unsigned long long>(stats.tensors_quantized),
                 static_cast<unsigned long long>(stats.tensors_kept), bytes_text(stats.bytes_in).c_str(),
                 bytes_text(stats.bytes_out).c_str(), ratio,
                 stats.bytes_out > stats.bytes_in ? ": larger, the added scales and header outweigh what FP8 saves" : "",
                 seconds);
  }
}

}  // namespace

void add_convert_command(CLI::App& app) {
  auto args = std::make_shared<ConvertArgs>();
  CLI::App* command = app.add_subcommand(
      "convert", "Write an FP8 copy of a checkpoint, ComfyUI layout (docs/fp8.md)");
  command->add_option("--to", args->to, "the FP8 format")
      ->check(CLI::IsMember({"fp8-e4m3fn", "fp8-e5m2"}).description(""))
      ->type_name("fp8-e4m3fn|fp8-e5m2")
      ->capture_default_str();
  command->add_option("--scale", args->scale, "one float32 scale per tensor, or per output row")
      ->check(CLI::IsMember({"per-tensor", "per-row"}).description(""))
      ->type_name("per-tensor|per-row")
      ->capture_default_str();
  command->add_option("--keep", args->options.keep, "a tensor pattern (glob or dotted name) kept as stored")
      ->type_name("PATTERN")
      ->take_all()
      ->expected(1);
  command->add_option("--threads", args->options.threads, "converting threads")
      ->transform(integer_range(1, kMaxThreads))
      ->type_name("1..1024")
      ->capture_default_str();
  add_variant_option(*command, &args->options.resolve);
  command->add_flag("-v,--verbose", args->verbose, "print what was converted");
  command->add_option("INPUT", args->input, "a .safetensors file, a *.safetensors.index.json, or a folder")
      ->required()
      ->type_name("");
  command->add_option("OUTPUT", args->output, "a file for a file INPUT, else a new folder")->required()->type_name("");
  command->callback([args] { run_convert(*args); });
}

}  // namespace pinload::cli
