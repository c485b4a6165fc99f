// The CLI's progress line has the fields and units of the Python package's tqdm bar: the same
// lines as tests/python/test_progress.py expects from tqdm with pinload._loading.BAR_FORMAT.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace pinload::cli
