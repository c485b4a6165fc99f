// `pinload inspect T.pltemplate`: an I/O template's files, readers and reads
// (io_template.h), as text or JSON.
#include "cli/template_print.h"

#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "pinload/error.h"

namespace pinload::cli {

namespace {

constexpr char kTemplateMagic[8] = {'P', 'L', 'T', 'M', 'P', 'L', '\0', '\1'};

std::vector<std::uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError("cannot open the template", ErrorContext{path});
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

bool is_template_file(const std::string& path) {
  // Only a regular file is opened here: a FIFO or a device is refused by the
  // checkpoint reader, which never blocks on one (reliability item 4).
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  char head[sizeof kTemplateMagic] = {};
  return in.read(head, sizeof head) && std::equal(head, head + sizeof head, kTemplateMagic);
}

void print_template(const std::string& path, bool json) {
  const std::vector<std::uint8_t> bytes = read_all(path);
  std::string why;
  const std::optional<IoTemplate> t = parse_template(bytes, &why);
  if (!t) throw InvalidFileError("not a valid I/O template: " + why, ErrorContext{path});
  if (json) {
    // Built as a DOM: a template is small (Note [Template keys]: one per service).
    nlohmann::json out;
    out["path"] = path;
    out["files"] = nlohmann::json::array();
    for (const TemplateFile& f : t->files) {
      out["files"].push_back({{"path", f.path}, {"name_prefix", f.name_prefix}, {"size", f.size},
                              {"mtime_ns", f.mtime_ns}, {"inode", f.inode}, {"device", f.device}});
    }
    out["readers"] = nlohmann::json::array();
    for (const TemplateReader& r : t->readers) out["readers"].push_back({{"pid", r.pid}, {"comm", r.comm}, {"exe", r.exe}});
    out["destinations"] = nlohmann::json::object();
    for (const TemplateReads& d : t->destinations) {
      nlohmann::json reads = nlohmann::json::array();
      for (const TemplateRead& r : d.reads) {
        nlohmann::json one = {{"file", r.file}, {"offset", r.offset}, {"length", r.length}};
        one["reader"] = r.reader == kNoReader ? nlohmann::json(nullptr) : nlohmann::json(r.reader);
        reads.push_back(std::move(one));
      }
      out["destinations"][d.destination] = std::move(reads);
    }
    std::cout << out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    return;
  }
  // Note [Printable text] (command.h): paths and names escaped.
  std::cout << printable(path) << ": I/O template, " << t->files.size() << " file(s), " << t->readers.size()
            << " reader(s)\n";
  for (std::size_t i = 0; i < t->files.size(); ++i) {
    std::cout << "  file " << i << "\t" << printable(t->files[i].path) << "\t" << t->files[i].size << " B\n";
  }
  for (std::size_t i = 0; i < t->readers.size(); ++i) {
    const TemplateReader& r = t->readers[i];
    std::cout << "  reader " << i << "\tpid " << r.pid << "\t" << printable(r.comm.empty() ? "?" : r.comm) << "\t"
              << printable(r.exe.empty() ? "?" : r.exe) << "\n";
  }
  for (const TemplateReads& d : t->destinations) {
    std::uint64_t bytes_read = 0;
    for (const TemplateRead& r : d.reads) bytes_read += r.length;
    std::cout << "  " << printable(d.destination) << ": " << d.reads.size() << " read(s), " << bytes_read << " B\n";
    for (const TemplateRead& r : d.reads) {
      std::cout << "    file " << r.file << "\t[" << r.offset << ", " << r.offset + r.length << ")\t" << r.length << " B";
      if (r.reader != kNoReader) std::cout << "\treader " << r.reader;
      std::cout << "\n";
    }
  }
}

}  // namespace pinload::cli
