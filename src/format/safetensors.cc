#include "pinload/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
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

// Note [Header parsing]
// The header is parsed in one pass of the strict SAX parser (json_strict.h)
// straight into TensorInfo: no DOM is built, so time and memory are linear in
// the header (a DOM of nlohmann's std::map objects cost about 4x the time of
// the reference safetensors on a 200,000-tensor header, and 1 KB a tensor).
// A rule broken by a value (a negative shape, an unknown dtype) is recorded
// and the parse goes on, so that a syntax error anywhere in the header still
// wins, as it does with a parser that builds the whole document first; the
// first such rule broken, in file order, is reported, after duplicate root
// keys, which are found from the names sorted for Header::find rather than a
// hash set of every name. Within one tensor the fields are judged in the order
// dtype, shape, data_offsets, whatever their order in the file.
class HeaderSax final : public StrictJsonHandler {
 public:
  HeaderSax(Header& header, const std::string& file) : header_(header), file_(file) {}

  // The first rule broken, if any.
  const std::optional<InvalidFileError>& error() const { return error_; }
  // Root members that are not in Header::tensors (their entry broke a rule,
  // or one before them did), for the duplicate check; and how many
  // "__metadata__" members there were.
  const std::vector<std::string>& unbuilt() const { return unbuilt_; }
  int metadata_members() const { return metadata_members_; }
  bool checks_root_duplicates() const override { return true; }

  void null() override { value(Kind::kNull, "null"); }
  void boolean(bool v) override { value(Kind::kBool, v ? "true" : "false"); }
  void number_integer(std::int64_t v) override { value(Kind::kNumber, std::to_string(v)); }
  void number_unsigned(std::uint64_t v) override {
    if (!frames_.empty() && (frames_.back() == Frame::kShape || frames_.back() == Frame::kOffsets)) {
      numbers_.push_back(v);  // the hot path: one per dimension and offset
      return;
    }
    value(Kind::kNumber, std::to_string(v));
  }
  void number_float(double, const std::string& text) override { value(Kind::kNumber, text); }
  void string(std::string& v) override {
    // Copies, not moves: the lexer keeps its buffer's capacity.
    if (!frames_.empty() && frames_.back() == Frame::kMetadata) {
      header_.metadata.emplace_back(key_, v);
      return;
    }
    if (!frames_.empty() && frames_.back() == Frame::kTensor && key_ == "dtype") {
      dtype_text_.assign(v);
      dtype_ = Field::kOk;
      return;
    }
    value(Kind::kString, "\"" + v + "\"");
  }
  void start_object() override { open(value(Kind::kObject, "an object")); }
  void start_array() override { open(value(Kind::kArray, "an array")); }
  void key(std::string& key) override {
    if (frames_.size() == 1) {
      member_.assign(key);  // a tensor's name, or "__metadata__"
      if (member_ == "__metadata__") ++metadata_members_;
    }
    key_.assign(key);
  }
  void end_object() override {
    const Frame frame = frames_.back();
    frames_.pop_back();
    if (frame == Frame::kTensor) finish_tensor();
  }
  void end_array() override {
    const Frame frame = frames_.back();
    frames_.pop_back();
    if (frame == Frame::kShape) {
      if (shape_ == Field::kPending) {
        shape_value_.assign(numbers_.begin(), numbers_.end());
        shape_ = Field::kOk;
      }
    } else if (frame == Frame::kOffsets) {
      if (numbers_.size() + offsets_bad_count_ != 2) {  // judged before the elements
        offsets_ = Field::kBad;
        offsets_why_ = "'data_offsets' must be an array of exactly 2 integers";
      } else if (offsets_ == Field::kPending) {
        begin_ = numbers_[0];
        end_ = numbers_[1];
        offsets_ = Field::kOk;
      }
    }
  }

 private:
  enum class Kind { kNull, kBool, kNumber, kString, kObject, kArray };
  // What the innermost open object or array is.
  enum class Frame { kRoot, kMetadata, kTensor, kShape, kOffsets, kSkip };
  enum class Field { kMissing, kPending, kOk, kBad };

  static const char* type_name(Kind kind) {
    switch (kind) {
      case Kind::kNull: return "null";
      case Kind::kBool: return "boolean";
      case Kind::kNumber: return "number";
      case Kind::kString: return "string";
      case Kind::kObject: return "object";
      case Kind::kArray: return "array";
    }
    return "value";
  }

  void open(Frame frame) { frames_.push_back(frame); }

  // Records the first rule broken.
  void fail(std::string message, std::string tensor = {}) {
    if (!error_) error_.emplace(std::move(message), ErrorContext{file_, std::move(tensor)});
  }
  void fail_field(Field* field, std::string* why, std::string message) {
    if (*field == Field::kBad) return;
    *field = Field::kBad;
    *why = std::move(message);
  }

  // A value (or the start of a container: then the Frame it opens) where the
  // document is now. `text` renders scalars for messages.
  Frame value(Kind kind, const std::string& text) {
    if (frames_.empty()) {
      if (kind == Kind::kObject) return Frame::kRoot;
      fail(std::string("JSON header must be an object, got ") + type_name(kind));
      return Frame::kSkip;
    }
    switch (frames_.back()) {
      case Frame::kRoot:
        if (member_ == "__metadata__") {
          if (kind == Kind::kNull) return Frame::kSkip;
          if (kind == Kind::kObject) {
            header_.has_metadata = true;
            return Frame::kMetadata;
          }
          fail("'__metadata__' must be an object of strings");
          return Frame::kSkip;
        }
        if (kind == Kind::kObject) {
          start_tensor();
          return Frame::kTensor;
        }
        fail("tensor entry must be a JSON object", member_);
        unbuilt_.push_back(member_);
        return Frame::kSkip;
      case Frame::kMetadata:
        fail("'__metadata__' value of '" + key_ + "' must be a string, got " + type_name(kind));
        return Frame::kSkip;
      case Frame::kTensor:
        if (key_ == "dtype") {
          fail_field(&dtype_, &dtype_why_, "'dtype' must be a string");
        } else if (key_ == "shape") {
          if (kind == Kind::kArray) {
            numbers_.clear();
            shape_ = Field::kPending;
            return Frame::kShape;
          }
          fail_field(&shape_, &shape_why_, "'shape' must be an array");
        } else if (key_ == "data_offsets") {
          if (kind == Kind::kArray) {
            numbers_.clear();
            offsets_bad_count_ = 0;
            offsets_ = Field::kPending;
            return Frame::kOffsets;
          }
          fail_field(&offsets_, &offsets_why_, "'data_offsets' must be an array of exactly 2 integers");
        }
        return Frame::kSkip;  // other members are ignored, as the reference does
      case Frame::kShape:
        fail_field(&shape_, &shape_why_, "'shape' must hold non-negative integers, got " + text);
        return Frame::kSkip;
      case Frame::kOffsets:
        ++offsets_bad_count_;
        fail_field(&offsets_, &offsets_why_, "'data_offsets' must hold non-negative integers, got " + text);
        return Frame::kSkip;
      case Frame::kSkip:
        return Frame::kSkip;
    }
    return Frame::kSkip;
  }

  void start_tensor() {
    dtype_ = shape_ = offsets_ = Field::kMissing;
    dtype_text_.clear();
    shape_value_.clear();
  }

  void finish_tensor() {
    const std::size_t built = header_.tensors.size();
    build_tensor();
    if (header_.tensors.size() == built) unbuilt_.push_back(member_);
  }

  void build_tensor() {
    auto check = [&](Field field, const std::string& why, const char* name) {
      if (field == Field::kMissing) fail(std::string("missing field '") + name + "'", member_);
      if (field == Field::kBad) fail(why, member_);
      return field == Field::kOk;
    };
    if (!check(dtype_, dtype_why_, "dtype")) return;
    const std::optional<DType> dtype = dtype_from_name(dtype_text_);
    if (!dtype) {
      fail("unknown dtype '" + dtype_text_ + "'", member_);
      return;
    }
    if (!check(shape_, shape_why_, "shape") || !check(offsets_, offsets_why_, "data_offsets")) return;
    if (error_) return;  // the header fails anyway: stop building
    TensorInfo& t = header_.tensors.emplace_back();
    t.name = member_;
    t.dtype = *dtype;
    t.shape = std::move(shape_value_);
    t.begin = begin_;
    t.end = end_;
  }

  Header& header_;
  const std::string& file_;
  std::optional<InvalidFileError> error_;
  std::vector<Frame> frames_;
  std::string member_;  // the root member being parsed
  std::string key_;     // the last key seen
  // The tensor being parsed.
  Field dtype_ = Field::kMissing, shape_ = Field::kMissing, offsets_ = Field::kMissing;
  std::string dtype_why_, shape_why_, offsets_why_;
  std::string dtype_text_;
  std::vector<std::uint64_t> shape_value_;
  std::vector<std::uint64_t> numbers_;  // of the shape or data_offsets array being parsed
  std::size_t offsets_bad_count_ = 0;
  std::uint64_t begin_ = 0, end_ = 0;
  std::vector<std::string> unbuilt_;
  int metadata_members_ = 0;
};

// Throws the duplicate-key error of the first name that appears twice among
// the root's members (Note [Header parsing]): `names` sorted.
void check_unique(const std::vector<std::string_view>& names, const std::string& file) {
  const auto dup = std::adjacent_find(names.begin(), names.end());
  if (dup != names.end()) {
    const std::string name(*dup);
    throw InvalidFileError("duplicate key '" + name + "' in JSON header", ErrorContext{file, name});
  }
}

void check_tensor_size(const TensorInfo& t, std::uint64_t data_offset, const std::string& file) {
  constexpr auto kMax = std::numeric_limits<std::uint64_t>::max();
  // The range in order, also where the offsets are swapped.
  auto fail = [&](std::string message) {
    invalid(file, std::move(message), t.name, sat_add(data_offset, std::min(t.begin, t.end)),
            sat_add(data_offset, std::max(t.begin, t.end)));
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

  HeaderSax sax(header, file);
  parse_strict_json(first, last, file, kHeaderPrefixSize, "JSON header", sax, /*root_keys_are_tensors=*/true);
  // Duplicate root keys first, as a parser that checks them as it goes would
  // report them; from the names sorted for Header::find, so at no extra cost.
  if (sax.metadata_members() > 1) throw InvalidFileError("duplicate key '__metadata__' in JSON header", ErrorContext{file});
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  header.by_name.resize(header.tensors.size());
  for (std::uint32_t i = 0; i < header.by_name.size(); ++i) header.by_name[i] = i;
  std::sort(header.by_name.begin(), header.by_name.end(),
            [&](std::uint32_t a, std::uint32_t b) { return header.tensors[a].name < header.tensors[b].name; });
  {
    std::vector<std::string_view> names;
    names.reserve(header.tensors.size() + sax.unbuilt().size());
    for (std::uint32_t i : header.by_name) names.push_back(header.tensors[i].name);
    if (!sax.unbuilt().empty()) {
      for (const std::string& n : sax.unbuilt()) names.push_back(n);
      std::sort(names.begin(), names.end());
    }
    check_unique(names, file);
  }
  if (sax.error()) throw *sax.error();

  for (const TensorInfo& t : header.tensors) check_tensor_size(t, data_offset, file);

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
  return header;
}

Header parse_safetensors(std::span<const std::byte> file_bytes, const std::string& file) {
  const std::uint64_t n = parse_header_prefix(file_bytes, file_bytes.size(), file);
  return parse_header(file_bytes.subspan(kHeaderPrefixSize, n), file_bytes.size(), file);
}

}  // namespace pinload
