#include "format/json_strict.h"

#include <cstring>
#include <memory>
#include <unordered_set>
#include <vector>

#include "pinload/error.h"
#include "pinload/safetensors.h"

namespace pinload {
namespace {

// The keys seen in one object: a short list searched in order, grown into a
// hash set once the object has many members (a header's root has one per
// tensor), so that the check stays linear in the input.
class KeySet {
 public:
  // False if `key` was seen already.
  bool insert(const std::string& key) {
    if (set_) return set_->insert(key).second;
    for (const std::string& k : few_) {
      if (k == key) return false;
    }
    few_.push_back(key);
    if (few_.size() > kFewKeys) {
      set_ = std::make_unique<std::unordered_set<std::string>>(std::make_move_iterator(few_.begin()),
                                                              std::make_move_iterator(few_.end()));
      few_.clear();
    }
    return true;
  }

 private:
  static constexpr std::size_t kFewKeys = 16;
  std::vector<std::string> few_;
  std::unique_ptr<std::unordered_set<std::string>> set_;
};

// nlohmann's SAX interface (json_sax<Json>, public) over a StrictJsonHandler,
// with the checks the DOM and the handler cannot see.
class StrictSax {
 public:
  StrictSax(StrictJsonHandler& handler, const std::string& file, const char* what, bool root_keys_are_tensors)
      : handler_(handler),
        handler_checks_root_(handler.checks_root_duplicates()),
        file_(file),
        what_(what),
        root_keys_are_tensors_(root_keys_are_tensors) {}

  bool null() { return handler_.null(), true; }
  bool boolean(bool v) { return handler_.boolean(v), true; }
  bool number_integer(Json::number_integer_t v) { return handler_.number_integer(v), true; }
  bool number_unsigned(Json::number_unsigned_t v) { return handler_.number_unsigned(v), true; }
  bool number_float(Json::number_float_t v, const Json::string_t& s) { return handler_.number_float(v, s), true; }
  bool string(Json::string_t& v) { return handler_.string(v), true; }
  bool binary(Json::binary_t&) { return true; }  // not produced by the JSON parser

  bool start_object(std::size_t) {
    enter();
    handler_.start_object();
    return true;
  }
  bool end_object() {
    scopes_.pop_back();
    handler_.end_object();
    return true;
  }
  bool start_array(std::size_t) {
    enter();
    handler_.start_array();
    return true;
  }
  bool end_array() {
    scopes_.pop_back();
    handler_.end_array();
    return true;
  }
  bool key(Json::string_t& key) {
    const bool top = scopes_.size() == 1;
    if (top) root_key_.assign(key);
    if (!(top && handler_checks_root_) && !scopes_.back().insert(key)) {
      throw InvalidFileError("duplicate key '" + key + "' in " + what_ +
                                 (top ? std::string{} : " (in '" + root_key_ + "')"),
                             ErrorContext{file_, tensor()});
    }
    handler_.key(key);
    return true;
  }
  template <class Exception>
  bool parse_error(std::size_t, const std::string&, const Exception& ex) {
    throw ex;
  }

 private:
  void enter() {
    if (scopes_.size() >= static_cast<std::size_t>(kMaxJsonDepth)) {
      throw InvalidFileError(std::string(what_) + " nests deeper than " + std::to_string(kMaxJsonDepth) + " levels",
                             ErrorContext{file_, tensor()});
    }
    scopes_.emplace_back();  // arrays get an unused set: one vector, no allocation
  }
  // The tensor whose entry is being parsed, or "".
  std::string tensor() const {
    if (!root_keys_are_tensors_ || scopes_.empty() || root_key_ == "__metadata__") return {};
    return root_key_;
  }

  StrictJsonHandler& handler_;
  bool handler_checks_root_;
  const std::string& file_;
  const char* what_;
  bool root_keys_are_tensors_;
  std::string root_key_;  // the root member being parsed
  std::vector<KeySet> scopes_;
};

// Builds the DOM, as nlohmann's own parser would, through its public API.
class DomBuilder final : public StrictJsonHandler {
 public:
  explicit DomBuilder(Json& root) : root_(root) {}

  void null() override { put(Json(nullptr)); }
  void boolean(bool v) override { put(Json(v)); }
  void number_integer(std::int64_t v) override { put(Json(v)); }
  void number_unsigned(std::uint64_t v) override { put(Json(v)); }
  void number_float(double v, const std::string&) override { put(Json(v)); }
  void string(std::string& v) override { put(Json(std::move(v))); }
  void start_object() override { stack_.push_back(put(Json::object())); }
  void key(std::string& key) override { key_ = std::move(key); }
  void end_object() override { stack_.pop_back(); }
  void start_array() override { stack_.push_back(put(Json::array())); }
  void end_array() override { stack_.pop_back(); }

 private:
  // Places `value` where the document is, and returns it there.
  Json* put(Json value) {
    if (stack_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Json& parent = *stack_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(value));
      return &parent.back();
    }
    Json& slot = parent[key_];
    slot = std::move(value);
    return &slot;
  }

  Json& root_;
  std::vector<Json*> stack_;  // the open objects and arrays
  std::string key_;           // the key of the next member of the innermost object
};

}  // namespace

void parse_strict_json(const char* first, const char* last, const std::string& file, std::uint64_t base_offset,
                       const char* what, StrictJsonHandler& handler, bool root_keys_are_tensors) {
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
    StrictSax sax(handler, file, what, root_keys_are_tensors);
    Json::sax_parse(first, last, &sax, Json::input_format_t::json, /*strict=*/true, /*ignore_comments=*/false);
  } catch (const Json::parse_error& e) {
    const std::uint64_t at = base_offset + (e.byte > 0 ? e.byte - 1 : 0);
    throw InvalidFileError(std::string(what) + " is not valid UTF-8 JSON: " + untagged(e.what()),
                           ErrorContext{file, {}, at});
  } catch (const Json::exception& e) {
    // out_of_range 406: a number too large for a double ("1e999").
    throw InvalidFileError(std::string(what) + " is not valid JSON: " + untagged(e.what()), ErrorContext{file});
  }
}

Json parse_strict_json(const char* first, const char* last, const std::string& file, std::uint64_t base_offset,
                       const char* what, bool root_keys_are_tensors) {
  Json root;
  DomBuilder builder(root);
  parse_strict_json(first, last, file, base_offset, what, builder, root_keys_are_tensors);
  return root;
}

}  // namespace pinload
