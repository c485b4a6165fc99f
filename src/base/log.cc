#include "base/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>

namespace pinload::log {

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    auto l = std::make_shared<spdlog::logger>("pinload", sink);
    l->set_pattern("[pinload %l] %v");
    l->set_level(spdlog::level::warn);
    if (const char* env = std::getenv("PINLOAD_LOG_LEVEL"); env != nullptr && *env != '\0') {
      l->set_level(spdlog::level::from_str(env));
    }
    return l;
  }();
  return *instance;
}

}  // namespace pinload::log
