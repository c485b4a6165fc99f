#include "json_strict.h"

#include <cstring>
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
  StrictGuard(const std::string& file, const char* what, bool root_keys_are_tensors)
      : file_(file), what_(what), root_keys_are_tensors_(root_keys_are_tensors) {}

  bool operator()(int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (scopes_.size() >= static_cast<std::size_t>(kMaxJsonDepth)) {
          throw InvalidFileError(std::string(what_) + " nests deeper than " +
                                     std::to_string(kMaxJsonDepth) + " levels",
                                 ErrorContext{file_, tensor()});
        }
        scopes_.emplace_back();
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        scopes_.pop_back();
        break;
      case Json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        const bool top = scopes_.size() == 1;
        if (top) root_key_ = key;
        if (!scopes_.back().insert(key).second) {
          throw InvalidFileError("duplicate key '" + key + "' in " + what_ +
                                     (top ? std::string{} : " (in '" + root_key_ + "')"),
                                 ErrorContext{file_, tensor()});
        }
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
    return true;
  }

 private:
  // The tensor whose entry is being parsed, or "".
  std::string tensor() const {
    if (!root_keys_are_tensors_ || scopes_.empty() || root_key_ == "__metadata__") return {};
    return root_key_;
  }

  const std::string& file_;
  const char* what_;
  bool root_keys_are_tensors_;
  std::string root_key_;  // the root member being parsed
  std::vector<std::unordered_set<std::string>> scopes_;
};

}  // namespace

Json parse_strict_json(const char* first, const char* last, const std::string& file,
                       std::uint64_t base_offset, const char* what, bool root_keys_are_tensors) {
  // nlohmann stops at a NUL byte as if the input ended there, so it would
  // accept "{}\0<anything>". JSON has no place for a raw NUL: reject it here.
  if (const void* nul = std::memchr(first, '\0', static_cast<std::size_t>(last - first))) {
    const auto at = static_cast<std::uint64_t>(static_cast<const char*>(nul) - first);
    throw InvalidFileError(std::string(what) + " contains a NUL byte", ErrorContext{file, {}, base_offset + at});
  }
  // Drops nlohmann's "[json.exception.parse_error.101] " tag.
  auto untagged = [](std::string message) {
    if (auto pos = message.find("] "); pos != std::string::npos) message.erase(0, pos + 2);
    return message;
  };
  try {
    StrictGuard guard(file, what, root_keys_are_tensors);
    return Json::parse(first, last, std::ref(guard), /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const Json::parse_error& e) {
    const std::uint64_t at = base_offset + (e.byte > 0 ? e.byte - 1 : 0);
    throw InvalidFileError(std::string(what) + " is not valid UTF-8 JSON: " + untagged(e.what()),
                           ErrorContext{file, {}, at});
  } catch (const Json::exception& e) {
    // out_of_range 406: a number too large for a double ("1e999").
    throw InvalidFileError(std::string(what) + " is not valid JSON: " + untagged(e.what()), ErrorContext{file});
  }
}

}  // namespace pinload
