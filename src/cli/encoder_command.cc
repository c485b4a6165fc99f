// pinload encoder ...: the text-encoder server (docs/encoder.md) is Python
// (pinload.encoder.server); this command replaces the process with
// `python -m pinload encoder ...`, its arguments untouched.
//
// Note [Encoder hand-off]
// The interpreter: $PINLOAD_PYTHON, else the one CMake found when this program
// was built (PINLOAD_PYTHON_EXECUTABLE) where it still exists, else python3 on
// PATH. The package, put before PYTHONPATH where found: the folder that holds it
// when this program is the wheel's copy (<site-packages>/pinload/bin/pinload),
// else the build tree's <build>/python and <source>/python
// (PINLOAD_PYTHON_PATHS) where they exist; an installed package needs neither.
// Python's `pinload` console script (pinload/_cli.py) serves `encoder` itself
// and runs this program for every other command. A package that handed
// `encoder` back to this program (an older one, which runs the program for
// everything) would loop: PINLOAD_ENCODER_HANDOFF, set before the exec, makes a
// second arrival an error instead.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "base/log.h"

#ifndef PINLOAD_PYTHON_EXECUTABLE
#define PINLOAD_PYTHON_EXECUTABLE ""
#endif
#ifndef PINLOAD_PYTHON_PATHS
#define PINLOAD_PYTHON_PATHS ""
#endif

namespace pinload::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kHandoff = "PINLOAD_ENCODER_HANDOFF";

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// The folders to put before PYTHONPATH (Note [Encoder hand-off]).
std::vector<std::string> package_paths() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && self.parent_path().filename() == "bin" && is_file(self.parent_path().parent_path() / "__init__.py")) {
    return {self.parent_path().parent_path().parent_path().string()};  // the wheel's copy
  }
  std::vector<std::string> out;
  const std::string built = PINLOAD_PYTHON_PATHS;
  for (std::size_t begin = 0; begin <= built.size();) {
    std::size_t end = built.find(':', begin);
    if (end == std::string::npos) end = built.size();
    const std::string dir = built.substr(begin, end - begin);
    if (!dir.empty() && fs::is_directory(fs::path(dir) / "pinload", ec)) out.push_back(dir);
    begin = end + 1;
  }
  return out;
}

std::string interpreter() {
  const char* env = std::getenv("PINLOAD_PYTHON");
  if (env != nullptr && *env != '\0') return env;
  const std::string built = PINLOAD_PYTHON_EXECUTABLE;
  if (!built.empty() && ::access(built.c_str(), X_OK) == 0) return built;
  return "python3";
}

}  // namespace

void add_encoder_command(CLI::App& app) {
  // Listed here for --help; main() hands its arguments to run_encoder_command before CLI11 parses.
  app.add_subcommand("encoder",
                     "Serve a T5 or CLIP text encoder over HTTP (docs/encoder.md)");
}

int run_encoder_command(int argc, char** argv) {
  if (const char* seen = std::getenv(kHandoff); seen != nullptr && *seen != '\0') {
    std::fprintf(stderr,
                 "pinload: error: 'pinload encoder' came back from Python (%s is set): the pinload package "
                 "that interpreter imports has no encoder server; set PINLOAD_PYTHON to an interpreter with a "
                 "current pinload (pip install .[encoder])\n",
                 kHandoff);
    return 1;
  }
  std::string paths;
  for (const std::string& dir : package_paths()) paths += dir + ":";
  if (!paths.empty()) {
    const char* old = std::getenv("PYTHONPATH");
    paths = (old != nullptr && *old != '\0') ? paths + old : paths.substr(0, paths.size() - 1);
    ::setenv("PYTHONPATH", paths.c_str(), 1);
  }
  ::setenv(kHandoff, "1", 1);
  const std::string python = interpreter();
  std::vector<std::string> words{python, "-m", "pinload", "encoder"};
  words.insert(words.end(), argv, argv + argc);
  std::vector<char*> args;
  for (std::string& word : words) args.push_back(word.data());
  args.push_back(nullptr);
  log::logger().debug("encoder: exec {} -m pinload encoder (PYTHONPATH={})", python, paths);
  std::fflush(stdout);
  std::fflush(stderr);
  ::execvp(python.c_str(), args.data());
  const int err = errno;
  std::fprintf(stderr,
               "pinload: error: cannot run the Python interpreter '%s' for 'pinload encoder': %s; set "
               "PINLOAD_PYTHON to one that has the pinload package and its encoder extras (pip install "
               ".[encoder])\n",
               python.c_str(), std::strerror(err));
  return 1;
}

}  // namespace pinload::cli
