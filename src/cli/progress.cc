#include "cli/progress.h"

#include <unistd.h>

#include <string>

namespace pinload::cli {

ProgressBar::ProgressBar(std::chrono::milliseconds delay)
    : tty_(::isatty(STDERR_FILENO) == 1), delay_(delay), start_(std::chrono::steady_clock::now()) {}

void ProgressBar::update(std::uint64_t done, std::uint64_t total) {
  const auto elapsed = std::chrono::steady_clock::now() - start_;
  if (!tty_ || elapsed < delay_ || total == 0) return;
  constexpr int kWidth = 30;
  const double fraction = static_cast<double>(done) / static_cast<double>(total);
  const int filled = static_cast<int>(fraction * kWidth);
  const double seconds = std::chrono::duration<double>(elapsed).count();
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.append(static_cast<std::size_t>(kWidth - filled), '.');
  std::fprintf(stderr, "\r[%s] %6.2f/%.2f GiB  %6.2f GB/s ", bar.c_str(), done / 1073741824.0,
               total / 1073741824.0, done / seconds / 1e9);
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressBar::finish() {
  if (drawn_) std::fprintf(stderr, "\r%80s\r", "");
  drawn_ = false;
}

}  // namespace pinload::cli
