// Internal to the CLI: a one-line progress bar on a terminal.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace pinload::cli {

// Draws "[#####.....]  1.2/4.0 GiB  3.10 GB/s" on stderr, but only when stderr
// is a terminal and the work has run longer than `delay`.
class ProgressBar {
 public:
  explicit ProgressBar(std::chrono::milliseconds delay = std::chrono::seconds(1));
  void update(std::uint64_t done, std::uint64_t total);
  void finish();  // clears the line if one was drawn

 private:
  bool tty_;
  bool drawn_ = false;
  std::chrono::milliseconds delay_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace pinload::cli
