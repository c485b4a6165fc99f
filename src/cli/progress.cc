#include "cli/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

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

namespace {

// The line with a bar of `bar_width` characters.
std::string line_with_bar(std::uint64_t done, std::uint64_t total, double seconds, int bar_width,
                          std::size_t* without_bar) {
  const double fraction = total == 0 ? 1.0 : std::min(1.0, static_cast<double>(done) / static_cast<double>(total));
  const double rate = seconds > 0 ? done / 1e9 / seconds : 0.0;
  char rate_text[32] = "?";
  std::string remaining = "?";
  if (rate > 0) {
    std::snprintf(rate_text, sizeof rate_text, "%5.2f", rate);
    remaining = format_interval(std::max(0.0, (total - std::min(done, total)) / 1e9 / rate));
  }
  char head[32];
  std::snprintf(head, sizeof head, "pinload %3.0f%%|", fraction * 100);
  char tail[160];
  std::snprintf(tail, sizeof tail, "| %.2f/%.2f GB %s GB/s [%s<%s]", done / 1e9, total / 1e9, rate_text,
                format_interval(seconds).c_str(), remaining.c_str());
  std::string out = head;
  *without_bar = out.size() + std::string_view(tail).size();
  if (bar_width > 0) {
    const int filled = static_cast<int>(fraction * bar_width);
    out.append(static_cast<std::size_t>(filled), '#');
    out.append(static_cast<std::size_t>(bar_width - filled), ' ');
  }
  return out + tail;
}

}  // namespace

std::string progress_line(std::uint64_t done, std::uint64_t total, double seconds) {
  std::size_t without_bar = 0;
  return line_with_bar(done, total, seconds, kBarWidth, &without_bar);
}

std::string progress_line(std::uint64_t done, std::uint64_t total, double seconds, int columns) {
  // Note [Terminal width]: tqdm's format_meter with ncols (N_BARS = max(1, ncols - len(nobar)),
  // then disp_trim to ncols).
  const std::size_t width = static_cast<std::size_t>(std::max(columns, 1));
  std::size_t without_bar = 0;
  line_with_bar(done, total, seconds, 0, &without_bar);
  const int bar = without_bar < width ? static_cast<int>(width - without_bar) : 1;
  std::string line = line_with_bar(done, total, seconds, bar, &without_bar);
  if (line.size() > width) line.resize(width);
  return line;
}

int terminal_columns(int fd) {
  winsize size{};
  if (::ioctl(fd, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  if (const char* env = std::getenv("COLUMNS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n > 0 && n <= 100000) return static_cast<int>(n);
  }
  return 80;
}

ProgressBar::ProgressBar(Show show, std::chrono::milliseconds delay)
    : enabled_(show == kAlways || (show == kOnTerminal && ::isatty(STDERR_FILENO) == 1)),
      delay_(delay),
      start_(std::chrono::steady_clock::now()) {}

void ProgressBar::draw(std::uint64_t done, std::uint64_t total) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const int columns = terminal_columns(STDERR_FILENO);
  std::string line = progress_line(done, total, seconds, columns);
  const std::size_t length = line.size();
  // Blank what a longer previous line left (a terminal made narrower), within the width.
  const std::size_t room = static_cast<std::size_t>(columns);
  if (last_length_ > length) line.append(std::min(last_length_, room) - length, ' ');
  last_length_ = length;
  std::fprintf(stderr, "\r%s", line.c_str());
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
  last_length_ = 0;
}

}  // namespace pinload::cli
