// Internal: an Env that keeps one file open, so that every later open of its
// path reaches the same file even after the path is replaced.
//
// Note [Holding a file]
// safe_open reads a file's header at open and its data at the first
// get_tensor, which may be much later; the reference safetensors keeps the
// file open (mapped) in between and stays consistent when the path is
// replaced. HeldFileEnv does the same for a pinload load: it opens the file
// once and answers every open_read of that path by reopening the held file
// through /proc/self/fd (a new open file description of the same inode, so
// that O_DIRECT can still be asked for). Identity checks (Note [One version
// per load] in checkpoint.h) then always pass, and header and data come from
// one version of the file. Other paths go to the target Env.
#pragma once

#include <string>

#include "pinload/env.h"

namespace pinload {

class HeldFileEnv final : public EnvWrapper {
 public:
  // Opens `path` (a regular file) through `target` and holds it. Throws as
  // open_regular_or_throw. *target must outlive this Env.
  HeldFileEnv(Env* target, std::string path);

  const std::string& path() const noexcept { return path_; }

  // `path` reopens the held file; anything else goes to the target.
  int open_read(const std::string& path, int extra_flags) override;

 private:
  std::string path_;
  ScopedFd held_;
  std::string reopen_path_;  // /proc/self/fd/<held>
};

}  // namespace pinload
