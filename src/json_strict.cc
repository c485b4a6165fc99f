#include "json_strict.h"

#include <unordered_set>
#include <vector>

#include "pinload/error.h"
#include "pinload/safetensors.h"

namespace pinload {
namespace {

// Sees every event while nlohmann builds the DOM. The DOM parser is iterative,
// so depth cannot overflow the stack; this bounds it anyway, and catches the
// duplicate keys that the DOM would silently overwrite.
class StrictGuard {
 public:
  StrictGuard(const std::string& file, const char* what) : file_(file), what_(what) {}

  bool operator()(int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (scopes_.size() >= static_cast<std::size_t>(kMaxJsonDepth)) {
          throw InvalidFileError(std::string(what_) + " nests deeper than " +
                                     std::to_string(kMaxJsonDepth) + " levels",
                                 ErrorContext{file_});
        }
        scopes_.emplace_back();
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        scopes_.pop_back();
        break;
      case Json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!scopes_.back().insert(key).second) {
          const bool top = scopes_.size() == 1;
          throw InvalidFileError("duplicate key '" + key + "' in " + what_ + (top ? "" : " (nested object)"),
                                 ErrorContext{file_, top ? key : std::string{}});
        }
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
    return true;
  }

 private:
  const std::string& file_;
  const char* what_;
  std::vector<std::unordered_set<std::string>> scopes_;
};

}  // namespace

Json parse_strict_json(const char* first, const char* last, const std::string& file,
                       std::uint64_t base_offset, const char* what) {
  try {
    StrictGuard guard(file, what);
    return Json::parse(first, last, std::ref(guard), /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const Json::parse_error& e) {
    std::string message = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " tag.
    if (auto pos = message.find("] "); pos != std::string::npos) message = message.substr(pos + 2);
    const std::uint64_t at = base_offset + (e.byte > 0 ? e.byte - 1 : 0);
    throw InvalidFileError(std::string(what) + " is not valid UTF-8 JSON: " + message,
                           ErrorContext{file, {}, at});
  }
}

}  // namespace pinload
