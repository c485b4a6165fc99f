// Tests of the cold target's statistics (bench/fio_compare.h): pure data.
#include "fio_compare.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace pinload::bench {
namespace {

// A deterministic uniform draw in [lo, hi) (no <random> distribution, whose
// output differs between standard libraries).
class Draw {
 public:
  explicit Draw(std::uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  double operator()(double lo, double hi) {
    state_ = state_ * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * static_cast<double>(state_ >> 11) / static_cast<double>(1ull << 53);
  }

 private:
  std::uint64_t state_;
};

// Rounds where pinload reads at `ratio` x fio's rate: the storage's rate
// drifts between rounds, and every run jitters by up to 10% around it.
ColdRounds rounds_at(double ratio, int n, std::uint64_t seed) {
  Draw draw(seed);
  ColdRounds r;
  for (int i = 0; i < n; ++i) {
    const double w = draw(1.7, 2.7);
    r.fio.push_back({{"iodepth32", w * draw(0.9, 1.1)},
                     {"iodepth1", w * draw(0.9, 1.1)},
                     {"iodepth32_hugebuf", w * draw(0.9, 1.1)},
                     {"iodepth1_hugebuf", w * draw(0.9, 1.1)},
                     {"parallel", 0.8 * w}});
    r.pinload.push_back(ratio * w * draw(0.9, 1.1));
  }
  return r;
}

TEST(FioCompareTest, ReferenceIsTheNumjobs1VariantWithTheBestMedian) {
  ColdRounds r;
  // iodepth1 has the single best run (an outlier), iodepth32 the best median;
  // parallel is faster still but is several jobs.
  r.fio = {{{"iodepth1", 3.0}, {"iodepth32", 2.0}, {"parallel", 5.0}},
           {{"iodepth1", 1.0}, {"iodepth32", 2.1}, {"parallel", 5.0}},
           {{"iodepth1", 1.1}, {"iodepth32", 1.9}, {"parallel", 5.0}}};
  r.pinload = {1.9, 2.0, 2.0};
  const FioComparison c = compare_with_fio(r);
  EXPECT_EQ(c.reference, "iodepth32");
  EXPECT_DOUBLE_EQ(c.reference_best, 2.1);
  EXPECT_DOUBLE_EQ(c.reference_median, 2.0);
  EXPECT_DOUBLE_EQ(c.fio_best_any, 3.0);
  EXPECT_DOUBLE_EQ(c.pinload_best, 2.0);
  EXPECT_DOUBLE_EQ(c.pinload_median, 2.0);
  // Same rounds: 1.9/2.0, 2.0/2.1, 2.0/1.9.
  ASSERT_TRUE(c.same_round_reference);
  EXPECT_DOUBLE_EQ(*c.same_round_reference, 2.0 / 2.1);
  // Against the best numjobs=1 variant of each round: 1.9/3.0, 2.0/2.1, 2.0/1.9.
  ASSERT_TRUE(c.same_round_best_variant);
  EXPECT_DOUBLE_EQ(*c.same_round_best_variant, 2.0 / 2.1);
  ASSERT_TRUE(c.same_round_parallel);
  EXPECT_DOUBLE_EQ(*c.same_round_parallel, 0.4);
  EXPECT_TRUE(c.meets(0.9));
  EXPECT_FALSE(c.meets(0.96));  // best/best and the same-round median are 0.952
}

TEST(FioCompareTest, EqualRatesMeetTheTargetWhereTheBestOfEveryRunWouldNot) {
  // pinload reads exactly as fast as fio, but the best of 4 variants x 8
  // rounds beats the best of 8 loads by chance.
  // With runs jittering by 10%, equal draws still miss now and then.
  int met = 0, met_by_best_of_every_run = 0;
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    const FioComparison c = compare_with_fio(rounds_at(1.0, 8, seed));
    ASSERT_TRUE(c.same_round_reference);
    EXPECT_GT(*c.same_round_reference, 0.9) << "seed " << seed;
    EXPECT_LE(c.pinload_best / c.fio_best_any, c.best_over_reference_best()) << "seed " << seed;
    met += c.meets(0.9);
    met_by_best_of_every_run += c.pinload_best / c.fio_best_any >= 0.9;
  }
  EXPECT_GE(met, 45);
  EXPECT_LT(met_by_best_of_every_run, met);
}

TEST(FioCompareTest, ASlowerLoaderMissesTheTarget) {
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    const FioComparison c = compare_with_fio(rounds_at(0.8, 8, seed));
    EXPECT_FALSE(c.meets(0.9)) << "seed " << seed;
    ASSERT_TRUE(c.same_round_reference);
    EXPECT_LT(*c.same_round_reference, 0.9) << "seed " << seed;
  }
}

TEST(FioCompareTest, BothBestAndSameRoundMustMeetTheTarget) {
  ColdRounds r;
  // pinload's best equals fio's best, but in most rounds it is far behind.
  r.fio = {{{"iodepth1", 2.0}}, {{"iodepth1", 2.0}}, {{"iodepth1", 2.0}}};
  r.pinload = {2.0, 1.0, 1.0};
  const FioComparison c = compare_with_fio(r);
  EXPECT_DOUBLE_EQ(c.best_over_reference_best(), 1.0);
  EXPECT_DOUBLE_EQ(*c.same_round_reference, 0.5);
  EXPECT_FALSE(c.meets(0.9));
}

TEST(FioCompareTest, MissingRunsAreLeftOutNotCountedAsZero) {
  ColdRounds r;
  // Round 1 had no huge pages for the hugebuf variant and no pinload load;
  // round 2 lost fio altogether.
  r.fio = {{{"iodepth1", 2.0}, {"iodepth1_hugebuf", 2.4}},
           {{"iodepth1", 2.0}},
           {},
           {{"iodepth1", 2.2}, {"iodepth1_hugebuf", 2.6}, {"parallel", 0.0}}};
  r.pinload = {2.3, 0.0, 2.5, 2.4};
  const FioComparison c = compare_with_fio(r);
  EXPECT_EQ(c.reference, "iodepth1_hugebuf");
  EXPECT_DOUBLE_EQ(c.reference_best, 2.6);
  EXPECT_DOUBLE_EQ(c.pinload_best, 2.5);
  // Rounds 0 and 3 have both: 2.3/2.4, 2.4/2.6.
  ASSERT_TRUE(c.same_round_reference);
  EXPECT_DOUBLE_EQ(*c.same_round_reference, (2.3 / 2.4 + 2.4 / 2.6) / 2);
  EXPECT_FALSE(c.same_round_parallel);  // its only run read nothing
}

TEST(FioCompareTest, NothingMeasuredMeetsNothing) {
  const FioComparison none = compare_with_fio(ColdRounds{});
  EXPECT_TRUE(none.reference.empty());
  EXPECT_FALSE(none.same_round_reference);
  EXPECT_FALSE(none.meets(0.0));
  ColdRounds only_pinload;
  only_pinload.fio.resize(2);
  only_pinload.pinload = {2.0, 2.0};
  EXPECT_FALSE(compare_with_fio(only_pinload).meets(0.0));
  ColdRounds only_fio;
  only_fio.fio = {{{"iodepth1", 2.0}}};
  only_fio.pinload = {0.0};
  EXPECT_FALSE(compare_with_fio(only_fio).meets(0.0));
}

}  // namespace
}  // namespace pinload::bench
