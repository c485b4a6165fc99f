#include "pinload/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include "format/json_strict.h"
#include "pinload/error.h"

namespace pinload {
namespace {

[[noreturn]] void invalid(const std::string& file, std::string message, std::string tensor = {},
                          std::optional<std::uint64_t> begin = {},
                          std::optional<std::uint64_t> end = {}) {
  throw InvalidFileError(std::move(message), ErrorContext{file, std::move(tensor), begin, end});
}

// a + b, or UINT64_MAX where that overflows: absolute offsets for messages.
std::uint64_t sat_add(std::uint64_t a, std::uint64_t b) {
  return b > std::numeric_limits<std::uint64_t>::max() - a ? std::numeric_limits<std::uint64_t>::max() : a + b;
}

std::uint64_t read_u64_le(const std::byte* p) {
  std::uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<std::uint8_t>(p[i]);
  return value;
}

std::uint64_t as_u64(const Json& value, const std::string& file, const std::string& tensor,
                     const char* field) {
  if (!value.is_number_unsigned()) {
    invalid(file, std::string("'") + field + "' must hold non-negative integers, got " + value.dump(),
            tensor);
  }
  return value.get<std::uint64_t>();
}

TensorInfo parse_tensor(const std::string& name, const Json& entry, const std::string& file) {
  if (!entry.is_object()) invalid(file, "tensor entry must be a JSON object", name);
  auto field = [&](const char* key) -> const Json& {
    auto it = entry.find(key);
    if (it == entry.end()) invalid(file, std::string("missing field '") + key + "'", name);
    return *it;
  };
  TensorInfo info;
  info.name = name;

  const Json& dtype = field("dtype");
  if (!dtype.is_string()) invalid(file, "'dtype' must be a string", name);
  auto parsed = dtype_from_name(dtype.get_ref<const std::string&>());
  if (!parsed) invalid(file, "unknown dtype '" + dtype.get<std::string>() + "'", name);
  info.dtype = *parsed;

  const Json& shape = field("shape");
  if (!shape.is_array()) invalid(file, "'shape' must be an array", name);
  info.shape.reserve(shape.size());
  for (const Json& dim : shape) info.shape.push_back(as_u64(dim, file, name, "shape"));

  const Json& offsets = field("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2) {
    invalid(file, "'data_offsets' must be an array of exactly 2 integers", name);
  }
  info.begin = as_u64(offsets[0], file, name, "data_offsets");
  info.end = as_u64(offsets[1], file, name, "data_offsets");
  return info;
}

void check_tensor_size(const TensorInfo& t, std::uint64_t data_offset, const std::string& file) {
  constexpr auto kMax = std::numeric_limits<std::uint64_t>::max();
  auto fail = [&](std::string message) {
    invalid(file, std::move(message), t.name, sat_add(data_offset, t.begin), sat_add(data_offset, t.end));
  };
  if (t.end < t.begin) {
    fail("data_offsets end " + std::to_string(t.end) + " is before begin " + std::to_string(t.begin));
  }
  std::uint64_t numel = 1;
  for (std::uint64_t dim : t.shape) {
    if (dim != 0 && numel > kMax / dim) fail("shape element count overflows 64 bits");
    numel *= dim;
  }
  const unsigned bits = dtype_bits(t.dtype);
  if (numel > kMax / bits) fail("shape size in bits overflows 64 bits");
  const std::uint64_t total_bits = numel * bits;
  if (total_bits % 8 != 0) {
    fail(std::string(dtype_name(t.dtype)) + " tensor of " + std::to_string(numel) +
         " elements does not end on a whole byte");
  }
  if (total_bits / 8 != t.end - t.begin) {
    fail("shape and dtype need " + std::to_string(total_bits / 8) + " bytes but data_offsets span " +
         std::to_string(t.end - t.begin));
  }
}

}  // namespace

std::uint64_t TensorInfo::numel() const noexcept {
  std::uint64_t n = 1;
  for (std::uint64_t d : shape) n *= d;
  return n;
}

const TensorInfo* Header::find(std::string_view name) const noexcept {
  auto it = std::lower_bound(by_name.begin(), by_name.end(), name,
                             [&](std::uint32_t i, std::string_view n) { return tensors[i].name < n; });
  if (it == by_name.end() || tensors[*it].name != name) return nullptr;
  return &tensors[*it];
}

std::uint64_t parse_header_prefix(std::span<const std::byte> prefix, std::uint64_t file_size,
                                  const std::string& file) {
  if (file_size < kHeaderPrefixSize || prefix.size() < kHeaderPrefixSize) {
    invalid(file, "file is " + std::to_string(file_size) +
                      " bytes, too short for the 8-byte header length");
  }
  const std::uint64_t n = read_u64_le(prefix.data());
  if (n == 0) invalid(file, "header length is 0; the JSON header cannot be empty", {}, 0, 8);
  if (n > kMaxHeaderSize) {
    invalid(file, "header length " + std::to_string(n) + " exceeds the limit of " +
                      std::to_string(kMaxHeaderSize) + " bytes", {}, 0, 8);
  }
  if (n > file_size - kHeaderPrefixSize) {
    invalid(file, "header length " + std::to_string(n) + " runs past the end of the " +
                      std::to_string(file_size) + "-byte file", {}, 0, 8);
  }
  return n;
}

Header parse_header(std::span<const std::byte> json, std::uint64_t file_size,
                    const std::string& file) {
  Header header;
  header.json_size = json.size();
  header.file_size = file_size;
  if (json.size() > kMaxHeaderSize || file_size < kHeaderPrefixSize + json.size()) {
    invalid(file, "header of " + std::to_string(json.size()) + " bytes does not fit the file");
  }
  const std::uint64_t data_offset = header.data_offset();
  const auto* first = reinterpret_cast<const char*>(json.data());
  const auto* last = first + json.size();
  if (json.size() >= 3 && std::memcmp(first, "\xEF\xBB\xBF", 3) == 0) {
    invalid(file, "JSON header starts with a byte-order mark", {}, 8, 11);
  }

  Json root = parse_strict_json(first, last, file, kHeaderPrefixSize, "JSON header",
                                /*root_keys_are_tensors=*/true);
  if (!root.is_object()) invalid(file, "JSON header must be an object, got " + std::string(root.type_name()));

  header.tensors.reserve(root.size());
  for (auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (value.is_null()) continue;
      if (!value.is_object()) invalid(file, "'__metadata__' must be an object of strings");
      header.has_metadata = true;
      for (auto& [mkey, mvalue] : value.items()) {
        if (!mvalue.is_string()) {
          invalid(file, "'__metadata__' value of '" + mkey + "' must be a string, got " +
                            std::string(mvalue.type_name()));
        }
        header.metadata.emplace_back(mkey, mvalue.get<std::string>());
      }
      continue;
    }
    header.tensors.push_back(parse_tensor(key, value, file));
  }
  root = Json();  // free the DOM before the checks below

  for (const TensorInfo& t : header.tensors) check_tensor_size(t, data_offset, file);
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });

  const std::uint64_t data_size = file_size - data_offset;
  std::uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : header.tensors) {
    if (t.end > data_size) {
      invalid(file, "tensor ends past the end of the file (data section is " +
                        std::to_string(data_size) + " bytes)",
              t.name, sat_add(data_offset, t.begin), sat_add(data_offset, t.end));
    }
    if (t.begin < covered) {
      invalid(file, "tensor overlaps '" + previous->name + "', which ends at data offset " +
                        std::to_string(covered),
              t.name, data_offset + t.begin, data_offset + t.end);
    }
    if (t.begin > covered) {
      invalid(file, "hole: data bytes " + std::to_string(covered) + ".." + std::to_string(t.begin) +
                        " before this tensor belong to no tensor",
              t.name, data_offset + t.begin, data_offset + t.end);
    }
    covered = t.end;
    previous = &t;
  }
  if (covered != data_size) {
    invalid(file, "tensors cover " + std::to_string(covered) + " data bytes but the data section has " +
                      std::to_string(data_size) + " (trailing bytes after the last tensor)",
            previous ? previous->name : std::string{}, data_offset + covered, file_size);
  }

  std::sort(header.metadata.begin(), header.metadata.end());
  header.by_name.resize(header.tensors.size());
  for (std::uint32_t i = 0; i < header.by_name.size(); ++i) header.by_name[i] = i;
  std::sort(header.by_name.begin(), header.by_name.end(),
            [&](std::uint32_t a, std::uint32_t b) { return header.tensors[a].name < header.tensors[b].name; });
  return header;
}

Header parse_safetensors(std::span<const std::byte> file_bytes, const std::string& file) {
  const std::uint64_t n = parse_header_prefix(file_bytes, file_bytes.size(), file);
  return parse_header(file_bytes.subspan(kHeaderPrefixSize, n), file_bytes.size(), file);
}

}  // namespace pinload
