// Internal: `pinload convert` (convert_command.cc), its own parser and
// messages, called by main() with argv[0] == "convert".
#pragma once

namespace pinload::cli {

// Runs `pinload convert ...`; returns the exit status (0 done, 1 a
// pinload::Error, 2 a usage error), having printed what went wrong.
int run_convert_command(int argc, char** argv);

}  // namespace pinload::cli
