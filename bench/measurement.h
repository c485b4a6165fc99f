// bench/measurement.h: what pinload-bench's phases measure, as plain data.
//
// A Sample is one timed run; a Series the runs of one measurement. Both are
// values; nothing here touches the system (system_probe.h does) or pinload.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fio_compare.h"

namespace pinload::bench {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// One timed run. GB/s are 1e9 bytes per second; extra holds what the run
// reports besides its time (bytes, the pool's new reservations, the round).
struct Sample {
  double seconds = 0;
  double gbps = 0;
  json extra = json::object();
};

// The runs of one measurement, in the order they ran.
struct Series {
  std::vector<Sample> runs;
  bool empty() const { return runs.empty(); }
  double best() const {
    double b = 0;
    for (const auto& s : runs) b = std::max(b, s.gbps);
    return b;
  }
  double median() const {
    std::vector<double> v;
    for (const auto& s : runs) v.push_back(s.gbps);
    return pinload::bench::median(std::move(v)).value_or(0);
  }
  json to_json() const {
    json j;
    j["best_gbps"] = best();
    j["median_gbps"] = median();
    json runs_j = json::array();
    for (const auto& s : runs) {
      json r = {{"seconds", s.seconds}, {"gbps", s.gbps}};
      for (auto& [k, v] : s.extra.items()) r[k] = v;
      runs_j.push_back(r);
    }
    j["runs"] = runs_j;
    return j;
  }
};

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

inline double median_of(std::vector<double> v) { return pinload::bench::median(std::move(v)).value_or(0); }

inline std::string fmt(double v, int prec = 2) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

// "8M", "256K" or the byte count.
inline std::string size_name(std::uint64_t bytes) {
  if (bytes % (1u << 20) == 0) return std::to_string(bytes >> 20) + "M";
  if (bytes % (1u << 10) == 0) return std::to_string(bytes >> 10) + "K";
  return std::to_string(bytes);
}

// One progress line on stderr.
inline void log_sample(const std::string& what, const Sample& s) {
  std::cerr << "  " << what << ": " << fmt(s.seconds, 3) << " s, " << fmt(s.gbps) << " GB/s";
  for (const char* k : {"files_direct", "files_buffered", "new_os_reservations", "resident_before"}) {
    if (s.extra.contains(k)) std::cerr << ", " << k << "=" << s.extra[k].dump();
  }
  std::cerr << "\n";
}

// Runs every step once, starting with step `round % steps.size()` and wrapping
// around, so that over the rounds no step always goes first: a shared machine's
// weather drifts within a round too.
inline void in_rotated_order(std::size_t round, const std::vector<std::function<void()>>& steps) {
  for (std::size_t k = 0; k < steps.size(); ++k) steps[(k + round) % steps.size()]();
}

}  // namespace pinload::bench
