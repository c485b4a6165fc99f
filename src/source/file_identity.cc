#include "pinload/file_identity.h"

#include "pinload/error.h"

namespace pinload {

namespace {

std::string seconds(std::int64_t ns) {
  const std::int64_t part = ns % 1'000'000'000;
  std::string frac = std::to_string(part < 0 ? -part : part);
  frac.insert(0, 9 - frac.size(), '0');
  return std::to_string(ns / 1'000'000'000) + "." + frac;
}

}  // namespace

std::string FileIdentity::describe() const {
  std::string out = "device " + std::to_string(device >> 32) + ":" + std::to_string(device & 0xffffffffu) + " inode " +
                    std::to_string(inode) + ", " + std::to_string(size) + " bytes, mtime " + seconds(mtime_ns);
  if (ctime_ns != 0) out += ", ctime " + seconds(ctime_ns);
  if (generation != 0) out += ", generation " + std::to_string(generation);
  return out;
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
