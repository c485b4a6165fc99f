// The pinload command-line program: inspect and load safetensors checkpoints.
//
// Arguments are parsed by CLI11; each subcommand adds itself in its own file
// (command.h). Exit codes: 0 success (and --help, --version), 1 bad input
// (one line "pinload: error: <file>: <what>" on stderr), 2 a command-line
// mistake ("pinload: error: <what>" and the usage).
#include <cstdio>
#include <cstring>
#include <iostream>
#include <new>
#include <string>

#include "base/log.h"
#include "cli/command.h"
#include "pinload/error.h"

#ifndef PINLOAD_VERSION
#define PINLOAD_VERSION "unknown"
#endif

namespace pinload::cli {
namespace {

// The subcommand the arguments name, or null (none given, or not one of ours).
const CLI::App* named_subcommand(const CLI::App& app, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '-') continue;
    for (const CLI::App* sub : app.get_subcommands({})) {
      if (sub->get_name() == argv[i]) return sub;
    }
    return nullptr;
  }
  return nullptr;
}

}  // namespace

// `pinload encoder ...` (encoder_command.cc): listed in --help; run_encoder_command replaces the
// process with Python's pinload package, given the arguments after "encoder" (Note [Encoder hand-off]).
void add_encoder_command(CLI::App& app);
int run_encoder_command(int argc, char** argv);

namespace {

int usage_error(const CLI::App& app, const CLI::App* command, const std::string& what) {
  const CLI::App& shown = command != nullptr ? *command : app;
  const std::string name = command != nullptr ? "pinload " + command->get_name() : "pinload";
  std::fprintf(stderr, "pinload: error: %s\n%sRun '%s --help' for more.\n", printable(what).c_str(),
               CLI::Formatter().make_usage(&shown, name).c_str(), name.c_str());
  return 2;
}

int run(int argc, char** argv) {
  // PINLOAD_LOG_LEVEL is read (and a bad value reported) once, at start, whatever the command logs.
  (void)log::logger();
  CLI::App app("pinload: inspect, load and convert safetensors checkpoints fast", "pinload");
  app.set_version_flag("--version", std::string("pinload ") + PINLOAD_VERSION);
  app.require_subcommand(1);
  app.fallthrough(false);
  app.footer("PATH: a .safetensors file, a *.safetensors.index.json, a model or pipeline folder;\n"
             "local, s3://bucket/key, s3://bucket/prefix/ or http(s)://host/path (docs/remote.md).\n"
             "Environment: PINLOAD_LOG_LEVEL=trace|debug|info|warn|error|critical|off (default warn).");
  add_inspect_command(app);
  add_load_command(app);
  add_convert_command(app);
  add_manifest_command(app);
  add_trace_command(app);
  add_warm_command(app);
  add_agent_command(app);
  add_store_command(app);
  add_encoder_command(app);

  const CLI::App* command = named_subcommand(app, argc, argv);
  if (command == nullptr && argc > 1 && argv[1][0] != '-') {
    return usage_error(app, nullptr, "unknown command '" + std::string(argv[1]) + "'");
  }
  if (command != nullptr && command->get_name() == "encoder") {  // its arguments are Python's
    int at = 1;
    while (std::strcmp(argv[at], "encoder") != 0) ++at;
    return run_encoder_command(argc - at - 1, argv + at + 1);
  }
  if (command != nullptr && command->get_name() == "trace") {
    for (int i = 1; i < argc; ++i) {
      if (std::strcmp(argv[i], "--") != 0) continue;
      command_after_separator().assign(argv + i + 1, argv + argc);
      command_after_separator().insert(command_after_separator().begin(), "--");  // a separator was given
      argc = i;
      break;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();  // a subcommand's own exit status (trace: the traced command's)
  } catch (const CLI::ParseError& e) {
    return usage_error(app, command, e.what());
  } catch (const UsageError& e) {
    return usage_error(app, command, e.what());
  }
  return 0;
}

}  // namespace
}  // namespace pinload::cli

int main(int argc, char** argv) {
  using pinload::cli::printable;
  std::ios::sync_with_stdio(false);
  try {
    return pinload::cli::run(argc, argv);
  } catch (const pinload::Error& e) {
    std::fprintf(stderr, "pinload: error: %s\n", printable(e.what()).c_str());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "pinload: error: out of memory\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pinload: error: %s\n", printable(e.what()).c_str());
  }
  std::cout.flush();
  return 1;
}
