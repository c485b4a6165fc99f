#include "cli/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace pinload::cli {

namespace {
constexpr int kBarWidth = 30;
}

std::string format_interval(double seconds) {
  const auto total = static_cast<long long>(seconds);
  const long long h = total / 3600, m = total / 60 % 60, s = total % 60;
  char out[32];
  if (h != 0) {
    std::snprintf(out, sizeof out, "%lld:%02lld:%02lld", h, m, s);
  } else {
    std::snprintf(out, sizeof out, "%02lld:%02lld", m, s);
  }
  return out;
}

std::string progress_line(std::uint64_t done, std::uint64_t total, double seconds) {
  const double fraction = total == 0 ? 1.0 : std::min(1.0, static_cast<double>(done) / static_cast<double>(total));
  const int filled = static_cast<int>(fraction * kBarWidth);
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.append(static_cast<std::size_t>(kBarWidth - filled), ' ');
  const double rate = seconds > 0 ? done / 1e9 / seconds : 0.0;
  char rate_text[32] = "    ?";
  std::string remaining = "?";
  if (rate > 0) {
    std::snprintf(rate_text, sizeof rate_text, "%5.2f", rate);
    remaining = format_interval(std::max(0.0, (total - std::min(done, total)) / 1e9 / rate));
  }
  char out[256];
  std::snprintf(out, sizeof out, "pinload %3.0f%%|%s| %.2f/%.2f GB %s GB/s [%s<%s]", fraction * 100,
                bar.c_str(), done / 1e9, total / 1e9, rate_text, format_interval(seconds).c_str(), remaining.c_str());
  return out;
}

ProgressBar::ProgressBar(Show show, std::chrono::milliseconds delay)
    : enabled_(show == kAlways || (show == kOnTerminal && ::isatty(STDERR_FILENO) == 1)),
      delay_(delay),
      start_(std::chrono::steady_clock::now()) {}

void ProgressBar::draw(std::uint64_t done, std::uint64_t total) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::fprintf(stderr, "\r%s", progress_line(done, total, seconds).c_str());
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressBar::update(std::uint64_t done, std::uint64_t total) {
  const auto now = std::chrono::steady_clock::now();
  if (!enabled_ || now - start_ < delay_ || now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  draw(done, total);
}

void ProgressBar::finish(std::uint64_t done, std::uint64_t total) {
  if (!drawn_) return;
  draw(done, total);
  std::fputc('\n', stderr);
  drawn_ = false;
}

}  // namespace pinload::cli
