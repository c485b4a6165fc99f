#include "format/json_strict.h"

#include <cstring>
#include <unordered_set>
#include <vector>

#include "pinload/error.h"
#include "pinload/safetensors.h"

namespace pinload {
namespace {

// A SAX consumer that builds the DOM with nlohmann's own (linear) builder and
// checks, on the way, what the DOM would lose: duplicate keys (it overwrites
// them) and nesting depth. The parser is iterative, so depth cannot overflow
// the stack; it is bounded anyway. (nlohmann's callback parser would do the
// same checks but is quadratic in the number of members of an object.)
class StrictSax {
 public:
  using Dom = nlohmann::detail::json_sax_dom_parser<Json>;

  StrictSax(Json& root, const std::string& file, const char* what, bool root_keys_are_tensors)
      : dom_(root, /*allow_exceptions=*/true), file_(file), what_(what), root_keys_are_tensors_(root_keys_are_tensors) {}

  bool null() { return dom_.null(); }
  bool boolean(bool v) { return dom_.boolean(v); }
  bool number_integer(Json::number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(Json::number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(Json::number_float_t v, const Json::string_t& s) { return dom_.number_float(v, s); }
  bool string(Json::string_t& v) { return dom_.string(v); }
  bool binary(Json::binary_t& v) { return dom_.binary(v); }

  bool start_object(std::size_t n) {
    enter();
    scopes_.back().is_object = true;
    return dom_.start_object(n);
  }
  bool end_object() {
    scopes_.pop_back();
    return dom_.end_object();
  }
  bool start_array(std::size_t n) {
    enter();
    return dom_.start_array(n);
  }
  bool end_array() {
    scopes_.pop_back();
    return dom_.end_array();
  }
  bool key(Json::string_t& key) {
    const bool top = scopes_.size() == 1;
    if (top) root_key_ = key;
    if (!scopes_.back().keys.insert(key).second) {
      throw InvalidFileError("duplicate key '" + key + "' in " + what_ +
                                 (top ? std::string{} : " (in '" + root_key_ + "')"),
                             ErrorContext{file_, tensor()});
    }
    return dom_.key(key);
  }
  template <class Exception>
  bool parse_error(std::size_t position, const std::string& last_token, const Exception& ex) {
    return dom_.parse_error(position, last_token, ex);  // throws ex
  }

 private:
  struct Scope {
    bool is_object = false;
    std::unordered_set<std::string> keys;
  };

  void enter() {
    if (scopes_.size() >= static_cast<std::size_t>(kMaxJsonDepth)) {
      throw InvalidFileError(std::string(what_) + " nests deeper than " + std::to_string(kMaxJsonDepth) + " levels",
                             ErrorContext{file_, tensor()});
    }
    scopes_.emplace_back();
  }
  // The tensor whose entry is being parsed, or "".
  std::string tensor() const {
    if (!root_keys_are_tensors_ || scopes_.empty() || root_key_ == "__metadata__") return {};
    return root_key_;
  }

  Dom dom_;
  const std::string& file_;
  const char* what_;
  bool root_keys_are_tensors_;
  std::string root_key_;  // the root member being parsed
  std::vector<Scope> scopes_;
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
    Json root;
    StrictSax sax(root, file, what, root_keys_are_tensors);
    Json::sax_parse(first, last, &sax, nlohmann::detail::input_format_t::json, /*strict=*/true,
                    /*ignore_comments=*/false);
    return root;
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
