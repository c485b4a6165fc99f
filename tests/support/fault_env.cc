#include "fault_env.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <thread>

namespace pinload::testing {

int FaultEnv::open_read(const std::string& path, int extra_flags) {
  const bool direct = (extra_flags & O_DIRECT) != 0;
  if (direct && faults_.refuse_direct_open) return -EINVAL;
  if (faults_.refuse_open) return -ENOENT;
  const int fd = EnvWrapper::open_read(path, extra_flags);
  if (fd >= 0) {
    std::lock_guard lock(mu_);
    open_.insert(fd);
    if (direct) {
      direct_.insert(fd);
      direct_opens_++;
    }
  }
  return fd;
}

int FaultEnv::close(int fd) {
  {
    std::lock_guard lock(mu_);
    open_.erase(fd);
    direct_.erase(fd);
    direct_read_once_.erase(fd);
  }
  return EnvWrapper::close(fd);
}

std::int64_t FaultEnv::pread(int fd, void* buffer, std::size_t bytes, std::uint64_t offset) {
  const std::uint64_t n = ++reads_;
  if (faults_.read_delay_us) std::this_thread::sleep_for(std::chrono::microseconds(faults_.read_delay_us));
  if (faults_.eintr_every_other && n % 2 == 1) return -EINTR;
  if (faults_.fail_read_at != 0 && n == faults_.fail_read_at) return -faults_.read_errno;
  if (faults_.refuse_direct_first_read) {
    std::lock_guard lock(mu_);
    if (direct_.count(fd) && direct_read_once_.insert(fd).second) return -EINVAL;
  }
  if (faults_.short_read_bytes) bytes = std::min<std::size_t>(bytes, faults_.short_read_bytes);
  if (faults_.truncate_to != UINT64_MAX) {
    if (offset >= faults_.truncate_to) return 0;
    bytes = std::min<std::size_t>(bytes, faults_.truncate_to - offset);
  }
  const std::int64_t got = EnvWrapper::pread(fd, buffer, bytes, offset);
  if (got > 0) bytes_read_ += static_cast<std::uint64_t>(got);
  return got;
}

int FaultEnv::open_write(const std::string& path, int flags, unsigned mode) {
  if (faults_.refuse_open_write) return -EIO;
  const int fd = EnvWrapper::open_write(path, flags, mode);
  if (fd >= 0) {
    std::lock_guard lock(mu_);
    open_.insert(fd);
  }
  return fd;
}

std::int64_t FaultEnv::pwrite(int fd, const void* buffer, std::size_t bytes, std::uint64_t offset) {
  const std::uint64_t n = ++writes_;
  if (faults_.eintr_every_other && n % 2 == 1) return -EINTR;
  if (faults_.fail_write_at != 0 && n == faults_.fail_write_at) return -faults_.write_errno;
  if (faults_.short_write_bytes) bytes = std::min<std::size_t>(bytes, faults_.short_write_bytes);
  const std::int64_t put = EnvWrapper::pwrite(fd, buffer, bytes, offset);
  if (put > 0) bytes_written_ += static_cast<std::uint64_t>(put);
  return put;
}

int FaultEnv::sync(int fd) { return faults_.refuse_sync ? -EIO : EnvWrapper::sync(fd); }

int FaultEnv::rename(const std::string& from, const std::string& to) {
  return faults_.refuse_rename ? -EXDEV : EnvWrapper::rename(from, to);
}

const void* FaultEnv::map_file(int fd, std::size_t bytes, int* err) {
  if (faults_.refuse_map_file) {
    *err = ENOMEM;
    return nullptr;
  }
  const void* p = EnvWrapper::map_file(fd, bytes, err);
  if (p != nullptr) {
    std::lock_guard lock(mu_);
    file_maps_[p] = bytes;
    file_mapped_bytes_ += static_cast<std::int64_t>(bytes);
  }
  return p;
}

void* FaultEnv::map_file_private(int fd, std::size_t bytes, int* err) {
  if (faults_.refuse_map_file_private) {
    *err = ENOMEM;
    return nullptr;
  }
  void* p = EnvWrapper::map_file_private(fd, bytes, err);
  if (p != nullptr) ++private_maps_;
  return p;
}

int FaultEnv::populate_read(const void* address, std::size_t bytes) {
  const std::uint64_t n = ++populates_;
  if (faults_.read_delay_us) std::this_thread::sleep_for(std::chrono::microseconds(faults_.read_delay_us));
  if (faults_.eintr_every_other && n % 2 == 1) return -EINTR;
  if (faults_.populate_errno != 0) return -faults_.populate_errno;
  if (faults_.truncate_to != UINT64_MAX) {
    std::lock_guard lock(mu_);
    // The offset of `address` in the mapping that holds it.
    auto it = file_maps_.upper_bound(address);
    if (it != file_maps_.begin()) {
      --it;
      const auto offset = static_cast<std::uint64_t>(static_cast<const char*>(address) -
                                                     static_cast<const char*>(it->first));
      if (offset < it->second && offset + bytes > faults_.truncate_to) return -EFAULT;
    }
  }
  return EnvWrapper::populate_read(address, bytes);
}

void* FaultEnv::map_anonymous(std::size_t bytes, int extra_flags, int* err) {
  if (faults_.fail_map_at != 0 && ++maps_ == faults_.fail_map_at) {
    *err = ENOMEM;
    return nullptr;
  }
  void* p = EnvWrapper::map_anonymous(bytes, extra_flags, err);
  if (p != nullptr) mapped_bytes_ += static_cast<std::int64_t>(bytes);
  return p;
}

int FaultEnv::unmap(void* address, std::size_t bytes) {
  {
    std::lock_guard lock(mu_);
    if (file_maps_.erase(address) != 0) {
      file_mapped_bytes_ -= static_cast<std::int64_t>(bytes);
      return EnvWrapper::unmap(address, bytes);
    }
  }
  mapped_bytes_ -= static_cast<std::int64_t>(bytes);
  return EnvWrapper::unmap(address, bytes);
}

int FaultEnv::lock(void* address, std::size_t bytes) {
  if (faults_.refuse_lock) return -EPERM;
  return EnvWrapper::lock(address, bytes);
}

int FaultEnv::open_fds() const {
  std::lock_guard lock(mu_);
  return static_cast<int>(open_.size());
}

}  // namespace pinload::testing
