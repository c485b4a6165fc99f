// Internal: pinload's logger. Level from PINLOAD_LOG_LEVEL (trace, debug,
// info, warn, error, critical, off); default warn. Writes to stderr.
#pragma once

#include <spdlog/spdlog.h>

namespace pinload::log {

spdlog::logger& logger();

template <typename... Args>
void debug(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  logger().debug(fmt, std::forward<Args>(args)...);
}
template <typename... Args>
void info(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  logger().info(fmt, std::forward<Args>(args)...);
}
template <typename... Args>
void warn(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  logger().warn(fmt, std::forward<Args>(args)...);
}

}  // namespace pinload::log
