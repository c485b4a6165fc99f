#include "pinload/env.h"

#include <utility>

namespace pinload {

HeldFileEnv::HeldFileEnv(Env* target, std::string path) : EnvWrapper(target), path_(std::move(path)) {
  FileStat st;
  held_ = open_regular_or_throw(target, path_, &st);
  reopen_path_ = "/proc/self/fd/" + std::to_string(held_.get());
}

int HeldFileEnv::open_read(const std::string& path, int extra_flags) {
  if (path != path_) return EnvWrapper::open_read(path, extra_flags);
  return EnvWrapper::open_read(reopen_path_, extra_flags);
}

}  // namespace pinload
