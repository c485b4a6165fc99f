// Test support: an Env that injects faults and counts what it forwards.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "pinload/env.h"

namespace pinload::testing {

struct Faults {
  // pread number N (1-based, counting every pread through this env) fails
  // with `read_errno`; 0: never.
  std::uint64_t fail_read_at = 0;
  int read_errno = 5;  // EIO
  // Every pread returns at most this many bytes; 0: no limit.
  std::uint64_t short_read_bytes = 0;
  // Every other pread and populate_read first fails with EINTR.
  bool eintr_every_other = false;
  // open(O_DIRECT) fails with EINVAL.
  bool refuse_direct_open = false;
  // Every open fails with ENOENT, as if the file had gone.
  bool refuse_open = false;
  // The first pread on an O_DIRECT descriptor fails with EINVAL.
  bool refuse_direct_first_read = false;
  // Reads see the file as if cut to this many bytes, and populating a
  // mapping past it fails with EFAULT, as after a real truncation;
  // UINT64_MAX: off.
  std::uint64_t truncate_to = UINT64_MAX;
  // map_file fails with ENOMEM.
  bool refuse_map_file = false;
  // map_file_private (a zero-copy load's mapping) fails with ENOMEM.
  bool refuse_map_file_private = false;
  // Every populate_read fails with this errno; 0: never.
  int populate_errno = 0;
  // Delay every pread and populate_read by this many microseconds.
  std::uint32_t read_delay_us = 0;
  // The Nth map_anonymous (1-based) fails with ENOMEM; 0: never.
  std::uint64_t fail_map_at = 0;
  // lock() fails with EPERM.
  bool refuse_lock = false;
  // The write half. pwrite number N (1-based, counting every pwrite through
  // this env) fails with `write_errno`; 0: never.
  std::uint64_t fail_write_at = 0;
  int write_errno = 28;  // ENOSPC
  // Every pwrite writes at most this many bytes; 0: no limit. With
  // eintr_every_other, every other pwrite first fails with EINTR too.
  std::uint64_t short_write_bytes = 0;
  // open_write, sync (fsync) and rename fail with EIO, EIO and EXDEV.
  bool refuse_open_write = false;
  bool refuse_sync = false;
  bool refuse_rename = false;
};

class FaultEnv : public EnvWrapper {
 public:
  explicit FaultEnv(Faults faults = {}, Env* target = default_env()) : EnvWrapper(target), faults_(faults) {}

  int open_read(const std::string& path, int extra_flags) override;
  int close(int fd) override;
  std::int64_t pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) override;
  const void* map_file(int fd, std::size_t bytes, int* err) override;
  void* map_file_private(int fd, std::size_t bytes, int* err) override;
  int populate_read(const void* address, std::size_t bytes) override;
  void* map_anonymous(std::size_t bytes, int extra_flags, int* err) override;
  int unmap(void* address, std::size_t bytes) override;
  int lock(void* address, std::size_t bytes) override;
  int open_write(const std::string& path, int flags, unsigned mode) override;
  std::int64_t pwrite(int fd, const void* buffer, std::size_t bytes, std::uint64_t offset) override;
  int sync(int fd) override;
  int rename(const std::string& from, const std::string& to) override;

  std::uint64_t reads() const { return reads_; }
  std::uint64_t bytes_read() const { return bytes_read_; }
  std::uint64_t direct_opens() const { return direct_opens_; }
  int open_fds() const;
  std::int64_t mapped_bytes() const { return mapped_bytes_; }         // anonymous memory held
  std::int64_t file_mapped_bytes() const { return file_mapped_bytes_; }  // file mappings held
  std::uint64_t private_maps() const { return private_maps_; }  // map_file_private calls that succeeded
  std::uint64_t populates() const { return populates_; }
  std::uint64_t writes() const { return writes_; }
  std::uint64_t bytes_written() const { return bytes_written_; }

 private:
  Faults faults_;
  std::atomic<std::uint64_t> reads_{0};
  std::atomic<std::uint64_t> bytes_read_{0};
  std::atomic<std::uint64_t> maps_{0};
  std::atomic<std::uint64_t> direct_opens_{0};
  std::atomic<std::int64_t> mapped_bytes_{0};
  std::atomic<std::int64_t> file_mapped_bytes_{0};
  std::atomic<std::uint64_t> private_maps_{0};
  std::atomic<std::uint64_t> populates_{0};
  std::atomic<std::uint64_t> writes_{0};
  std::atomic<std::uint64_t> bytes_written_{0};
  mutable std::mutex mu_;
  std::map<const void*, std::size_t> file_maps_;  // address -> bytes
  std::set<int> open_;
  std::set<int> direct_;
  std::set<int> direct_read_once_;
};

// Forwards everything and remembers which path each open descriptor reads,
// for envs that record reads by (path, offset).
class PathTrackingEnv : public EnvWrapper {
 public:
  explicit PathTrackingEnv(Env* target) : EnvWrapper(target) {}
  int open_read(const std::string& path, int extra_flags) override {
    const int fd = EnvWrapper::open_read(path, extra_flags);
    std::lock_guard lock(paths_mu_);
    if (fd >= 0) paths_[fd] = path;
    return fd;
  }
  int close(int fd) override {
    {
      std::lock_guard lock(paths_mu_);
      paths_.erase(fd);
    }
    return EnvWrapper::close(fd);
  }
  // The path `fd` was opened with; empty when unknown.
  std::string path_of(int fd) const {
    std::lock_guard lock(paths_mu_);
    const auto it = paths_.find(fd);
    return it == paths_.end() ? std::string() : it->second;
  }

 private:
  mutable std::mutex paths_mu_;
  std::map<int, std::string> paths_;
};

}  // namespace pinload::testing
