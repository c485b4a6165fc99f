// Internal to the CLI: a one-line progress bar on a terminal.
//
// The line has the fields and units of the Python package's bar (tqdm with
// the bar_format in python/pinload/_progress.py) and of the summaries: GB and
// GB/s (10^9 bytes), e.g.
//   pinload  45%|#############                 | 1.23/2.73 GB  2.34 GB/s [00:00<00:01]
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace pinload::cli {

// tqdm's format_interval: "MM:SS", or "H:MM:SS" from an hour on.
std::string format_interval(double seconds);

// The bar's line for `done` of `total` bytes after `seconds` (no newline).
std::string progress_line(std::uint64_t done, std::uint64_t total, double seconds);

// Draws progress_line on stderr, at most 10 times a second, once the work
// has run longer than `delay`; finish() draws the final line and ends it
// with a newline, so the bar stays on screen above the summary. Not
// thread-safe: one thread updates it.
class ProgressBar {
 public:
  enum Show { kNever, kOnTerminal, kAlways };
  explicit ProgressBar(Show show = kOnTerminal, std::chrono::milliseconds delay = std::chrono::seconds(1));
  void update(std::uint64_t done, std::uint64_t total);
  void finish(std::uint64_t done, std::uint64_t total);  // only if a line was drawn

 private:
  void draw(std::uint64_t done, std::uint64_t total);

  bool enabled_;
  bool drawn_ = false;
  std::chrono::milliseconds delay_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace pinload::cli
