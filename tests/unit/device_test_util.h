// Test support for the device and copy-engine suites: a gate that holds the
// sim device's copies, the process's thread count, and byte patterns.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "pinload/device.h"
#include "test_files.h"

namespace pinload::testing {

// Holds sim copies: install gate.hook() as SimDeviceOptions::before_copy; each
// copy then waits for a permit (allow) or for open(). Declare the gate before
// the device, and an OpenOnExit after the last stream or engine, so that an
// early test exit never leaves a copy waiting while a destructor drains it.
class Gate {
 public:
  std::function<void(std::size_t)> hook() {
    return [this](std::size_t bytes) { pass(bytes); };
  }
  void pass(std::size_t bytes) {
    std::unique_lock lock(mu_);
    ++waiting_;
    seen_.push_back(bytes);
    cv_.notify_all();
    // The backstop: a forgotten gate opens by itself rather than hang the suite.
    cv_.wait_for(lock, std::chrono::seconds(60), [&] { return open_ || permits_ > 0; });
    if (!open_ && permits_ > 0) --permits_;
    --waiting_;
    ++passed_;
    cv_.notify_all();
  }
  void allow(int n) {
    std::lock_guard lock(mu_);
    permits_ += n;
    cv_.notify_all();
  }
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  // Waits until `n` copies are held at the gate; false after 10 s.
  bool wait_waiting(int n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return waiting_ >= n; });
  }
  // Waits until `n` copies have passed; false after 10 s.
  bool wait_passed(int n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return passed_ >= n; });
  }
  int passed() {
    std::lock_guard lock(mu_);
    return passed_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int permits_ = 0;
  int waiting_ = 0;
  int passed_ = 0;
  bool open_ = false;
  std::vector<std::size_t> seen_;
};

class OpenOnExit {
 public:
  explicit OpenOnExit(Gate& gate) : gate_(gate) {}
  ~OpenOnExit() { gate_.open(); }
  OpenOnExit(const OpenOnExit&) = delete;
  OpenOnExit& operator=(const OpenOnExit&) = delete;

 private:
  Gate& gate_;
};

// A byte pattern that differs per (seed, position), and never repeats with
// a short period, so a shifted or stale copy shows.
inline std::byte pattern_byte(std::uint64_t seed, std::size_t i) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + i;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<std::byte>(x & 0xFF);
}
inline void fill_pattern(std::byte* data, std::size_t bytes, std::uint64_t seed) {
  for (std::size_t i = 0; i < bytes; ++i) data[i] = pattern_byte(seed, i);
}
inline std::vector<std::byte> make_pattern(std::size_t bytes, std::uint64_t seed) {
  std::vector<std::byte> v(bytes);
  fill_pattern(v.data(), bytes, seed);
  return v;
}

// The device specs a contract suite runs on; "cuda:0" skips without CUDA.
inline const char* const kDeviceSpecs[] = {"sim", "cuda:0"};

// "sim" / "cuda" as a parameterized test's name.
inline std::string device_param_name(const ::testing::TestParamInfo<const char*>& param_info) {
  return std::string(param_info.param).substr(0, 4);
}

// Opens `spec`, or returns null with the reason to skip in *why.
inline std::unique_ptr<Device> open_or_skip_reason(const std::string& spec, std::string* why) {
  if (spec.rfind("cuda", 0) == 0) {
    std::string reason;
    if (!cuda_available(&reason)) {
      *why = "no CUDA device: " + reason;
      return nullptr;
    }
  }
  return open_device(spec);
}

// The device bytes buffer[offset, +bytes), copied back to the host.
inline std::vector<std::byte> read_back(Device& device, const DeviceBuffer& buffer, std::size_t offset, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  device.copy_to_host(out.data(), buffer, offset, bytes);
  return out;
}

}  // namespace pinload::testing
