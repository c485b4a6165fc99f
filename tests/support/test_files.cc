#include "test_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <map>
#include <sstream>
#include <stdexcept>

namespace pinload::testing {

bool direct_io_works(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  if (fd < 0) return false;
  void* buffer = std::aligned_alloc(4096, 4096);
  const bool ok = ::pread(fd, buffer, 4096, 0) >= 0;
  std::free(buffer);
  ::close(fd);
  return ok;
}
namespace fs = std::filesystem;

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string templ = std::string(base && *base ? base : "/tmp") + "/pinload-test-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = templ;
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

unsigned spec_bits(const std::string& d) {
  static const std::map<std::string, unsigned> bits = {
      {"BOOL", 8},     {"U8", 8},       {"I8", 8},       {"I16", 16},          {"U16", 16},
      {"I32", 32},     {"U32", 32},     {"I64", 64},     {"U64", 64},          {"F16", 16},
      {"BF16", 16},    {"F32", 32},     {"F64", 64},     {"C64", 64},          {"F8_E4M3", 8},
      {"F8_E5M2", 8},  {"F8_E8M0", 8},  {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8}, {"F4", 4},
      {"F6_E2M3", 6},  {"F6_E3M2", 6}};
  return bits.at(d);
}

std::vector<std::uint8_t> raw_file_with_length(std::uint64_t declared, const std::string& header,
                                               const std::vector<std::uint8_t>& data) {
  std::vector<std::uint8_t> out(8);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::uint8_t>(declared >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<std::uint8_t> raw_file(const std::string& header, const std::vector<std::uint8_t>& data) {
  return raw_file_with_length(header.size(), header, data);
}

std::vector<std::uint8_t> FileImage::bytes() const { return raw_file(header_json, data); }

FileImage make_image(const std::vector<TensorSpec>& tensors, std::mt19937_64& rng, std::size_t pad_to,
                     const std::string& metadata_json) {
  FileImage image;
  std::ostringstream h;
  h << "{";
  bool first = true;
  if (!metadata_json.empty()) {
    h << "\"__metadata__\":" << metadata_json;
    first = false;
  }
  std::uint64_t offset = 0;
  for (const TensorSpec& t : tensors) {
    std::uint64_t numel = 1;
    for (auto d : t.shape) numel *= d;
    const std::uint64_t nbytes = numel * spec_bits(t.dtype) / 8;
    if (!first) h << ",";
    first = false;
    h << "\"" << t.name << "\":{\"dtype\":\"" << t.dtype << "\",\"shape\":[";
    for (std::size_t i = 0; i < t.shape.size(); ++i) h << (i ? "," : "") << t.shape[i];
    h << "],\"data_offsets\":[" << offset << "," << offset + nbytes << "]}";
    for (std::uint64_t i = 0; i < nbytes; ++i) image.data.push_back(static_cast<std::uint8_t>(rng()));
    offset += nbytes;
  }
  h << "}";
  image.header_json = h.str();
  if (pad_to > 1) {
    const std::size_t total = 8 + image.header_json.size();
    image.header_json.append((pad_to - total % pad_to) % pad_to, ' ');
  }
  return image;
}

void write_file(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::vector<std::uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(in), {});
}

FileImage write_random_checkpoint(const std::string& path, std::mt19937_64& rng, int count,
                                  std::uint64_t max_elements, const std::string& name_prefix) {
  static const char* kDtypes[] = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "BF16",
                                  "F32", "F64", "C64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ",
                                  "F8_E5M2FNUZ", "F4", "F6_E2M3", "F6_E3M2"};
  std::vector<TensorSpec> specs;
  for (int i = 0; i < count; ++i) {
    TensorSpec t;
    t.name = name_prefix + std::to_string(i) + ".weight";
    t.dtype = kDtypes[rng() % std::size(kDtypes)];
    const int rank = static_cast<int>(rng() % 4);
    std::uint64_t numel = 1;
    for (int r = 0; r < rank; ++r) {
      std::uint64_t d = 1 + rng() % 64;
      if (numel * d > max_elements) d = 1;
      t.shape.push_back(d);
      numel *= d;
    }
    // Sub-byte types must end on a whole byte: make the element count a multiple of 4.
    if (spec_bits(t.dtype) < 8) t.shape.push_back(4);
    specs.push_back(t);
  }
  FileImage image = make_image(specs, rng, rng() % 2 ? 8 : 1);
  write_file(path, image.bytes());
  return image;
}

int open_fd_count() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

int thread_count() {
  // Sanitizer runtimes start a helper thread with the process's first
  // pthread_create (TSan's background thread). Start one here, once, so that
  // no baseline is taken before it exists.
  static const bool warmed_up = [] {
    std::thread([] {}).join();
    return true;
  }();
  (void)warmed_up;
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

int stable_thread_count() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  int last = thread_count();
  for (int same = 0; same < 5 && std::chrono::steady_clock::now() < deadline;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const int n = thread_count();
    same = n == last ? same + 1 : 0;
    last = n;
  }
  return last;
}

int settled_thread_count(int expected) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  int n = thread_count();
  while (n > expected && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    n = thread_count();
  }
  return n;
}

}  // namespace pinload::testing
