// Loads a safetensors checkpoint with pinload and hands its tensors to torch
// without a copy: `pinload_example_torch model.safetensors [cpu|sim|cuda:N]`.
#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include "pinload/device.h"
#include "pinload/loader.h"
#include "pinload/torch.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT [cpu|sim|cuda:N]\n", argv[0]);
    return 2;
  }
  const std::string where = argc > 2 ? argv[2] : "cpu";
  try {
    std::unique_ptr<pinload::Device> device;
    pinload::LoadOptions options;
    if (where != "cpu") {
      device = pinload::open_device(where);
      // Device memory from torch's caching allocator: torch accounts for it.
      if (device->kind() == pinload::DeviceKind::kCuda && pinload::torch_built_with_cuda()) {
        device->set_allocator(pinload::torch_cuda_allocator(std::stoi(where.size() > 5 ? where.substr(5) : "0")));
      }
      options.target.device = device.get();
    }
    pinload::Loader loader(options);
    const pinload::StateDict sd = loader.load({argv[1]});
    // Each at::Tensor aliases pool (or device) memory and keeps it alive.
    for (const auto& [name, tensor] : pinload::to_torch(sd)) {
      std::printf("%s %s %s\n", name.c_str(), c10::toString(tensor.scalar_type()),
                  tensor.sizes().vec().empty() ? "[]" : c10::str(tensor.sizes()).c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
