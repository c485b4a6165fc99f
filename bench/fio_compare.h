// bench/fio_compare.h: pinload's cold re-loads against fio, round by round.
//
// Note [Comparing with fio]
// Storage bandwidth on a shared VM drifts by 20% within minutes, so a best-of
// taken over more runs is higher by chance alone: the best of fio's four
// numjobs=1 variants x N rounds beats the best of N pinload re-loads even when
// both read at the same rate. The cold target therefore compares pinload with
// one fio variant, the reference: the numjobs=1 variant with the best median,
// which ran as many times as pinload re-loaded, in the same rounds. Best
// against best and the median of the per-round ratios must both reach the
// target. The best of every fio run is kept for the report
// (cold_best_over_fio_best), as are the per-round ratios against the best
// variant of each round.
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace pinload::bench {

// What the cold rounds measured, as plain data.
struct ColdRounds {
  // Per round: fio variant -> GB/s. A variant may be missing from a round
  // (huge-page buffers that could not be had).
  std::vector<std::map<std::string, double>> fio;
  // Per round: pinload's re-load in GB/s; 0 where it did not run.
  std::vector<double> pinload;
};

// The variant that is not a reference candidate: several jobs at once.
inline constexpr const char* kFioParallelVariant = "parallel";

struct FioComparison {
  std::string reference;  // empty: no numjobs=1 fio run
  double reference_best = 0;
  double reference_median = 0;
  double fio_best_any = 0;  // the best of every numjobs=1 run
  double pinload_best = 0;
  double pinload_median = 0;
  // Medians of pinload / fio of the same round, over the rounds with both.
  std::optional<double> same_round_reference;
  std::optional<double> same_round_best_variant;
  std::optional<double> same_round_parallel;

  double best_over_reference_best() const { return reference_best > 0 ? pinload_best / reference_best : 0; }
  // Note [Comparing with fio]: both best/best and the same-round median.
  bool meets(double target) const {
    return reference_best > 0 && best_over_reference_best() >= target && same_round_reference &&
           *same_round_reference >= target;
  }
};

inline std::optional<double> median(std::vector<double> v) {
  if (v.empty()) return std::nullopt;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

inline FioComparison compare_with_fio(const ColdRounds& rounds) {
  FioComparison out;
  std::map<std::string, std::vector<double>> by_variant;
  for (const auto& round : rounds.fio) {
    for (const auto& [variant, gbps] : round) {
      if (gbps > 0) by_variant[variant].push_back(gbps);
    }
  }
  for (const auto& [variant, runs] : by_variant) {
    if (variant == kFioParallelVariant) continue;
    const double m = *median(runs);
    const double best = *std::max_element(runs.begin(), runs.end());
    out.fio_best_any = std::max(out.fio_best_any, best);
    if (out.reference.empty() || m > out.reference_median) {
      out.reference = variant;
      out.reference_median = m;
      out.reference_best = best;
    }
  }
  std::vector<double> loads, vs_reference, vs_best_variant, vs_parallel;
  for (std::size_t r = 0; r < rounds.pinload.size(); ++r) {
    const double p = rounds.pinload[r];
    if (p <= 0) continue;
    loads.push_back(p);
    if (r >= rounds.fio.size()) continue;
    double round_best = 0;
    for (const auto& [variant, gbps] : rounds.fio[r]) {
      if (gbps <= 0) continue;
      if (variant == kFioParallelVariant) {
        vs_parallel.push_back(p / gbps);
      } else {
        round_best = std::max(round_best, gbps);
        if (variant == out.reference) vs_reference.push_back(p / gbps);
      }
    }
    if (round_best > 0) vs_best_variant.push_back(p / round_best);
  }
  if (!loads.empty()) {
    out.pinload_best = *std::max_element(loads.begin(), loads.end());
    out.pinload_median = *median(loads);
  }
  out.same_round_reference = median(vs_reference);
  out.same_round_best_variant = median(vs_best_variant);
  out.same_round_parallel = median(vs_parallel);
  return out;
}

}  // namespace pinload::bench
