// A libtorch program outside the pinload tree, built against an installed
// pinload::torch: `consumer_torch CHECKPOINT OUT` loads CHECKPOINT, hands the
// tensors to torch (pinload::to_torch) and writes what the at::Tensors hold, in
// tests/consumers/cpu/main.cc's format, for tests/consumers/check.py: a line per
// tensor on stdout (name, dtype, shape, bytes) and their bytes to OUT.
#include <pinload/loader.h>
#include <pinload/torch.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s CHECKPOINT OUT\n", argv[0]);
    return 2;
  }
  try {
    const pinload::StateDict sd = pinload::Loader(pinload::LoadOptions{}).load({argv[1]});
    auto tensors = pinload::to_torch(sd);
    std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::ofstream out(argv[2], std::ios::binary);
    for (const auto& [name, tensor] : tensors) {
      if (!tensor.is_cpu() || !tensor.is_contiguous()) throw std::runtime_error(name + ": not a contiguous CPU tensor");
      std::string shape = "[";
      for (std::int64_t i = 0; i < tensor.dim(); ++i) shape += (i ? "," : "") + std::to_string(tensor.size(i));
      shape += "]";
      const auto nbytes = static_cast<unsigned long long>(tensor.nbytes());
      std::printf("%s\t%s\t%s\t%llu\n", name.c_str(), std::string(pinload::dtype_name(sd.at(name).dtype())).c_str(),
                  shape.c_str(), nbytes);
      out.write(static_cast<const char*>(tensor.const_data_ptr()), static_cast<std::streamsize>(nbytes));
    }
    if (!out.flush()) throw std::runtime_error(std::string("cannot write ") + argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer_torch: %s\n", e.what());
    return 1;
  }
  return 0;
}
