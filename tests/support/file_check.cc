#include "file_check.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string_view>

namespace pinload::testing {

// Tensor offsets from the header text the test support wrote.
std::vector<Layout> layout_of(const FileImage& image) {
  // Entries read "<name>":{"dtype":"..","shape":[..],"data_offsets":[b,e]}.
  static constexpr std::string_view kEntry = "\":{\"dtype\":", kOffsets = "\"data_offsets\":[";
  const std::string& h = image.header_json;
  std::vector<Layout> out;
  for (std::size_t at = h.find(kEntry); at != std::string::npos; at = h.find(kEntry, at + 1)) {
    const std::size_t name = h.rfind('"', at - 1) + 1;
    const std::size_t offsets = h.find(kOffsets, at) + kOffsets.size();
    out.push_back({h.substr(name, at - name), std::stoull(h.substr(offsets)),
                   std::stoull(h.substr(h.find(',', offsets) + 1))});
  }
  return out;
}

std::vector<char> slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  std::vector<char> out(static_cast<std::size_t>(in.tellg()));
  in.seekg(0).read(out.data(), static_cast<std::streamsize>(out.size()));
  return out;
}

// The offset in the file of tensor `name` of `image`.
Layout find_layout(const FileImage& image, const std::string& name) {
  for (const Layout& t : layout_of(image)) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name << " in the test's header";
  return {};
}

// `tensor` holds exactly the file's bytes at `t`.
void expect_tensor_bytes(const Tensor& tensor, const std::vector<char>& file, const FileImage& image,
                         const Layout& t) {
  const std::uint64_t at = 8 + image.header_json.size() + t.begin;
  ASSERT_EQ(tensor.nbytes(), t.end - t.begin) << t.name;
  ASSERT_LE(at + tensor.nbytes(), file.size()) << t.name;
  if (std::memcmp(tensor.data(), file.data() + at, tensor.nbytes()) != 0) {
    std::uint64_t i = 0;
    while (tensor.data()[i] == static_cast<std::byte>(file[at + i])) ++i;
    ADD_FAILURE() << "tensor " << t.name << " differs at byte " << i << " of " << tensor.nbytes() << " (file offset "
                  << at + i << ")";
  }
}

// Every tensor of `image` (the file at `path`) is in `sd` under prefix + name,
// with exactly the file's bytes.
void expect_matches_file(const StateDict& sd, const std::string& path, const FileImage& image,
                         const std::string& prefix) {
  SCOPED_TRACE(path);
  const std::vector<char> file = slurp(path);
  const std::vector<Layout> layout = layout_of(image);
  ASSERT_FALSE(layout.empty() && !image.data.empty()) << "unparsed header";
  for (const Layout& t : layout) {
    const Tensor* tensor = sd.find(prefix + t.name);
    ASSERT_NE(tensor, nullptr) << t.name;
    expect_tensor_bytes(*tensor, file, image, t);
  }
}

}  // namespace pinload::testing
