// Internal: strict JSON parsing shared by the header and index readers.
//
// One pass of nlohmann's SAX parser (its public sax_parse API) checks what
// JSON leaves open and the formats forbid: duplicate keys in any object, NUL
// bytes, nesting deeper than kMaxJsonDepth. It hands the events on to a
// StrictJsonHandler, which builds what it needs: the index reader a DOM, the
// header reader its TensorInfo directly (no DOM: Note [Header parsing] in
// safetensors.cc). The parser is iterative; time is linear in the input.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace pinload {

using Json = nlohmann::json;

// The events of one document, in order, after the checks above. A handler
// may throw pinload::Error to stop the parse.
class StrictJsonHandler {
 public:
  virtual ~StrictJsonHandler() = default;
  virtual void null() = 0;
  virtual void boolean(bool value) = 0;
  virtual void number_integer(std::int64_t value) = 0;    // negative integers
  virtual void number_unsigned(std::uint64_t value) = 0;  // non-negative integers
  virtual void number_float(double value, const std::string& text) = 0;  // any other number, as written
  virtual void string(std::string& value) = 0;  // the handler may move from `value`
  virtual void start_object() = 0;
  virtual void key(std::string& key) = 0;  // unique in its object
  virtual void end_object() = 0;
  virtual void start_array() = 0;
  virtual void end_array() = 0;
  // True if the handler checks the root object's keys for duplicates itself
  // (the header reader does it from its sorted names, which costs nothing).
  virtual bool checks_root_duplicates() const { return false; }
};

// Parses [first, last) as one JSON document into `handler`. Throws
// InvalidFileError (never a nlohmann exception) naming `file`; byte positions
// are reported as `base_offset` + position. `what` names the document ("JSON
// header"). With `root_keys_are_tensors`, the root's members other than
// "__metadata__" are tensors, and a duplicate key or deep nesting inside one
// names it.
void parse_strict_json(const char* first, const char* last, const std::string& file, std::uint64_t base_offset,
                       const char* what, StrictJsonHandler& handler, bool root_keys_are_tensors = false);

// The same, building and returning the DOM.
Json parse_strict_json(const char* first, const char* last, const std::string& file, std::uint64_t base_offset,
                       const char* what, bool root_keys_are_tensors = false);

}  // namespace pinload
