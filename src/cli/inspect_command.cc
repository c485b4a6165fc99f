// pinload inspect [--json] [--variant V] PATH...: the headers, without reading tensor data.
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "pinload/checkpoint.h"

namespace pinload::cli {
namespace {

struct InspectArgs {
  std::vector<std::string> paths;
  bool json = false;
  ResolveOptions resolve;
};

void print_json(const Checkpoint& checkpoint) {
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
}

void print_text(const Checkpoint& checkpoint) {
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
}

}  // namespace

void add_inspect_command(CLI::App& app) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* command = app.add_subcommand("inspect", "Print the tensors of checkpoints: names, dtypes, shapes, offsets");
  command->add_flag("--json", args->json, "one JSON document instead of text");
  add_variant_option(*command, &args->resolve);
  add_paths(*command, &args->paths);
  command->callback([args] {
    const Checkpoint checkpoint = open_checkpoint(default_env(), args->paths, args->resolve);
    if (args->json) {
      print_json(checkpoint);
    } else {
      print_text(checkpoint);
    }
  });
}

}  // namespace pinload::cli
