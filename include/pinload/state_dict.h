// pinload/state_dict.h: loaded tensors as zero-copy views into pool blocks.
//
// A Tensor is (name, dtype, shape) plus where its bytes are: a range inside a
// host pool Block, a range inside a DeviceBuffer (device.h), or both (a device
// load in cached mode keeps the host copy). It holds a reference to each: the
// memory stays valid while any Tensor (or copy of one) that points into it is
// alive, whatever happens to the StateDict, the Loader or the Pool object.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pinload/dtype.h"
#include "pinload/pool.h"

namespace pinload {

class DeviceBuffer;

class Tensor {
 public:
  // A host tensor: bytes at block[block_offset, +nbytes).
  Tensor(std::string name, DType dtype, std::vector<std::uint64_t> shape, std::shared_ptr<Block> block,
         std::size_t block_offset, std::uint64_t nbytes)
      : name_(std::move(name)), dtype_(dtype), shape_(std::move(shape)), block_(std::move(block)),
        block_offset_(block_offset), nbytes_(nbytes) {}
  // A device tensor: bytes at buffer[device_offset, +nbytes).
  Tensor(std::string name, DType dtype, std::vector<std::uint64_t> shape, std::shared_ptr<DeviceBuffer> buffer,
         std::size_t device_offset, std::uint64_t nbytes)
      : name_(std::move(name)), dtype_(dtype), shape_(std::move(shape)), nbytes_(nbytes),
        device_(std::move(buffer)), device_offset_(device_offset) {}
  // Adds a device placement to a host tensor (both copies stay valid).
  void set_device(std::shared_ptr<DeviceBuffer> buffer, std::size_t device_offset) {
    device_ = std::move(buffer);
    device_offset_ = device_offset;
  }

  const std::string& name() const noexcept { return name_; }
  DType dtype() const noexcept { return dtype_; }
  const std::vector<std::uint64_t>& shape() const noexcept { return shape_; }
  std::uint64_t nbytes() const noexcept { return nbytes_; }
  bool on_host() const noexcept { return block_ != nullptr; }
  bool on_device() const noexcept { return device_ != nullptr; }

  // Host bytes; nullptr / empty when the tensor is only on a device.
  const std::byte* data() const noexcept { return block_ ? block_->data() + block_offset_ : nullptr; }
  std::span<const std::byte> bytes() const noexcept {
    return block_ ? std::span<const std::byte>(data(), static_cast<std::size_t>(nbytes_)) : std::span<const std::byte>();
  }
  // The host block this tensor lives in, and its offset there.
  const std::shared_ptr<Block>& block() const noexcept { return block_; }
  std::size_t block_offset() const noexcept { return block_offset_; }

  // The device buffer (nullptr when host-only), its offset there, and the
  // device address of the first byte (never dereference it on the host).
  const std::shared_ptr<DeviceBuffer>& device_buffer() const noexcept { return device_; }
  std::size_t device_offset() const noexcept { return device_offset_; }
  void* device_data() const noexcept;

 private:
  std::string name_;
  DType dtype_;
  std::vector<std::uint64_t> shape_;
  std::shared_ptr<Block> block_;
  std::size_t block_offset_ = 0;
  std::uint64_t nbytes_;
  std::shared_ptr<DeviceBuffer> device_;
  std::size_t device_offset_ = 0;
};

class StateDict {
 public:
  StateDict() = default;
  // Takes the tensors in load order; names must be unique (the loader
  // guarantees it).
  explicit StateDict(std::vector<Tensor> tensors,
                     std::vector<std::pair<std::string, std::string>> metadata = {});
  StateDict(const StateDict& other) : StateDict(other.tensors_, other.metadata_) { files_ = other.files_; }
  StateDict& operator=(const StateDict& other) { return *this = StateDict(other); }
  StateDict(StateDict&&) noexcept = default;  // moving keeps the names' addresses
  StateDict& operator=(StateDict&&) noexcept = default;

  std::size_t size() const noexcept { return tensors_.size(); }
  bool empty() const noexcept { return tensors_.empty(); }
  auto begin() const noexcept { return tensors_.begin(); }
  auto end() const noexcept { return tensors_.end(); }
  const Tensor& operator[](std::size_t i) const { return tensors_.at(i); }
  // The tensor named `name`, or nullptr.
  const Tensor* find(std::string_view name) const;
  // The tensor named `name`; throws NotFoundError naming the files loaded.
  const Tensor& at(std::string_view name) const;
  std::uint64_t total_bytes() const noexcept { return total_bytes_; }
  // "__metadata__" of the files loaded, merged (first file wins a key).
  const std::vector<std::pair<std::string, std::string>>& metadata() const noexcept { return metadata_; }
  // The files the tensors were read from, in load order: set by the loader, empty in a state
  // dict built by hand.
  const std::vector<std::string>& files() const noexcept { return files_; }
  void set_files(std::vector<std::string> files) { files_ = std::move(files); }

 private:
  std::vector<Tensor> tensors_;
  std::unordered_map<std::string_view, std::size_t> by_name_;
  std::vector<std::pair<std::string, std::string>> metadata_;
  std::vector<std::string> files_;
  std::uint64_t total_bytes_ = 0;
};

}  // namespace pinload
