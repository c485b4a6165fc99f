// Tests of the strict safetensors header parser: one hand-made bad file per
// rule of safetensors.h, the corner cases the reference loader accepts, and
// seeded random round trips through tests/support's independent writer.
#include "pinload/safetensors.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "pinload/dtype.h"
#include "pinload/error.h"
#include "test_files.h"

namespace pinload {
namespace {

using testing::FileImage;
using testing::make_image;
using testing::raw_file;
using testing::raw_file_with_length;
using testing::TensorSpec;

constexpr char kFile[] = "dir/bad.safetensors";
// An expected offset that must be present, whatever its value.
constexpr std::uint64_t kAnyOffset = std::numeric_limits<std::uint64_t>::max();

std::span<const std::byte> as_bytes(const std::vector<std::uint8_t>& v) {
  return std::as_bytes(std::span(v));
}

Header parse(const std::vector<std::uint8_t>& bytes) {
  return parse_safetensors(as_bytes(bytes), kFile);
}

// `n` data bytes with a recognisable pattern.
std::vector<std::uint8_t> data_of(std::uint64_t n) {
  std::vector<std::uint8_t> data(n);
  for (std::uint64_t i = 0; i < n; ++i) data[i] = static_cast<std::uint8_t>(i * 7 + 1);
  return data;
}

// One tensor member of a header: "name":{"dtype":..,"shape":..,"data_offsets":..}.
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape, std::uint64_t begin,
                  std::uint64_t end) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
         std::to_string(begin) + "," + std::to_string(end) + "]}";
}

std::string object(const std::vector<std::string>& members) {
  std::string out = "{";
  for (std::size_t i = 0; i < members.size(); ++i) out += (i ? "," : "") + members[i];
  return out + "}";
}

// A well-formed one-tensor header around `tensor_json` (the value of "a").
std::string with_tensor_a(const std::string& tensor_json) {
  return "{\"a\":" + tensor_json + "}";
}

// ---------------------------------------------------------------------------
// Bad files: one row per rule.

struct BadFile {
  std::string name;
  std::vector<std::uint8_t> bytes;
  ErrorCode code = ErrorCode::kInvalidFile;
  std::string message;                      // a substring of Error::message()
  std::string tensor;                       // the expected context().tensor; "" = none
  std::optional<std::uint64_t> begin = {};  // absolute; kAnyOffset = present
  std::optional<std::uint64_t> end = {};
};

void PrintTo(const BadFile& row, std::ostream* os) {
  *os << row.name;
}

// A row whose file is `header` followed by `data_size` data bytes; `begin`
// and `end`, where given, are relative to the data section.
BadFile row(std::string name, const std::string& header, std::uint64_t data_size, std::string message,
            std::string tensor = {}, std::optional<std::uint64_t> begin = {}, std::optional<std::uint64_t> end = {}) {
  const std::uint64_t base = 8 + header.size();
  auto absolute = [&](std::optional<std::uint64_t> rel) -> std::optional<std::uint64_t> {
    if (!rel || *rel == kAnyOffset) return rel;
    return base + *rel;
  };
  return BadFile{std::move(name),
                 raw_file(header, data_of(data_size)),
                 ErrorCode::kInvalidFile,
                 std::move(message),
                 std::move(tensor),
                 absolute(begin),
                 absolute(end)};
}

// A row for a JSON syntax error: the error carries the byte where it was found.
BadFile syntax_row(std::string name, const std::string& header, std::string message, std::string tensor = {}) {
  return BadFile{std::move(name),    raw_file(header),  ErrorCode::kInvalidFile,
                 std::move(message), std::move(tensor), kAnyOffset};
}

std::string deep_arrays(int depth) {
  return std::string(depth, '[') + std::string(depth, ']');
}

std::string deep_objects(int depth) {
  std::string out;
  for (int i = 0; i < depth; ++i) out += "{\"k\":";
  out += "0";
  return out + std::string(depth, '}');
}

std::vector<BadFile> bad_files() {
  const std::string u8x2 = entry("a", "U8", "[2]", 0, 2);
  const std::uint64_t two_pow_32 = 1ull << 32;
  std::vector<BadFile> rows = {
      // The 8-byte prefix.
      {"file_shorter_than_8_bytes", {1, 0, 0}, ErrorCode::kInvalidFile, "too short for the 8-byte header length"},
      {"empty_file", {}, ErrorCode::kInvalidFile, "file is 0 bytes"},
      {"header_length_zero", raw_file_with_length(0, "", data_of(4)), ErrorCode::kInvalidFile, "header length is 0", "",
       0, 8},
      {"header_length_over_limit", raw_file_with_length(100'000'001, "{}"), ErrorCode::kInvalidFile,
       "exceeds the limit of 100000000 bytes", "", 0, 8},
      {"header_length_top_bit", raw_file_with_length(1ull << 63, "{}"), ErrorCode::kInvalidFile, "exceeds the limit",
       "", 0, 8},
      {"header_length_past_file_end", raw_file_with_length(3, "{}"), ErrorCode::kInvalidFile,
       "runs past the end of the 10-byte file", "", 0, 8},

      // Encoding and JSON syntax.
      {"byte_order_mark", raw_file("\xEF\xBB\xBF{}"), ErrorCode::kInvalidFile, "byte-order mark", "", 8, 11},
      syntax_row("invalid_utf8_in_string", "{\"a\xFF\":{}}", "not valid UTF-8 JSON"),
      syntax_row("overlong_utf8_in_string", "{\"\xC0\xAF\":{}}", "not valid UTF-8 JSON"),
      syntax_row("utf8_surrogate_in_string", "{\"\xED\xA0\x80\":{}}", "not valid UTF-8 JSON"),
      syntax_row("truncated_utf8_in_string", "{\"\xE2\x82\":{}}", "not valid UTF-8 JSON"),
      syntax_row("lone_surrogate_escape", "{\"a\\ud800\":{}}", "not valid UTF-8 JSON"),
      syntax_row("not_json", "hello, world", "not valid UTF-8 JSON"),
      syntax_row("truncated_json", "{\"a\":{\"dtype\":\"U8\"", "not valid UTF-8 JSON"),
      syntax_row("trailing_garbage_after_object", "{} x", "not valid UTF-8 JSON"),
      syntax_row("two_objects", "{}{}", "not valid UTF-8 JSON"),
      syntax_row("comment", "{/* c */}", "not valid UTF-8 JSON"),
      syntax_row("trailing_comma", "{\"__metadata__\":{},}", "not valid UTF-8 JSON"),
      syntax_row("control_character_in_string", "{\"a\x01z\":{}}", "not valid UTF-8 JSON"),
      syntax_row("raw_newline_in_string", "{\"a\nz\":{}}", "not valid UTF-8 JSON"),
      syntax_row("tab_in_string", "{\"__metadata__\":{\"k\":\"a\tb\"}}", "not valid UTF-8 JSON"),
      {"nul_byte_after_object", raw_file(std::string("{}\0garbage", 10)), ErrorCode::kInvalidFile,
       "contains a NUL byte", "", 10},
      {"nul_byte_in_string", raw_file(std::string("{\"a\0\":{}}", 9)), ErrorCode::kInvalidFile, "contains a NUL byte",
       "", 11},
      row("number_too_large_for_a_double",
          with_tensor_a("{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2],"
                        "\"scale\":1e999}"),
          2, "not valid JSON"),

      // The root.
      row("top_level_array", "[]", 0, "JSON header must be an object, got array"),
      row("top_level_string", "\"x\"", 0, "JSON header must be an object, got string"),
      row("top_level_null", "null", 0, "JSON header must be an object, got null"),
      row("top_level_number", "8", 0, "JSON header must be an object, got number"),

      // dtype.
      row("unknown_dtype", object({entry("a", "Q4", "[2]", 0, 2)}), 2, "unknown dtype 'Q4'", "a"),
      row("lowercase_dtype", object({entry("a", "u8", "[2]", 0, 2)}), 2, "unknown dtype 'u8'", "a"),
      row("fn_dtype_spelling", object({entry("a", "F8_E4M3FN", "[2]", 0, 2)}), 2, "unknown dtype", "a"),
      row("dtype_not_a_string", with_tensor_a("{\"dtype\":8,\"shape\":[2],\"data_offsets\":[0,2]}"), 2,
          "'dtype' must be a string", "a"),

      // shape.
      row("shape_negative", object({entry("a", "U8", "[-2]", 0, 2)}), 2, "'shape' must hold non-negative integers",
          "a"),
      row("shape_negative_zero", object({entry("a", "U8", "[-0]", 0, 0)}), 0, "'shape' must hold non-negative", "a"),
      row("shape_float", object({entry("a", "U8", "[2.0]", 0, 2)}), 2, "'shape' must hold non-negative integers", "a"),
      row("shape_exponent", object({entry("a", "U8", "[2e0]", 0, 2)}), 2, "'shape' must hold non-negative", "a"),
      row("shape_string", object({entry("a", "U8", "[\"2\"]", 0, 2)}), 2, "'shape' must hold non-negative", "a"),
      row("shape_nested_array", object({entry("a", "U8", "[[2]]", 0, 2)}), 2, "'shape' must hold non-negative", "a"),
      row("shape_null_element", object({entry("a", "U8", "[null]", 0, 0)}), 0, "'shape' must hold non-negative", "a"),
      row("shape_beyond_u64", object({entry("a", "U8", "[18446744073709551616]", 0, 0)}), 0,
          "'shape' must hold non-negative", "a"),
      row("shape_not_an_array", object({entry("a", "U8", "2", 0, 2)}), 2, "'shape' must be an array", "a"),

      // data_offsets.
      row("data_offsets_one_element", with_tensor_a("{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2]}"), 2,
          "'data_offsets' must be an array of exactly 2 integers", "a"),
      row("data_offsets_three_elements", with_tensor_a("{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2,2]}"), 2,
          "'data_offsets' must be an array of exactly 2 integers", "a"),
      row("data_offsets_not_an_array", with_tensor_a("{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":{}}"), 2,
          "'data_offsets' must be an array", "a"),
      row("data_offsets_negative_begin", with_tensor_a("{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[-1,1]}"), 2,
          "'data_offsets' must hold non-negative integers", "a"),
      row("data_offsets_negative_end", with_tensor_a("{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,-2]}"), 0,
          "'data_offsets' must hold non-negative integers", "a"),
      row("data_offsets_float", with_tensor_a("{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2.5]}"), 2,
          "'data_offsets' must hold non-negative integers", "a"),

      // Missing fields and malformed entries.
      row("missing_dtype", with_tensor_a("{\"shape\":[2],\"data_offsets\":[0,2]}"), 2, "missing field 'dtype'", "a"),
      row("missing_shape", with_tensor_a("{\"dtype\":\"U8\",\"data_offsets\":[0,2]}"), 2, "missing field 'shape'", "a"),
      row("missing_data_offsets", with_tensor_a("{\"dtype\":\"U8\",\"shape\":[2]}"), 2, "missing field 'data_offsets'",
          "a"),
      row("tensor_entry_not_an_object", with_tensor_a("[1,2]"), 0, "tensor entry must be a JSON object", "a"),
      row("tensor_entry_null", with_tensor_a("null"), 0, "tensor entry must be a JSON object", "a"),

      // Sizes.
      row("shape_element_count_overflows_u64",
          object({entry("a", "U8", "[" + std::to_string(two_pow_32) + "," + std::to_string(two_pow_32) + "]", 0, 0)}),
          0, "shape element count overflows 64 bits", "a", 0, 0),
      row("shape_bit_count_overflows_u64", object({entry("a", "F64", "[" + std::to_string(1ull << 59) + "]", 0, 0)}), 0,
          "shape size in bits overflows 64 bits", "a", 0, 0),
      row("size_larger_than_offsets", object({entry("a", "F32", "[2]", 0, 4)}), 4,
          "shape and dtype need 8 bytes but data_offsets span 4", "a", 0, 4),
      row("size_smaller_than_offsets", object({entry("a", "F32", "[1,1]", 0, 8)}), 8,
          "shape and dtype need 4 bytes but data_offsets span 8", "a", 0, 8),
      row("scalar_size_mismatch", object({entry("a", "F64", "[]", 0, 4)}), 4,
          "shape and dtype need 8 bytes but data_offsets span 4", "a", 0, 4),
      row("f4_odd_element_count", object({entry("a", "F4", "[3]", 0, 2)}), 2,
          "F4 tensor of 3 elements does not end on a whole byte", "a", 0, 2),
      row("f4_scalar", object({entry("a", "F4", "[]", 0, 1)}), 1, "F4 tensor of 1 elements does not end on a whole",
          "a", 0, 1),
      row("f6_e2m3_two_elements", object({entry("a", "F6_E2M3", "[2]", 0, 2)}), 2,
          "F6_E2M3 tensor of 2 elements does not end on a whole byte", "a", 0, 2),
      row("f6_e3m2_five_elements", object({entry("a", "F6_E3M2", "[5]", 0, 4)}), 4,
          "F6_E3M2 tensor of 5 elements does not end on a whole byte", "a", 0, 4),
      row("end_before_begin", object({entry("a", "U8", "[0]", 4, 2)}), 4, "data_offsets end 2 is before begin 4", "a",
          2, 4),  // the range in order (it once printed "bytes 12..10")
      row("huge_offsets_do_not_wrap",
          object({entry("a", "U8", "[1]", 0, 1),
                  entry("b", "U8", "[1]", 18446744073709551614ull, 18446744073709551615ull)}),
          1, "tensor ends past the end of the file", "b", kAnyOffset, kAnyOffset),

      // Layout: tensors tile the data section.
      row("hole_at_start", object({entry("a", "U8", "[2]", 2, 4)}), 4, "hole: data bytes 0..2", "a", 2, 4),
      row("hole_between_tensors", object({entry("a", "U8", "[2]", 0, 2), entry("b", "U8", "[2]", 3, 5)}), 5,
          "hole: data bytes 2..3", "b", 3, 5),
      row("zero_size_tensor_in_hole",
          object({entry("a", "U8", "[1]", 0, 1), entry("z", "U8", "[0]", 2, 2), entry("b", "U8", "[1]", 2, 3)}), 3,
          "hole: data bytes 1..2", "z", 2, 2),
      row("overlap", object({entry("a", "U8", "[4]", 0, 4), entry("b", "U8", "[4]", 2, 6)}), 6, "overlaps 'a'", "b", 2,
          6),
      row("alias_identical_offsets", object({entry("b", "U8", "[4]", 0, 4), entry("a", "U8", "[4]", 0, 4)}), 4,
          "overlaps 'a', which ends at data offset 4", "b", 0, 4),
      row("contained_in_another", object({entry("a", "U8", "[8]", 0, 8), entry("b", "U8", "[2]", 2, 4)}), 8, "overlaps",
          "b", 2, 4),
      row("trailing_bytes", object({u8x2}), 3, "tensors cover 2 data bytes but the data section has 3", "a", 2, 3),
      row("trailing_bytes_without_tensors", "{}", 5, "tensors cover 0 data bytes but the data section has 5", "", 0, 5),
      row("short_file", object({u8x2}), 1, "tensor ends past the end of the file (data section is 1 bytes)", "a", 0, 2),
      row("short_file_no_data", object({entry("a", "U8", "[0]", 0, 0), entry("b", "I32", "[1]", 0, 4)}), 0,
          "tensor ends past the end of the file", "b", 0, 4),

      // __metadata__.
      row("metadata_string", object({"\"__metadata__\":\"x\"", u8x2}), 2, "'__metadata__' must be an object"),
      row("metadata_array", object({"\"__metadata__\":[]", u8x2}), 2, "'__metadata__' must be an object"),
      row("metadata_value_number", object({"\"__metadata__\":{\"k\":1}", u8x2}), 2,
          "'__metadata__' value of 'k' must be a string, got number"),
      row("metadata_value_null", object({"\"__metadata__\":{\"k\":null}", u8x2}), 2,
          "'__metadata__' value of 'k' must be a string, got null"),
      row("metadata_value_object", object({"\"__metadata__\":{\"k\":{}}", u8x2}), 2,
          "'__metadata__' value of 'k' must be a string, got object"),

      // Duplicate keys: the reference keeps the last one; pinload refuses.
      row("duplicate_tensor_key", object({u8x2, entry("a", "U8", "[2]", 0, 2)}), 2, "duplicate key 'a' in JSON header",
          "a"),
      row("duplicate_metadata_key", object({"\"__metadata__\":{\"k\":\"v\",\"k\":\"w\"}", u8x2}), 2,
          "duplicate key 'k' in JSON header (in '__metadata__')"),
      row("duplicate_metadata_object", object({"\"__metadata__\":{}", "\"__metadata__\":{}", u8x2}), 2,
          "duplicate key '__metadata__'"),
      row("duplicate_field_in_tensor",
          with_tensor_a("{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[2],"
                        "\"data_offsets\":[0,2]}"),
          2, "duplicate key 'dtype' in JSON header (in 'a')", "a"),
      row("duplicate_escaped_key", object({u8x2, "\"\\u0061\":{}"}), 2, "duplicate key 'a'", "a"),

      // Nesting.
      row("nesting_100000_deep_arrays", deep_arrays(100'000), 0, "nests deeper than 16 levels"),
      row("nesting_100000_deep_objects", deep_objects(100'000), 0, "nests deeper than 16 levels", "k"),
      row("nesting_100000_deep_in_tensor",
          with_tensor_a("{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0],\"x\":" + deep_arrays(100'000) + "}"),
          0, "nests deeper than 16 levels", "a"),
      row("nesting_17_deep", "{\"x\":" + deep_arrays(16) + "}", 0, "nests deeper than 16 levels", "x"),
  };
  return rows;
}

class BadFileTest : public ::testing::TestWithParam<BadFile> {};

TEST_P(BadFileTest, IsRejectedWithContext) {
  const BadFile& bad = GetParam();
  try {
    const Header header = parse(bad.bytes);
    FAIL() << "accepted, with " << header.tensors.size() << " tensors";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), bad.code) << e.what();
    EXPECT_NE(dynamic_cast<const InvalidFileError*>(&e), nullptr) << e.what();
    EXPECT_NE(e.message().find(bad.message), std::string::npos)
        << "message: " << e.message() << "\nexpected to contain: " << bad.message;
    EXPECT_EQ(e.context().file, kFile);
    EXPECT_EQ(e.context().tensor, bad.tensor) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind(std::string(kFile) + ": ", 0), 0u) << e.what();
    if (!bad.tensor.empty()) {
      EXPECT_NE(std::string(e.what()).find("tensor '" + bad.tensor + "'"), std::string::npos) << e.what();
    }
    auto expect_offset = [&](const std::optional<std::uint64_t>& want, const std::optional<std::uint64_t>& got,
                             const char* which) {
      if (!want) {
        EXPECT_FALSE(got.has_value()) << which << " " << e.what();
      } else if (*want == kAnyOffset) {
        EXPECT_TRUE(got.has_value()) << which << " " << e.what();
      } else {
        EXPECT_EQ(got, want) << which << " " << e.what();
      }
    };
    expect_offset(bad.begin, e.context().begin, "begin");
    expect_offset(bad.end, e.context().end, "end");
  } catch (const std::exception& e) {
    FAIL() << "threw a non-pinload exception: " << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Rules, BadFileTest, ::testing::ValuesIn(bad_files()),
                         [](const ::testing::TestParamInfo<BadFile>& row_info) { return row_info.param.name; });

TEST(BadFileTableTest, HasOneDistinctNamePerRow) {
  const std::vector<BadFile> rows = bad_files();
  std::vector<std::string> names;
  for (const BadFile& r : rows) names.push_back(r.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::adjacent_find(names.begin(), names.end()), names.end());
  EXPECT_GE(rows.size(), 60u);
}

// ---------------------------------------------------------------------------
// Good files: what the reference accepts, pinload accepts too.

struct ExpectedTensor {
  std::string name;
  DType dtype;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin, end;
};

struct GoodFile {
  std::string name;
  std::string header;
  std::uint64_t data_size;
  std::vector<ExpectedTensor> tensors;  // in file order
  std::vector<std::pair<std::string, std::string>> metadata = {};
  bool has_metadata = false;
};

void PrintTo(const GoodFile& row, std::ostream* os) {
  *os << row.name;
}

std::vector<GoodFile> good_files() {
  const std::string u8x2 = entry("a", "U8", "[2]", 0, 2);
  return {
      {"empty_header", "{}", 0, {}},
      {"empty_header_padded", "{}      ", 0, {}},
      {"padded_with_spaces", object({u8x2}) + std::string(13, ' '), 2, {{"a", DType::kU8, {2}, 0, 2}}},
      {"padded_with_json_whitespace", object({u8x2}) + " \t\r\n", 2, {{"a", DType::kU8, {2}, 0, 2}}},
      {"leading_whitespace", "  " + object({u8x2}), 2, {{"a", DType::kU8, {2}, 0, 2}}},
      {"not_padded", object({u8x2}), 2, {{"a", DType::kU8, {2}, 0, 2}}},
      {"whitespace_inside",
       "{ \"a\" : { \"dtype\" : \"U8\" , \"shape\" : [ 2 ] , \"data_offsets\" : [ 0 , 2 ] } }",
       2,
       {{"a", DType::kU8, {2}, 0, 2}}},
      {"rank0_scalar", object({entry("s", "F32", "[]", 0, 4)}), 4, {{"s", DType::kF32, {}, 0, 4}}},
      {"rank0_bool_scalar", object({entry("s", "BOOL", "[]", 0, 1)}), 1, {{"s", DType::kBool, {}, 0, 1}}},
      {"zero_size_only", object({entry("z", "F32", "[0,3]", 0, 0)}), 0, {{"z", DType::kF32, {0, 3}, 0, 0}}},
      {"zero_size_sharing_offset_with_next",
       object({entry("b", "U8", "[2]", 0, 2), entry("a", "I32", "[3,0]", 0, 0)}),
       2,
       {{"a", DType::kI32, {3, 0}, 0, 0}, {"b", DType::kU8, {2}, 0, 2}}},
      {"zero_size_between",
       object({entry("a", "U8", "[1]", 0, 1), entry("z", "F16", "[0]", 1, 1), entry("b", "U8", "[1]", 1, 2)}),
       2,
       {{"a", DType::kU8, {1}, 0, 1}, {"z", DType::kF16, {0}, 1, 1}, {"b", DType::kU8, {1}, 1, 2}}},
      {"zero_size_at_end",
       object({entry("z", "F64", "[0]", 2, 2), u8x2}),
       2,
       {{"a", DType::kU8, {2}, 0, 2}, {"z", DType::kF64, {0}, 2, 2}}},
      {"zero_size_f4", object({entry("z", "F4", "[0]", 0, 0)}), 0, {{"z", DType::kF4, {0}, 0, 0}}},
      {"zero_size_several_sorted_by_name",
       object({entry("z2", "U8", "[0]", 0, 0), entry("z1", "U8", "[0]", 0, 0), entry("z0", "U8", "[0]", 0, 0)}),
       0,
       {{"z0", DType::kU8, {0}, 0, 0}, {"z1", DType::kU8, {0}, 0, 0}, {"z2", DType::kU8, {0}, 0, 0}}},
      {"unaligned_offsets",
       object({entry("f", "F32", "[2]", 1, 9), entry("b", "U8", "[1]", 0, 1)}),
       9,
       {{"b", DType::kU8, {1}, 0, 1}, {"f", DType::kF32, {2}, 1, 9}}},
      {"json_order_differs_from_file_order",
       object({entry("c", "U8", "[1]", 3, 4), entry("a", "U8", "[1]", 0, 1), entry("b", "U16", "[1]", 1, 3)}),
       4,
       {{"a", DType::kU8, {1}, 0, 1}, {"b", DType::kU16, {1}, 1, 3}, {"c", DType::kU8, {1}, 3, 4}}},
      {"unknown_extra_fields",
       with_tensor_a("{\"dtype\":\"U8\",\"note\":{\"x\":[1,2.5,null,true]},\"shape\":[2],\"data_offsets\":[0,2],"
                     "\"quant\":\"none\"}"),
       2,
       {{"a", DType::kU8, {2}, 0, 2}}},
      {"fields_in_any_order",
       with_tensor_a("{\"data_offsets\":[0,2],\"shape\":[2],\"dtype\":\"U8\"}"),
       2,
       {{"a", DType::kU8, {2}, 0, 2}}},
      {"metadata_null", object({"\"__metadata__\":null", u8x2}), 2, {{"a", DType::kU8, {2}, 0, 2}}},
      {"metadata_empty", object({"\"__metadata__\":{}", u8x2}), 2, {{"a", DType::kU8, {2}, 0, 2}}, {}, true},
      {"metadata_sorted_by_key",
       object({u8x2, "\"__metadata__\":{\"z\":\"1\",\"format\":\"pt\",\"\":\"\"}"}),
       2,
       {{"a", DType::kU8, {2}, 0, 2}},
       {{"", ""}, {"format", "pt"}, {"z", "1"}},
       true},
      {"metadata_key_escaped",
       object({"\"\\u005f_metadata__\":{\"k\":\"v\\n\"}", u8x2}),
       2,
       {{"a", DType::kU8, {2}, 0, 2}},
       {{"k", "v\n"}},
       true},
      {"metadata_like_tensor_name",
       object({entry("__metadata__x", "U8", "[2]", 0, 2)}),
       2,
       {{"__metadata__x", DType::kU8, {2}, 0, 2}}},
      {"empty_tensor_name", object({entry("", "U8", "[2]", 0, 2)}), 2, {{"", DType::kU8, {2}, 0, 2}}},
      {"unicode_and_escaped_names",
       object({entry("w\xC3\xBC\xE2\x82\xAC", "U8", "[1]", 0, 1), entry("q\\\"\\\\\\u0001", "U8", "[1]", 1, 2)}),
       2,
       {{"w\xC3\xBC\xE2\x82\xAC", DType::kU8, {1}, 0, 1}, {"q\"\\\x01", DType::kU8, {1}, 1, 2}}},
      {"max_u64_dim_with_zero",
       object({entry("z", "U8", "[18446744073709551615,0]", 0, 0)}),
       0,
       {{"z", DType::kU8, {18446744073709551615ull, 0}, 0, 0}}},
      {"nesting_16_deep",
       with_tensor_a("{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0],\"x\":" + deep_arrays(14) + "}"),
       0,
       {{"a", DType::kU8, {0}, 0, 0}}},
      {"f4_even", object({entry("a", "F4", "[2,3]", 0, 3)}), 3, {{"a", DType::kF4, {2, 3}, 0, 3}}},
      {"f6_four_elements", object({entry("a", "F6_E3M2", "[4]", 0, 3)}), 3, {{"a", DType::kF6_E3M2, {4}, 0, 3}}},
  };
}

class GoodFileTest : public ::testing::TestWithParam<GoodFile> {};

TEST_P(GoodFileTest, IsAcceptedAsWritten) {
  const GoodFile& good = GetParam();
  const std::vector<std::uint8_t> bytes = raw_file(good.header, data_of(good.data_size));
  Header h;
  try {
    h = parse(bytes);
  } catch (const Error& e) {
    FAIL() << e.what();
  }
  EXPECT_EQ(h.json_size, good.header.size());
  EXPECT_EQ(h.file_size, bytes.size());
  EXPECT_EQ(h.data_offset(), 8 + good.header.size());
  EXPECT_EQ(h.data_size(), good.data_size);
  ASSERT_EQ(h.tensors.size(), good.tensors.size());
  for (std::size_t i = 0; i < good.tensors.size(); ++i) {
    const ExpectedTensor& want = good.tensors[i];
    const TensorInfo& got = h.tensors[i];
    SCOPED_TRACE(want.name);
    EXPECT_EQ(got.name, want.name);
    EXPECT_EQ(got.dtype, want.dtype);
    EXPECT_EQ(got.shape, want.shape);
    EXPECT_EQ(got.begin, want.begin);
    EXPECT_EQ(got.end, want.end);
    EXPECT_EQ(got.nbytes(), want.end - want.begin);
    EXPECT_EQ(h.find(want.name), &got);
  }
  EXPECT_EQ(h.find("no such tensor"), nullptr);
  EXPECT_EQ(h.metadata, good.metadata);
  EXPECT_EQ(h.has_metadata, good.has_metadata);
}

INSTANTIATE_TEST_SUITE_P(Accepted, GoodFileTest, ::testing::ValuesIn(good_files()),
                         [](const ::testing::TestParamInfo<GoodFile>& row_info) { return row_info.param.name; });

// Every dtype of the format, with a 4-element tensor (a whole byte for all).
struct DTypeRow {
  const char* name;
  DType dtype;
  std::uint64_t bytes_for_4;
};

constexpr DTypeRow kDTypes[] = {
    {"BOOL", DType::kBool, 4},
    {"U8", DType::kU8, 4},
    {"I8", DType::kI8, 4},
    {"I16", DType::kI16, 8},
    {"U16", DType::kU16, 8},
    {"I32", DType::kI32, 16},
    {"U32", DType::kU32, 16},
    {"I64", DType::kI64, 32},
    {"U64", DType::kU64, 32},
    {"F16", DType::kF16, 8},
    {"BF16", DType::kBF16, 8},
    {"F32", DType::kF32, 16},
    {"F64", DType::kF64, 32},
    {"C64", DType::kC64, 32},
    {"F8_E4M3", DType::kF8_E4M3, 4},
    {"F8_E5M2", DType::kF8_E5M2, 4},
    {"F8_E8M0", DType::kF8_E8M0, 4},
    {"F8_E4M3FNUZ", DType::kF8_E4M3FNUZ, 4},
    {"F8_E5M2FNUZ", DType::kF8_E5M2FNUZ, 4},
    {"F4", DType::kF4, 2},
    {"F6_E2M3", DType::kF6_E2M3, 3},
    {"F6_E3M2", DType::kF6_E3M2, 3},
};
static_assert(std::size(kDTypes) == kDTypeCount);

TEST(DTypeTest, EveryFormatDTypeIsAccepted) {
  for (const DTypeRow& d : kDTypes) {
    SCOPED_TRACE(d.name);
    const Header h = parse(raw_file(object({entry("t", d.name, "[4]", 0, d.bytes_for_4)}), data_of(d.bytes_for_4)));
    ASSERT_EQ(h.tensors.size(), 1u);
    EXPECT_EQ(h.tensors[0].dtype, d.dtype);
    EXPECT_EQ(h.tensors[0].nbytes(), d.bytes_for_4);
    EXPECT_EQ(dtype_name(d.dtype), d.name);
    EXPECT_EQ(dtype_from_name(d.name), d.dtype);
    EXPECT_EQ(dtype_bits(d.dtype) * 4 / 8, d.bytes_for_4);
    EXPECT_EQ(testing::spec_bits(d.name), dtype_bits(d.dtype));
  }
}

TEST(DTypeTest, EveryDTypeSizeMismatchIsRejected) {
  for (const DTypeRow& d : kDTypes) {
    SCOPED_TRACE(d.name);
    const auto bytes = raw_file(object({entry("t", d.name, "[4]", 0, d.bytes_for_4 + 1)}), data_of(d.bytes_for_4 + 1));
    EXPECT_THROW(parse(bytes), InvalidFileError);
  }
}

TEST(DTypeTest, NamesAreCaseSensitiveAndExact) {
  for (std::string_view name : {std::string_view("f32"), std::string_view("F32 "), std::string_view(""),
                                std::string_view("F8_E4M3FN"), std::string_view("F32\0", 4)}) {
    EXPECT_FALSE(dtype_from_name(name).has_value()) << name;
  }
}

// ---------------------------------------------------------------------------
// Prefix and header entry points.

TEST(PrefixTest, ReturnsTheHeaderLength) {
  const auto bytes = raw_file("{}  ");
  EXPECT_EQ(parse_header_prefix(as_bytes(bytes), bytes.size(), kFile), 4u);
}

TEST(PrefixTest, HeaderMayFillTheWholeFile) {
  const auto bytes = raw_file("{}");
  EXPECT_EQ(parse_header_prefix(as_bytes(bytes), bytes.size(), kFile), 2u);
  EXPECT_THROW(parse_header_prefix(as_bytes(bytes), bytes.size() - 1, kFile), InvalidFileError);
}

TEST(PrefixTest, HeaderOfExactlyTheLimitIsNotRejectedByLength) {
  const auto bytes = raw_file_with_length(kMaxHeaderSize, "");
  EXPECT_EQ(parse_header_prefix(as_bytes(bytes), 8 + kMaxHeaderSize, kFile), kMaxHeaderSize);
  EXPECT_THROW(parse_header_prefix(as_bytes(bytes), 8 + kMaxHeaderSize - 1, kFile), InvalidFileError);
}

TEST(PrefixTest, ShortPrefixSpanIsRejected) {
  const auto bytes = raw_file("{}");
  EXPECT_THROW(parse_header_prefix(as_bytes(bytes).first(7), bytes.size(), kFile), InvalidFileError);
}

TEST(HeaderTest, HugeOffsetsSaturateInTheErrorContext) {
  const auto bytes = raw_file(object({entry("a", "U8", "[1]", 18446744073709551614ull, 18446744073709551615ull)}));
  try {
    parse(bytes);
    FAIL() << "accepted";
  } catch (const InvalidFileError& e) {
    EXPECT_EQ(e.context().tensor, "a");
    EXPECT_EQ(e.context().begin, std::numeric_limits<std::uint64_t>::max());
    EXPECT_EQ(e.context().end, std::numeric_limits<std::uint64_t>::max());
  }
}

TEST(HeaderTest, ParseHeaderChecksAgainstTheGivenFileSize) {
  const std::string json = object({entry("a", "U8", "[2]", 0, 2)});
  const auto span = std::as_bytes(std::span(json.data(), json.size()));
  const Header h = parse_header(span, 8 + json.size() + 2, kFile);
  EXPECT_EQ(h.tensors.size(), 1u);
  EXPECT_THROW(parse_header(span, 8 + json.size() + 3, kFile), InvalidFileError);
  EXPECT_THROW(parse_header(span, 8 + json.size() + 1, kFile), InvalidFileError);
  EXPECT_THROW(parse_header(span, json.size(), kFile), InvalidFileError);  // does not fit
}

// ---------------------------------------------------------------------------
// Robustness: every truncation and many byte flips of a valid file are
// either accepted or rejected with InvalidFileError naming the file.

std::vector<std::uint8_t> sample_file() {
  std::mt19937_64 rng(7);
  const FileImage image = make_image({{"emb", "BF16", {3, 4}}, {"s", "F32", {}}, {"z", "I8", {0}}, {"q", "F4", {6}}},
                                     rng, 8, "{\"format\":\"pt\"}");
  return image.bytes();
}

TEST(RobustnessTest, EveryTruncationIsRejected) {
  const auto bytes = sample_file();
  ASSERT_NO_THROW(parse(bytes));
  for (std::size_t size = 0; size < bytes.size(); ++size) {
    const std::vector<std::uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(size));
    try {
      parse(cut);
      ADD_FAILURE() << "accepted a file cut to " << size << " bytes";
    } catch (const InvalidFileError& e) {
      EXPECT_EQ(e.context().file, kFile);
    }
  }
}

TEST(RobustnessTest, AppendedBytesAreRejected) {
  auto bytes = sample_file();
  bytes.push_back(0);
  EXPECT_THROW(parse(bytes), InvalidFileError);
}

TEST(RobustnessTest, ByteFlipsInTheHeaderNeverThrowAnythingElse) {
  const auto original = sample_file();
  const std::size_t header_end = 8 + (original[0] | original[1] << 8);
  int accepted = 0, rejected = 0;
  for (std::size_t at = 0; at < header_end; ++at) {
    for (std::uint8_t value : {0x00, 0x20, 0x22, 0x2c, 0x30, 0x39, 0x5b, 0x5d, 0x7b, 0x7d, 0x80, 0xff}) {
      auto bytes = original;
      if (bytes[at] == value) continue;
      bytes[at] = value;
      try {
        parse(bytes);
        ++accepted;
      } catch (const InvalidFileError& e) {
        ASSERT_EQ(e.context().file, kFile);
        ++rejected;
      } catch (const std::exception& e) {
        FAIL() << "flip at " << at << " to " << int{value} << " threw " << e.what();
      }
    }
  }
  EXPECT_GT(rejected, 0);
  EXPECT_GT(accepted, 0);  // e.g. a digit of a shape in an ignored field, padding
}

// ---------------------------------------------------------------------------
// Seeded random round trips through tests/support's writer.

constexpr const char* kAllDTypeNames[] = {
    "BOOL", "U8",  "I8",  "I16",     "U16",     "I32",     "U32",         "I64",         "U64", "F16",     "BF16",
    "F32",  "F64", "C64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4",  "F6_E2M3", "F6_E3M2"};

// Random specs: any dtype, rank 0..4, some zero-size, names with odd bytes.
std::vector<TensorSpec> random_specs(std::mt19937_64& rng, int count) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < count; ++i) {
    TensorSpec t;
    t.name = (rng() % 3 == 0 ? "m\xC3\xA9." : "model.") + std::to_string(i) + (rng() % 2 ? ".weight" : ".b");
    t.dtype = kAllDTypeNames[rng() % std::size(kAllDTypeNames)];
    const int rank = static_cast<int>(rng() % 5);
    for (int r = 0; r < rank; ++r) t.shape.push_back(rng() % 10 == 0 ? 0 : 1 + rng() % 9);
    const unsigned bits = testing::spec_bits(t.dtype);
    if (bits < 8) t.shape.push_back(bits == 4 ? 2 : 4);  // a whole number of bytes
    specs.push_back(std::move(t));
  }
  return specs;
}

std::uint64_t spec_bytes(const TensorSpec& t) {
  std::uint64_t n = 1;
  for (std::uint64_t d : t.shape) n *= d;
  return n * testing::spec_bits(t.dtype) / 8;
}

TEST(RoundTripTest, MakeImageFilesParseAsWritten) {
  for (std::uint64_t seed = 1; seed <= 60; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    const std::vector<TensorSpec> specs = random_specs(rng, static_cast<int>(rng() % 20));
    const std::size_t pad = seed % 3 == 0 ? 1 : 8;
    const std::string metadata = seed % 2 ? "{\"seed\":\"" + std::to_string(seed) + "\",\"format\":\"pt\"}" : "";
    const FileImage image = make_image(specs, rng, pad, metadata);
    const std::vector<std::uint8_t> bytes = image.bytes();
    const Header h = parse(bytes);

    if (pad == 8) {
      EXPECT_EQ(h.data_offset() % 8, 0u);
    }
    EXPECT_EQ(h.json_size, image.header_json.size());
    EXPECT_EQ(h.data_size(), image.data.size());
    EXPECT_EQ(h.has_metadata, !metadata.empty());
    if (!metadata.empty()) {
      const std::vector<std::pair<std::string, std::string>> want = {{"format", "pt"}, {"seed", std::to_string(seed)}};
      EXPECT_EQ(h.metadata, want);
    }
    // make_image lays tensors out in order; zero-size ones tie with the next
    // tensor and sort by (begin, end, name).
    std::vector<ExpectedTensor> want;
    std::uint64_t offset = 0;
    for (const TensorSpec& t : specs) {
      const std::uint64_t n = spec_bytes(t);
      want.push_back({t.name, *dtype_from_name(t.dtype), t.shape, offset, offset + n});
      offset += n;
    }
    std::sort(want.begin(), want.end(), [](const ExpectedTensor& a, const ExpectedTensor& b) {
      return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
    });
    ASSERT_EQ(h.tensors.size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE(want[i].name);
      EXPECT_EQ(h.tensors[i].name, want[i].name);
      EXPECT_EQ(h.tensors[i].dtype, want[i].dtype);
      EXPECT_EQ(h.tensors[i].shape, want[i].shape);
      EXPECT_EQ(h.tensors[i].begin, want[i].begin);
      EXPECT_EQ(h.tensors[i].end, want[i].end);
      const TensorInfo* found = h.find(want[i].name);
      ASSERT_NE(found, nullptr);
      EXPECT_EQ(found->begin, want[i].begin);
      // The bytes at the offsets are the ones written for this tensor.
      EXPECT_TRUE(std::equal(image.data.begin() + static_cast<std::ptrdiff_t>(want[i].begin),
                             image.data.begin() + static_cast<std::ptrdiff_t>(want[i].end),
                             bytes.begin() + static_cast<std::ptrdiff_t>(h.data_offset() + h.tensors[i].begin)));
    }
  }
}

TEST(RoundTripTest, WriteRandomCheckpointFilesParseAsWritten) {
  testing::TempDir dir;
  for (std::uint64_t seed = 100; seed < 130; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    const int count = 1 + static_cast<int>(seed % 40);
    const std::string path = dir.file("r" + std::to_string(seed) + ".safetensors");
    const FileImage image = testing::write_random_checkpoint(path, rng, count);
    const std::vector<std::uint8_t> bytes = testing::read_file(path);
    ASSERT_EQ(bytes, image.bytes());
    const Header h = parse_safetensors(as_bytes(bytes), path);

    // write_random_checkpoint names tensors layer.<i>.weight and lays them
    // out in that order; read what it wrote back from its own header text.
    ASSERT_EQ(h.tensors.size(), static_cast<std::size_t>(count));
    std::uint64_t offset = 0;
    for (int i = 0; i < count; ++i) {
      const std::string name = "layer." + std::to_string(i) + ".weight";
      SCOPED_TRACE(name);
      const TensorInfo* t = h.find(name);
      ASSERT_NE(t, nullptr);
      const std::size_t at = image.header_json.find("\"" + name + "\":");
      ASSERT_NE(at, std::string::npos);
      const std::string written = image.header_json.substr(at, image.header_json.find('}', at) - at);
      std::string shape;
      for (std::size_t k = 0; k < t->shape.size(); ++k) shape += (k ? "," : "") + std::to_string(t->shape[k]);
      EXPECT_EQ(written, "\"" + name + "\":{\"dtype\":\"" + std::string(dtype_name(t->dtype)) + "\",\"shape\":[" +
                             shape + "],\"data_offsets\":[" + std::to_string(t->begin) + "," + std::to_string(t->end) +
                             "]");
      EXPECT_EQ(t->begin, offset);
      EXPECT_EQ(t->nbytes(), t->numel() * testing::spec_bits(std::string(dtype_name(t->dtype))) / 8);
      offset = t->end;
    }
    EXPECT_EQ(offset, h.data_size());
  }
}

}  // namespace
}  // namespace pinload
