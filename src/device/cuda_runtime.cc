// Opens the CUDA runtime with dlopen (Note [CUDA at run time] in docs/gpu.md).
#include "device/cuda_runtime.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "base/log.h"
#include "pinload/error.h"

namespace pinload::cuda {
namespace {

#define PINLOAD_STRINGIFY_EXPANDED(x) PINLOAD_STRINGIFY(x)
#define PINLOAD_STRINGIFY(x) #x

// The runtime's major version must be the headers': its structures (cudaDeviceProp) and
// symbol versions change between majors.
const std::string kSoname = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);

// Where to look, in order: the file PINLOAD_CUDART names (and nothing else, so a wrong
// setting is an error rather than a silent choice); else the copy already in the process
// (torch's), then the loader's search path (LD_LIBRARY_PATH, ldconfig, pinload's RUNPATH),
// then the toolkit's usual folders.
std::vector<std::string> candidates() {
  if (const char* path = std::getenv("PINLOAD_CUDART"); path != nullptr && *path != '\0') return {path};
  std::vector<std::string> out = {kSoname};
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
    if (const char* home = std::getenv(var); home != nullptr && *home != '\0') {
      out.push_back(std::string(home) + "/lib64/" + kSoname);
    }
  }
  out.push_back("/usr/local/cuda/lib64/" + kSoname);
  out.push_back("/usr/local/cuda-" + std::to_string(CUDART_VERSION / 1000) + "/lib64/" + kSoname);
  return out;
}

struct Loaded {
  Runtime runtime;
  bool ok = false;
  std::string why;
};

Loaded load() {
  Loaded out;
  std::string tried;
  for (const std::string& name : candidates()) {
    void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* err = dlerror();
      tried += (tried.empty() ? "" : "; ") + (err != nullptr ? std::string(err) : name + ": not found");
      continue;
    }
    Runtime& r = out.runtime;
    std::string missing;
#define PINLOAD_CUDART_RESOLVE(f)                                                                \
  r.f = reinterpret_cast<decltype(r.f)>(dlsym(handle, PINLOAD_STRINGIFY_EXPANDED(f)));          \
  if (r.f == nullptr) missing += std::string(missing.empty() ? "" : ", ") + PINLOAD_STRINGIFY_EXPANDED(f);
    PINLOAD_CUDART_FUNCTIONS(PINLOAD_CUDART_RESOLVE)
#undef PINLOAD_CUDART_RESOLVE
    if (!missing.empty()) {
      tried += (tried.empty() ? "" : "; ") + name + " lacks " + missing;
      dlclose(handle);
      continue;
    }
    char path[4096] = {};
    if (dlinfo(handle, RTLD_DI_ORIGIN, path) == 0) {
      r.library = std::string(path) + "/" + (name.find('/') == std::string::npos ? name : name.substr(name.rfind('/') + 1));
    } else {
      r.library = name;
    }
    log::debug("CUDA runtime: {}", r.library);
    out.ok = true;
    return out;  // never closed: device memory and streams outlive any one user
  }
  out.why = "the CUDA runtime (" + kSoname + ") could not be loaded: " + tried +
            " (install torch with CUDA or the CUDA toolkit, or set PINLOAD_CUDART to the library's path)";
  return out;
}

}  // namespace

const Runtime* runtime(std::string* why) noexcept {
  static const Loaded loaded = [] {
    try {
      return load();
    } catch (const std::exception& e) {  // only allocation can throw here
      Loaded failed;
      failed.why = e.what();
      return failed;
    }
  }();
  if (!loaded.ok) {
    if (why != nullptr) *why = loaded.why;
    return nullptr;
  }
  return &loaded.runtime;
}

const Runtime& require_runtime(const std::string& context) {
  std::string why;
  const Runtime* r = runtime(&why);
  if (r == nullptr) throw DeviceError(context + ": " + why);
  return *r;
}

}  // namespace pinload::cuda
