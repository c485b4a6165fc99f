// Internal to the CLI: a one-line progress bar on a terminal.
//
// The line has the fields and units of the Python package's bar (tqdm with
// the bar_format in python/pinload/_progress.py) and of the summaries: GB and
// GB/s (10^9 bytes), e.g.
//   pinload  45%|#############                 | 1.23/2.73 GB  2.34 GB/s [00:00<00:01]
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace pinload::cli {

// tqdm's format_interval: "MM:SS", or "H:MM:SS" from an hour on.
std::string format_interval(double seconds);

// The bar's line for `done` of `total` bytes after `seconds` (no newline),
// with a bar of 30 characters.
std::string progress_line(std::uint64_t done, std::uint64_t total, double seconds);

// Note [Terminal width]
// The line for a terminal `columns` wide, as tqdm draws it with ncols: the bar
// takes what the other fields leave (at least one character), and a line
// that is still too wide is cut at `columns`. The line is never wider than
// the terminal, so it never wraps, and "\r" redraws it in place. Written
// here, not taken from a C++ library: indicators, the usual one, gives a bar
// a fixed width (BarWidth) when it is made. This line follows tqdm's layout
// field by field, so the CLI's bar reads as the Python package's, which is
// tqdm itself (tests/python/test_progress.py compares the two).
std::string progress_line(std::uint64_t done, std::uint64_t total, double seconds, int columns);

// The width of the terminal on `fd` (TIOCGWINSZ), else $COLUMNS, else 80.
int terminal_columns(int fd);

// Draws progress_line on stderr, at most 10 times a second, once the work
// has run longer than `delay`; finish() draws the final line and ends it
// with a newline, so the bar stays on screen above the summary. Each draw
// reads the terminal's width again (a resized terminal gets lines of its new
// width) and blanks what is left of a longer previous line. Not
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
  std::size_t last_length_ = 0;
  std::chrono::milliseconds delay_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace pinload::cli
