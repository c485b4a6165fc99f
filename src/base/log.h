// Internal: pinload's logger, "pinload" in spdlog's registry. Writes to
// stderr; default level warn. Note [Log level].
#pragma once

#include <spdlog/spdlog.h>

#include <string>
#include <vector>

namespace pinload::log {

spdlog::logger& logger();

// Note [Log level]
// PINLOAD_LOG_LEVEL sets the level, in spdlog's own syntax, parsed by spdlog's
// environment loader (spdlog/cfg: the parser behind load_env_levels, which in
// the Debian spdlog 1.10 reads only SPDLOG_LEVEL): a level name in any case
// (trace, debug, info, warn or warning, error, critical, off), or
// "logger=level" pairs separated by commas. A bare level applies to pinload's
// logger only, never to other spdlog loggers of the process. A value spdlog
// does not know leaves the default and is reported once as a warning,
// instead of turning logging off.
// Applies `value` (PINLOAD_LOG_LEVEL's syntax) to the logger; returns the
// names spdlog did not recognise as levels (empty: all applied). For tests.
std::vector<std::string> apply_level_spec(const std::string& value);

// "Cannot allocate memory (errno 12)": errno `err` as text, thread-safe.
std::string errno_text(int err);

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
