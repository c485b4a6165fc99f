// pinload/state_dict.h: loaded tensors as zero-copy views into pool blocks.
//
// A Tensor is (name, dtype, shape) plus a byte range inside a pool Block. It
// holds a reference to that block: the memory stays valid while any Tensor
// (or copy of one) that points into it is alive, whatever happens to the
// StateDict, the Loader or the Pool object.
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

class Tensor {
 public:
  Tensor(std::string name, DType dtype, std::vector<std::uint64_t> shape, std::shared_ptr<Block> block,
         std::size_t block_offset, std::uint64_t nbytes)
      : name_(std::move(name)), dtype_(dtype), shape_(std::move(shape)), block_(std::move(block)),
        block_offset_(block_offset), nbytes_(nbytes) {}

  const std::string& name() const noexcept { return name_; }
  DType dtype() const noexcept { return dtype_; }
  const std::vector<std::uint64_t>& shape() const noexcept { return shape_; }
  std::uint64_t nbytes() const noexcept { return nbytes_; }
  const std::byte* data() const noexcept { return block_->data() + block_offset_; }
  std::span<const std::byte> bytes() const noexcept { return {data(), static_cast<std::size_t>(nbytes_)}; }
  // The block this tensor lives in, and its offset there.
  const std::shared_ptr<Block>& block() const noexcept { return block_; }
  std::size_t block_offset() const noexcept { return block_offset_; }

 private:
  std::string name_;
  DType dtype_;
  std::vector<std::uint64_t> shape_;
  std::shared_ptr<Block> block_;
  std::size_t block_offset_;
  std::uint64_t nbytes_;
};

class StateDict {
 public:
  StateDict() = default;
  // Takes the tensors in load order; names must be unique (the loader
  // guarantees it).
  explicit StateDict(std::vector<Tensor> tensors,
                     std::vector<std::pair<std::string, std::string>> metadata = {});
  StateDict(const StateDict& other) : StateDict(other.tensors_, other.metadata_) {}
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
  // The tensor named `name`; throws NotFoundError.
  const Tensor& at(std::string_view name) const;
  std::uint64_t total_bytes() const noexcept { return total_bytes_; }
  // "__metadata__" of the files loaded, merged (first file wins a key).
  const std::vector<std::pair<std::string, std::string>>& metadata() const noexcept { return metadata_; }

 private:
  std::vector<Tensor> tensors_;
  std::unordered_map<std::string_view, std::size_t> by_name_;
  std::vector<std::pair<std::string, std::string>> metadata_;
  std::uint64_t total_bytes_ = 0;
};

}  // namespace pinload
