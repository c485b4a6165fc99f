// Internal to the pinload program: the page-cache commands (docs/trace.md).
// Each takes the arguments after its name (argv[0] is the command's name)
// and returns the process's exit status; none throws.
#pragma once

namespace pinload::cli {

// pinload trace --template OUT [--root DIR]... -- CMD ARGS...
int run_trace_command(int argc, char** argv);
// pinload warm (--template T | PATH...) [--budget BYTES] [--follow PID | --cgroup DIR] [--threads N]
int run_warm_command(int argc, char** argv);
// pinload agent --root DIR... --templates DIR [--idle-ms N]
int run_agent_command(int argc, char** argv);

}  // namespace pinload::cli
