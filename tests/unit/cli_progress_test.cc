// The CLI's progress line has the fields and units of the Python package's tqdm bar: the same
// lines as tests/python/test_progress.py expects from tqdm with pinload._loading.BAR_FORMAT.
#include <fcntl.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cli/progress.h"

namespace pinload::cli {
namespace {

TEST(ProgressLine, MatchesTheTqdmBar) {
  EXPECT_EQ(progress_line(1'230'000'000, 2'730'000'000, 0.5),
            "pinload  45%|#############                 | 1.23/2.73 GB  2.46 GB/s [00:00<00:00]");
  EXPECT_EQ(progress_line(0, 2'730'000'000, 3.0), "pinload   0%|                              | 0.00/2.73 GB ? GB/s [00:03<?]");
  EXPECT_EQ(progress_line(2'730'000'000, 2'730'000'000, 70.2),
            "pinload 100%|##############################| 2.73/2.73 GB  0.04 GB/s [01:10<00:00]");
  EXPECT_EQ(progress_line(500'000'000, 10'000'000'000, 4000),
            "pinload   5%|#                             | 0.50/10.00 GB  0.00 GB/s [1:06:40<21:06:40]");
}

TEST(ProgressLine, IntervalsAsTqdm) {
  EXPECT_EQ(format_interval(0), "00:00");
  EXPECT_EQ(format_interval(59.9), "00:59");
  EXPECT_EQ(format_interval(3600), "1:00:00");
}

TEST(ProgressLine, FitsTheTerminal) {  // Note [Terminal width]
  for (int columns : {200, 120, 80, 60, 40, 20, 5, 1}) {
    for (double seconds : {0.5, 70.2, 4000.0}) {
      const std::string line = progress_line(1'230'000'000, 2'730'000'000, seconds, columns);
      EXPECT_LE(line.size(), static_cast<std::size_t>(columns)) << line;
      EXPECT_EQ(line.rfind(std::string("pinload").substr(0, static_cast<std::size_t>(columns)), 0), 0U) << line;
    }
  }
  // Wide enough: the bar takes what the fields leave, and the line is exactly as wide.
  const std::string at80 = progress_line(1'230'000'000, 2'730'000'000, 0.5, 80);
  EXPECT_EQ(at80, "pinload  45%|############                | 1.23/2.73 GB  2.46 GB/s [00:00<00:00]");
  EXPECT_EQ(progress_line(1'230'000'000, 2'730'000'000, 0.5, 120).size(), 120U);
  // Narrower than the fields: one bar character, the line cut at the width (as tqdm's disp_trim).
  EXPECT_EQ(progress_line(1'230'000'000, 2'730'000'000, 0.5, 40), "pinload  45%| | 1.23/2.73 GB  2.46 GB/s ");
}

// A pseudo-terminal `columns` wide on stderr while `body` runs; returns what was written to it.
template <class Body>
std::string on_terminal(int columns, Body body) {
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY);
  EXPECT_GE(master, 0);
  EXPECT_EQ(::grantpt(master), 0);
  EXPECT_EQ(::unlockpt(master), 0);
  const int slave = ::open(::ptsname(master), O_RDWR | O_NOCTTY);
  EXPECT_GE(slave, 0);
  winsize size{};
  size.ws_col = static_cast<unsigned short>(columns);
  size.ws_row = 24;
  EXPECT_EQ(::ioctl(slave, TIOCSWINSZ, &size), 0);
  std::fflush(stderr);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(slave, STDERR_FILENO);
  body(slave);
  std::fflush(stderr);
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  ::close(slave);
  std::string out;
  char buffer[4096];
  pollfd p{master, POLLIN, 0};
  while (::poll(&p, 1, 100) > 0) {
    const ssize_t n = ::read(master, buffer, sizeof buffer);
    if (n <= 0) break;
    out.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(master);
  return out;
}

// Every redraw starts with "\r" and is no wider than `columns`; one line in all (the newline of
// finish(), which the terminal writes as "\r\n").
void expect_in_place(const std::string& out, int columns) {
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out[0], '\r');
  EXPECT_EQ(out.substr(out.size() - 2), "\r\n");
  std::vector<std::string> draws;
  std::size_t start = 1;
  for (std::size_t i = 1; i <= out.size(); ++i) {
    if (i == out.size() || out[i] == '\r') {
      draws.push_back(out.substr(start, i - start));
      start = i + 1;
    }
  }
  EXPECT_GE(draws.size(), 3U) << out;
  for (const std::string& d : draws) {
    if (d == "\n" || d.empty()) continue;
    EXPECT_LE(d.size(), static_cast<std::size_t>(columns)) << "[" << d << "]";
    EXPECT_EQ(d.find('\n'), std::string::npos) << "[" << d << "]";
    EXPECT_EQ(d.rfind("pinload", 0), 0U) << "[" << d << "]";
  }
}

void draw_some(std::uint64_t total) {
  ProgressBar bar(ProgressBar::kOnTerminal, std::chrono::milliseconds(0));
  for (int i = 1; i <= 3; ++i) {
    bar.update(total * static_cast<std::uint64_t>(i) / 4, total);
    std::this_thread::sleep_for(std::chrono::milliseconds(110));  // the bar draws at most 10 times a second
  }
  bar.finish(total, total);
}

TEST(ProgressBar, RedrawsInPlaceOnA80And40ColumnTerminal) {
  for (int columns : {80, 40}) {
    const std::string out = on_terminal(columns, [](int) { draw_some(2'730'000'000); });
    expect_in_place(out, columns);
  }
}

TEST(ProgressBar, FollowsAResizedTerminal) {
  const std::string out = on_terminal(80, [](int slave) {
    ProgressBar bar(ProgressBar::kOnTerminal, std::chrono::milliseconds(0));
    bar.update(1'000'000'000, 4'000'000'000);
    std::this_thread::sleep_for(std::chrono::milliseconds(110));
    winsize size{};
    size.ws_col = 40;
    size.ws_row = 24;
    ::ioctl(slave, TIOCSWINSZ, &size);
    bar.update(2'000'000'000, 4'000'000'000);
    std::this_thread::sleep_for(std::chrono::milliseconds(110));
    bar.finish(4'000'000'000, 4'000'000'000);
  });
  expect_in_place(out, 80);
  // After the resize every draw fits 40 columns: the last one is the final line.
  const std::size_t last = out.rfind('\r', out.size() - 3);
  EXPECT_LE(out.size() - 2 - (last + 1), 40U) << out;
}

TEST(ProgressBar, WidthFromColumnsWhenNotATerminal) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ::setenv("COLUMNS", "50", 1);
  EXPECT_EQ(terminal_columns(fds[0]), 50);
  ::setenv("COLUMNS", "junk", 1);
  EXPECT_EQ(terminal_columns(fds[0]), 80);
  ::unsetenv("COLUMNS");
  EXPECT_EQ(terminal_columns(fds[0]), 80);
  ::close(fds[0]);
  ::close(fds[1]);
}

}  // namespace
}  // namespace pinload::cli
