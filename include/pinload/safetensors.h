// pinload/safetensors.h: a strict parser for safetensors headers.
//
// Byte layout of a .safetensors file (all integers little-endian):
//
//   offset 0        8                     8+N                          file_size
//          +--------+---------------------+----------------------------+
//          |   N    |  JSON header (N B)  |  data section              |
//          +--------+---------------------+----------------------------+
//
//   N      u64, 1 <= N <= 100,000,000, and 8 + N <= file_size.
//   JSON   UTF-8, one object, optionally followed by JSON whitespace (writers
//          pad with spaces to a multiple of 8). Keys are unique at every level.
//          "__metadata__": null, or an object of string -> string.
//          Any other key names a tensor: an object with
//            "dtype":        one of dtype.h's names,
//            "shape":        array of non-negative integers (empty: a scalar),
//            "data_offsets": [begin, end], relative to the data section.
//          Other members of a tensor object are ignored, as the reference does.
//   data   Tensors sorted by begin tile the data section exactly: the first
//          starts at 0, each begins where the previous ends, and the last ends
//          at file_size - 8 - N. Zero-size tensors may share an offset.
//          end - begin == prod(shape) * bits(dtype) / 8, and the bit count
//          must be a whole number of bytes. Offsets need not be aligned.
//
// Every number is checked before it is used; nothing is allocated on the word
// of the file before the sizes are checked against the file's real size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pinload/dtype.h"

namespace pinload {

inline constexpr std::uint64_t kHeaderPrefixSize = 8;
inline constexpr std::uint64_t kMaxHeaderSize = 100'000'000;  // as the reference loader
inline constexpr int kMaxJsonDepth = 16;  // a valid header nests 3 deep

struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0;  // offsets relative to the data section
  std::uint64_t end = 0;

  std::uint64_t nbytes() const noexcept { return end - begin; }
  std::uint64_t numel() const noexcept;
};

struct Header {
  std::uint64_t json_size = 0;  // N
  std::uint64_t file_size = 0;
  std::vector<TensorInfo> tensors;  // file order: sorted by (begin, end, name)
  bool has_metadata = false;        // "__metadata__" present and not null
  std::vector<std::pair<std::string, std::string>> metadata;  // sorted by key

  std::uint64_t data_offset() const noexcept { return kHeaderPrefixSize + json_size; }
  std::uint64_t data_size() const noexcept { return file_size - data_offset(); }
  // The tensor named `name`, or nullptr. O(log n).
  const TensorInfo* find(std::string_view name) const noexcept;

  std::vector<std::uint32_t> by_name;  // indices into tensors, sorted by name
};

// Validates the 8-byte prefix of a file of `file_size` bytes and returns N.
// Throws InvalidFileError naming `file`.
std::uint64_t parse_header_prefix(std::span<const std::byte> prefix, std::uint64_t file_size,
                                  const std::string& file);

// Parses the JSON header (the N bytes after the prefix) of a file of
// `file_size` bytes and checks every rule above. Throws InvalidFileError naming
// `file`, and where one applies the tensor and its absolute byte range.
Header parse_header(std::span<const std::byte> json, std::uint64_t file_size,
                    const std::string& file);

// parse_header_prefix + parse_header over a whole file held in memory.
Header parse_safetensors(std::span<const std::byte> file_bytes, const std::string& file);

}  // namespace pinload
