// Test support: temporary folders and safetensors files built byte by byte.
#pragma once

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace pinload::testing {

// A fresh folder under $TMPDIR (or /tmp), removed with its contents on
// destruction.
// Whether O_DIRECT opens and reads `path` (tmpfs refuses it).
bool direct_io_works(const std::string& path);

class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

struct TensorSpec {
  std::string name;
  std::string dtype;  // the format's spelling
  std::vector<std::uint64_t> shape;
};

// Element size in bits of a format dtype name (test-side, independent of the
// library's table).
unsigned spec_bits(const std::string& dtype);

// A safetensors file image: prefix, header, data. The header is written by
// hand (not by the library), padded with spaces to `pad_to` bytes.
struct FileImage {
  std::string header_json;
  std::vector<std::uint8_t> data;
  std::vector<std::uint8_t> bytes() const;  // 8-byte length + header + data
};

// Lays out `tensors` in the given order with random contents from `rng`.
FileImage make_image(const std::vector<TensorSpec>& tensors, std::mt19937_64& rng,
                     std::size_t pad_to = 8, const std::string& metadata_json = "");

// Raw bytes: a u64 length prefix for `header`, then header, then data.
std::vector<std::uint8_t> raw_file(const std::string& header, const std::vector<std::uint8_t>& data = {});
std::vector<std::uint8_t> raw_file_with_length(std::uint64_t declared_length, const std::string& header,
                                               const std::vector<std::uint8_t>& data = {});

void write_file(const std::string& path, const std::vector<std::uint8_t>& bytes);
std::vector<std::uint8_t> read_file(const std::string& path);

// A random checkpoint of `count` tensors with random dtypes and shapes,
// written to `path`; returns its image. Names are name_prefix + "<i>.weight".
FileImage write_random_checkpoint(const std::string& path, std::mt19937_64& rng, int count,
                                  std::uint64_t max_elements = 4096, const std::string& name_prefix = "layer.");

// Number of open file descriptors of this process (/proc/self/fd).
int open_fd_count();
// Number of threads of this process (/proc/self/status), counting the
// sanitizer runtime's helper thread from the first call on.
int thread_count();
// The thread count once it has held still for 50 ms (at most 2 s): a
// baseline that no exiting thread inflates.
int stable_thread_count();
// The thread count once it has fallen to `expected`, or after 5 s (a joined
// thread may linger in /proc for a moment).
int settled_thread_count(int expected);

}  // namespace pinload::testing
