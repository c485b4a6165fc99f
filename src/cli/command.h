// Internal to the pinload command-line program: what its subcommands share.
//
// Each subcommand lives in its own file and adds itself to the program with
// `void add_<name>_command(CLI::App& app)` (declared below, called from
// main.cc): it declares its options and positionals on a CLI11 subcommand and
// sets a callback that runs it. The callback runs inside App::parse on the
// main thread; it reports bad input by throwing pinload::Error (exit code 1,
// "pinload: error: <file>: <what>") and command-line mistakes CLI11 cannot
// see by throwing UsageError (exit code 2). What it prints goes to stdout;
// summaries, progress and diagnostics go to stderr.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "pinload/loader.h"

namespace pinload::cli {

// A command-line mistake found after parsing: exit code 2, with the usage.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void add_inspect_command(CLI::App& app);
void add_load_command(CLI::App& app);
void add_convert_command(CLI::App& app);  // convert_command.cc
void add_manifest_command(CLI::App& app);  // manifest_command.cc
// The page-cache commands (docs/trace.md). Their callbacks end by throwing
// CLI::RuntimeError(status) when the status is not 0.
void add_trace_command(CLI::App& app);
// `pinload trace ... -- CMD ARGS`: main() hands CLI11 only what comes before
// the first "--" and keeps the rest, untouched, as the command to run.
std::vector<std::string>& command_after_separator();
void add_warm_command(CLI::App& app);
void add_agent_command(CLI::App& app);
void add_store_command(CLI::App& app);  // store_command.cc: the node store

// ---- shared by the subcommands ----

// Transforms a size ("4096", "256K", "2M", "1GiB": size_arg.h) in [min, max]
// into its byte count; anything else is refused with the range.
CLI::Validator size_range(std::uint64_t min, std::uint64_t max);

// Accepts a decimal integer in [min, max] ("1K" and "4.0" are refused).
CLI::Validator integer_range(long long min, long long max);

// "8M" for 8388608: the largest binary unit that divides `bytes`.
std::string size_text(std::uint64_t bytes);

// `PATH...`: one or more checkpoints (files, indexes, folders), required.
void add_paths(CLI::App& command, std::vector<std::string>* paths);

// The reader's options that every command which reads checkpoints takes:
// --threads, --block-size, --direct, --cached-read, --numa-node, --variant.
// They are written into *options as they are parsed; ranges are checked by
// CLI11 and reported as usage errors.
void add_reader_options(CLI::App& command, LoadOptions* options);

// --variant only (commands that resolve checkpoints but do not read them).
void add_variant_option(CLI::App& command, ResolveOptions* options);

// "[2,3]" of a shape.
std::string shape_text(const std::vector<std::uint64_t>& shape);

// Lower-case hex SHA-256 of `bytes` (OpenSSL's libcrypto).
std::string sha256_hex(std::span<const std::byte> bytes);

// `text` escaped for plain-text output: pinload::printable_text, see
// Note [Printable text] in base/printable.h. `inspect --json` is exact instead.
std::string printable(const std::string& text);

}  // namespace pinload::cli
