#include <charconv>
#include <optional>
#include <string>

#include "base/printable.h"
#include "base/sha256.h"
#include "cli/command.h"
#include "cli/load_option_args.h"
#include "cli/size_arg.h"

namespace pinload::cli {

std::string size_text(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"", "K", "M", "G", "T", "P"};
  int unit = 0;
  while (bytes != 0 && bytes % 1024 == 0 && unit < 5) {
    bytes /= 1024;
    ++unit;
  }
  return std::to_string(bytes) + kUnits[unit];
}

CLI::Validator size_range(std::uint64_t min, std::uint64_t max) {
  const std::string range = size_text(min) + ".." + size_text(max);
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        const std::optional<std::uint64_t> size = parse_size_arg(text);
        if (!size) return "not a size: '" + text + "' (bytes, or a number with K, M or G)";
        if (*size < min || *size > max) {
          return "'" + text + "' is " + std::to_string(*size) + " bytes; it must be " + range;
        }
        text = std::to_string(*size);
        return {};
      },
      "");
}

CLI::Validator integer_range(long long min, long long max) {
  const std::string range = std::to_string(min) + ".." + std::to_string(max);
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        long long value = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (ec != std::errc() || end != text.data() + text.size() || value < min || value > max) {
          return "takes an integer " + range + ", not '" + text + "'";
        }
        return {};
      },
      "");
}

void add_paths(CLI::App& command, std::vector<std::string>* paths) {
  command.add_option("PATH", *paths, "a file, an index or a folder; local, s3:// or http(s)://")
      ->required()
      ->type_name("");
}

namespace {

// --direct, --cached-read: one of a fixed table of spellings.
template <class E, std::size_t N>
CLI::Option* add_spelling_option(CLI::App& command, const std::string& name, E* value,
                                 const Spelling<E> (&spellings)[N], const std::string& help) {
  std::string choices;
  for (const auto& s : spellings) choices += (choices.empty() ? "" : "|") + std::string(s.text);
  return command
      .add_option_function<std::string>(
          name,
          [value, &spellings](const std::string& text) {
            *value = *parse_spelling(spellings, text);  // checked below
          },
          help)
      ->check(CLI::Validator(
          [&spellings, choices](std::string& text) -> std::string {
            if (parse_spelling(spellings, text)) return {};
            return "takes " + choices + ", not '" + text + "'";
          },
          ""))
      ->type_name(choices)
      ->default_str(spelling_of(spellings, *value));
}

constexpr int kMaxNumaNode = 4095;

}  // namespace

void add_variant_option(CLI::App& command, ResolveOptions* options) {
  command.add_option("--variant", options->variant,
                     "the *.V.safetensors files (e.g. fp16) of folders and pipelines")
      ->type_name("V");
}

void add_reader_options(CLI::App& command, LoadOptions* options) {
  command.add_option("--threads", options->threads, "reader threads")
      ->transform(integer_range(1, kMaxThreads))
      ->type_name("1..1024")
      ->capture_default_str();
  command.add_option("--block-size", options->block_size, "bytes per read")
      ->transform(size_range(kMinBlockSize, kMaxBlockSize))
      ->type_name("SIZE 4K..1G")
      ->default_str(size_text(options->block_size));
  add_spelling_option(command, "--direct", &options->direct, kDirectSpellings,
                      "O_DIRECT reads (auto: unless the file is already cached)");
  add_spelling_option(command, "--cached-read", &options->cached_read, kCachedReadSpellings,
                      "how a cached file is read (auto: whichever the file favours)");
  add_spelling_option(command, "--zero-copy", &options->zero_copy, kZeroCopySpellings,
                      "files as leased mappings (auto: cached ones when the pool is full)");
  add_spelling_option(command, "--page-cache", &options->page_cache, kPageCacheSpellings,
                      "cold files left in the page cache, or O_DIRECT (docs/tuning.md)");
  command
      .add_option_function<std::string>(
          "--numa-node",
          [options](const std::string& text) {
            if (text == "auto") {
              options->numa.node = kNumaAuto;
            } else if (text == "none") {
              options->numa.node = kNumaNone;
            } else {
              options->numa.node = std::stoi(text);  // checked below
            }
          },
          "the node of pool and readers: auto (the device's), none or N")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            if (text == "auto" || text == "none") return {};
            int node = -1;
            const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), node);
            if (ec == std::errc() && end == text.data() + text.size() && node >= 0 && node <= kMaxNumaNode) return {};
            return "takes auto, none or a node number 0.." + std::to_string(kMaxNumaNode) + ", not '" + text + "'";
          },
          ""))
      ->type_name("auto|none|N")
      ->default_str("auto");
  command.add_option("--connections", options->resolve.remote.connections,
                     "parallel connections for s3:// and http(s):// paths (docs/remote.md)")
      ->transform(integer_range(1, 1024))
      ->type_name("1..1024")
      ->default_str("PINLOAD_CONNECTIONS or 16");
  add_variant_option(command, &options->resolve);
}

std::string shape_text(const std::vector<std::uint64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string sha256_hex(std::span<const std::byte> bytes) { return detail::sha256_hex(bytes.data(), bytes.size()); }

std::string printable(const std::string& text) { return printable_text(text); }

}  // namespace pinload::cli
