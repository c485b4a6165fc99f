// Internal: strict JSON parsing shared by the header and index readers.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace pinload {

using Json = nlohmann::json;

// Parses [first, last) as one JSON document, rejecting duplicate keys in any
// object and nesting deeper than kMaxJsonDepth, without recursion. Throws
// InvalidFileError naming `file`; byte positions are reported as
// `base_offset` + position. `what` names the document ("JSON header").
Json parse_strict_json(const char* first, const char* last, const std::string& file,
                       std::uint64_t base_offset, const char* what);

}  // namespace pinload
