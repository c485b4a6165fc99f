// Internal: strict JSON parsing shared by the header and index readers.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace pinload {

using Json = nlohmann::json;

// Parses [first, last) as one JSON document, rejecting duplicate keys in any
// object, NUL bytes and nesting deeper than kMaxJsonDepth, without recursion.
// Throws InvalidFileError (never a nlohmann exception) naming `file`; byte
// positions are reported as `base_offset` + position. `what` names the
// document ("JSON header"). With `root_keys_are_tensors`, the root's members
// other than "__metadata__" are tensors, and an error inside one names it.
Json parse_strict_json(const char* first, const char* last, const std::string& file, std::uint64_t base_offset,
                       const char* what, bool root_keys_are_tensors = false);

}  // namespace pinload
