// A program outside the pinload tree, built against an installed pinload:
// `consumer_cpu CHECKPOINT OUT` loads CHECKPOINT with pinload::Loader and writes
// what it got for tests/consumers/check.py to compare with safetensors' reader:
// a line per tensor on stdout (name, dtype, shape, bytes; tab-separated, in
// name order) and the tensors' bytes, in the same order, to OUT.
#include <pinload/dtype.h>
#include <pinload/loader.h>
#include <pinload/state_dict.h>

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
    std::vector<const pinload::Tensor*> tensors;
    for (const pinload::Tensor& t : sd) tensors.push_back(&t);
    std::sort(tensors.begin(), tensors.end(), [](auto* a, auto* b) { return a->name() < b->name(); });
    std::ofstream out(argv[2], std::ios::binary);
    for (const pinload::Tensor* t : tensors) {
      std::string shape = "[";
      for (std::size_t i = 0; i < t->shape().size(); ++i) {
        shape += (i ? "," : "") + std::to_string(t->shape()[i]);
      }
      shape += "]";
      std::printf("%s\t%s\t%s\t%llu\n", t->name().c_str(), std::string(pinload::dtype_name(t->dtype())).c_str(),
                  shape.c_str(), static_cast<unsigned long long>(t->nbytes()));
      out.write(reinterpret_cast<const char*>(t->bytes().data()), static_cast<std::streamsize>(t->bytes().size()));
    }
    if (!out.flush()) throw std::runtime_error(std::string("cannot write ") + argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer_cpu: %s\n", e.what());
    return 1;
  }
  return 0;
}
