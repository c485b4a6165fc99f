// A program outside the pinload tree, built against an installed pinload.
#include <pinload/dtype.h>
#include <pinload/pool.h>
#include <pinload/safetensors.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

int main() {
  const std::string json = R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})";
  std::vector<std::byte> file(8 + json.size() + 4);
  const std::uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<std::byte>(n >> (8 * i));
  std::memcpy(file.data() + 8, json.data(), json.size());
  const pinload::Header header = pinload::parse_safetensors(file, "consumer.safetensors");
  const pinload::TensorInfo* w = header.find("w");
  if (w == nullptr || w->nbytes() != 4 || pinload::dtype_name(w->dtype) != "BF16") return 1;
  auto pool = pinload::Pool::create_default();
  auto block = pool->allocate(1 << 20);
  std::printf("consumer ok: %zu tensor(s), block of %zu bytes\n", header.tensors.size(), block->capacity());
  return 0;
}
