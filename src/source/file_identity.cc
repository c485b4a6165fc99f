#include "pinload/file_identity.h"

#include "pinload/error.h"

namespace pinload {

std::string FileIdentity::describe() const {
  const std::int64_t ns = mtime_ns % 1'000'000'000;
  std::string frac = std::to_string(ns < 0 ? -ns : ns);
  frac.insert(0, 9 - frac.size(), '0');
  return "device " + std::to_string(device >> 32) + ":" + std::to_string(device & 0xffffffffu) + " inode " +
         std::to_string(inode) + ", " + std::to_string(size) + " bytes, mtime " + std::to_string(mtime_ns / 1'000'000'000) +
         "." + frac;
}

void check_identity(Env* env, int fd, const std::string& path, const FileIdentity& expected) {
  check_identity(stat_or_throw(env, fd, path), path, expected);
}

void check_identity(const FileStat& stat, const std::string& path, const FileIdentity& expected) {
  const FileIdentity now = FileIdentity::of(stat);
  if (now == expected) return;
  throw IoError("file was replaced or modified since its header was read (then " + expected.describe() + "; now " +
                    now.describe() + ")",
                ErrorContext{path});
}

}  // namespace pinload
