// pinload manifest [-o OUT] PATH...: the digests of a checkpoint's files and
// tensors (manifest.h, docs/manifest.md), for `pinload load --verify`.
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "pinload/manifest.h"

namespace pinload::cli {
namespace {

struct ManifestArgs {
  std::vector<std::string> paths;
  std::string output;  // "" or "-": stdout
  ResolveOptions resolve;
  ManifestOptions options;
};

void run_manifest(ManifestArgs& args) {
  args.options.variant = args.resolve.variant;
  const Manifest manifest = make_manifest(args.paths, args.options);
  if (args.output.empty() || args.output == "-") {
    std::cout << manifest_to_json(manifest);
    std::cout.flush();
  } else {
    save_manifest(manifest, args.output);
  }
}

}  // namespace

void add_manifest_command(CLI::App& app) {
  auto args = std::make_shared<ManifestArgs>();
  CLI::App* command = app.add_subcommand(
      "manifest", "Write the SHA-256 digests that load --verify checks (JSON)");
  command->add_option("-o,--output", args->output, "write the manifest here, atomically (default: stdout)")
      ->type_name("FILE");
  command->add_option("--piece-size", args->options.piece_bytes, "the pieces large tensors are hashed in")
      ->transform(size_range(4u << 10, 1u << 30))
      ->type_name("SIZE")
      ->default_str(size_text(args->options.piece_bytes));
  command->add_option("--threads", args->options.threads, "hashing threads per file (1 or 2)")
      ->transform(integer_range(1, 2))
      ->type_name("1..2")
      ->capture_default_str();
  add_variant_option(*command, &args->resolve);
  command->add_option("PATH", args->paths, "a .safetensors file, an *.index.json, or a folder (local only)")
      ->required()
      ->type_name("");
  command->callback([args] { run_manifest(*args); });
}

}  // namespace pinload::cli
