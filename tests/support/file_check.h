// Test support: an independent reader. It takes tensor offsets from the header
// text the test support wrote (not from the library's parser) and the bytes
// from a plain std::ifstream, and compares them with loaded tensors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pinload/state_dict.h"
#include "test_files.h"

namespace pinload::testing {

struct Layout {
  std::string name;
  std::uint64_t begin = 0, end = 0;  // in the data section
};

// Tensor offsets parsed from image.header_json, in header order.
std::vector<Layout> layout_of(const FileImage& image);
// The layout of tensor `name`; records a test failure when absent.
Layout find_layout(const FileImage& image, const std::string& name);
// The whole file.
std::vector<char> slurp(const std::string& path);
// `tensor` (on the host) holds exactly the file's bytes at `t`.
void expect_tensor_bytes(const Tensor& tensor, const std::vector<char>& file, const FileImage& image, const Layout& t);
// Every tensor of `image` (the file at `path`) is in `sd` under prefix + name,
// with exactly the file's bytes.
void expect_matches_file(const StateDict& sd, const std::string& path, const FileImage& image,
                         const std::string& prefix = "");

}  // namespace pinload::testing
