// pinload inspect [--json] [--variant V] PATH...: the headers, without reading tensor data.
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/template_print.h"
#include "pinload/checkpoint.h"

namespace pinload::cli {
namespace {

struct InspectArgs {
  std::vector<std::string> paths;
  bool json = false;
  ResolveOptions resolve;
};

// Written as it goes, not built as a DOM first: a header of a million
// tensors would otherwise cost more to print than to parse. Strings get
// JSON's escaping, exact (Note [Printable text] in command.h).
void print_json(const Checkpoint& checkpoint) {
  std::string out = "{\n  \"files\": [";
  auto str = [](const std::string& text) {
    return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  };
  auto num = [](std::uint64_t v) { return std::to_string(v); };
  for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
    const CheckpointFile& f = checkpoint.files[i];
    const std::uint64_t base = f.header.data_offset();
    out += i ? ",\n    {" : "\n    {";
    out += "\n      \"path\": " + str(f.path) + ",\n      \"file_bytes\": " + num(f.stat.size) +
           ",\n      \"header_bytes\": " + num(f.header.json_size) + ",\n      \"metadata\": {";
    for (std::size_t k = 0; k < f.header.metadata.size(); ++k) {
      out += (k ? ",\n        " : "\n        ") + str(f.header.metadata[k].first) + ": " + str(f.header.metadata[k].second);
    }
    out += f.header.metadata.empty() ? "}" : "\n      }";
    out += ",\n      \"tensors\": [";
    for (std::size_t k = 0; k < f.header.tensors.size(); ++k) {
      const TensorInfo& t = f.header.tensors[k];
      std::string shape;
      for (std::size_t d = 0; d < t.shape.size(); ++d) shape += (d ? ", " : "") + num(t.shape[d]);
      out += k ? ",\n        {" : "\n        {";
      out += "\"name\": " + str(f.name_prefix + t.name) + ", \"dtype\": \"" + std::string(dtype_name(t.dtype)) +
             "\", \"shape\": [" + shape + "], \"bytes\": " + num(t.nbytes()) + ", \"data_offsets\": [" +
             num(t.begin) + ", " + num(t.end) + "], \"file_offsets\": [" + num(base + t.begin) + ", " +
             num(base + t.end) + "]}";
    }
    out += f.header.tensors.empty() ? "]\n    }" : "\n      ]\n    }";
  }
  out += checkpoint.files.empty() ? "]" : "\n  ]";
  out += ",\n  \"index_files\": [";
  for (std::size_t i = 0; i < checkpoint.index_files.size(); ++i) out += (i ? ", " : "") + str(checkpoint.index_files[i]);
  out += "],\n  \"total_tensors\": " + num(checkpoint.tensor_count()) + ",\n  \"total_bytes\": " +
         num(checkpoint.data_bytes()) + "\n}\n";
  std::cout << out;
}

// Sizes in GB, as `load` prints them; each tensor's bytes and offsets stay exact, and so does --json.
std::string gb_text(std::uint64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f GB", static_cast<double>(bytes) / 1e9);
  return text;
}

void print_text(const Checkpoint& checkpoint) {
  for (const CheckpointFile& f : checkpoint.files) {
    // Note [Printable text] (command.h): names, metadata and paths escaped.
    std::cout << printable(f.path) << ": " << f.header.tensors.size() << " tensors, " << gb_text(f.header.data_size())
              << " of data, header " << f.header.json_size << " bytes\n";
    for (const TensorInfo& t : f.header.tensors) {
      const std::uint64_t base = f.header.data_offset();
      std::cout << "  " << printable(f.name_prefix + t.name) << "\t" << dtype_name(t.dtype) << "\t" << shape_text(t.shape)
                << "\t" << t.nbytes() << " B\t[" << base + t.begin << ", " << base + t.end << ")\n";
    }
    for (const auto& [k, v] : f.header.metadata) {
      std::cout << "  metadata " << printable(k) << " = " << printable(v) << "\n";
    }
  }
  std::cout << "total: " << checkpoint.tensor_count() << " tensors, " << gb_text(checkpoint.data_bytes()) << " in "
            << checkpoint.files.size() << " file(s)\n";
}

}  // namespace

void add_inspect_command(CLI::App& app) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* command = app.add_subcommand("inspect", "Print tensors: names, dtypes, shapes, offsets");
  command->add_flag("--json", args->json, "one JSON document instead of text");
  add_variant_option(*command, &args->resolve);
  add_paths(*command, &args->paths);
  command->callback([args] {
    // An I/O template (pinload trace's output) prints as one: files, readers, reads.
    if (args->paths.size() == 1 && is_template_file(args->paths.front())) {
      print_template(args->paths.front(), args->json);
      return;
    }
    const Checkpoint checkpoint = open_checkpoint(default_env(), args->paths, args->resolve);
    if (args->json) {
      print_json(checkpoint);
    } else {
      print_text(checkpoint);
    }
  });
}

}  // namespace pinload::cli
