#include "base/log.h"

#include <spdlog/cfg/helpers.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

namespace pinload::log {

namespace {

constexpr const char* kLoggerName = "pinload";
constexpr const char* kLevelVariable = "PINLOAD_LOG_LEVEL";

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

std::string trim(const std::string& text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string::npos) return {};
  return text.substr(first, text.find_last_not_of(" \t") - first + 1);
}

bool is_level(const std::string& name) {
  const std::string l = lower(name);
  return spdlog::level::from_str(l) != spdlog::level::off || l == "off";
}

spdlog::logger& registered_logger();

}  // namespace

std::vector<std::string> apply_level_spec(const std::string& value) {
  // A bare level names pinload's logger: "debug" becomes "pinload=debug", so
  // that spdlog's loader leaves the process's other loggers alone.
  std::vector<std::string> unknown;
  std::string spec;
  std::stringstream items(value);
  for (std::string item; std::getline(items, item, ',');) {
    item = trim(item);
    if (item.empty()) continue;
    const auto eq = item.find('=');
    const std::string level = trim(eq == std::string::npos ? item : item.substr(eq + 1));
    if (!is_level(level)) {
      unknown.push_back(level);
      continue;
    }
    spec += (spec.empty() ? "" : ",") + (eq == std::string::npos ? std::string(kLoggerName) + "=" + level : item);
  }
  registered_logger();  // registered before the loader runs, so that it is reached
  if (!spec.empty()) spdlog::cfg::helpers::load_levels(spec);
  return unknown;
}

namespace {
spdlog::logger& registered_logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    // Another copy of pinload in this process (the Python module next to
    // libpinload_torch, say) may have registered it already.
    if (std::shared_ptr<spdlog::logger> existing = spdlog::get(kLoggerName)) return existing;
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    auto l = std::make_shared<spdlog::logger>(kLoggerName, sink);
    l->set_pattern("[pinload %l] %v");
    l->set_level(spdlog::level::warn);
    try {
      spdlog::register_logger(l);
    } catch (const spdlog::spdlog_ex&) {
      if (std::shared_ptr<spdlog::logger> existing = spdlog::get(kLoggerName)) return existing;
    }
    return l;
  }();
  return *instance;
}
}  // namespace

spdlog::logger& logger() {
  static spdlog::logger& instance = [] () -> spdlog::logger& {
    spdlog::logger& l = registered_logger();
    const char* env = std::getenv(kLevelVariable);
    if (env == nullptr || *env == '\0') return l;
    for (const std::string& name : apply_level_spec(env)) {
      l.warn("{}={}: '{}' is not a log level (trace, debug, info, warn, error, critical, off); "
                     "logging at {}", kLevelVariable, env, name, spdlog::level::to_string_view(l.level()));
    }
    return l;
  }();
  return instance;
}

std::string errno_text(int err) {
  char buffer[256];
  // GNU strerror_r: returns the message, in `buffer` or a static string.
  const char* text = strerror_r(err, buffer, sizeof buffer);
  return std::string(text) + " (errno " + std::to_string(err) + ")";
}

}  // namespace pinload::log
