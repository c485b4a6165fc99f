#include "pinload/state_dict.h"

#include "pinload/device.h"
#include "pinload/error.h"

namespace pinload {

void* Tensor::device_data() const noexcept {
  return device_ ? static_cast<std::byte*>(device_->data()) + device_offset_ : nullptr;
}

StateDict::StateDict(std::vector<Tensor> tensors, std::vector<std::pair<std::string, std::string>> metadata)
    : tensors_(std::move(tensors)), metadata_(std::move(metadata)) {
  by_name_.reserve(tensors_.size());
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    by_name_.emplace(tensors_[i].name(), i);  // views into tensors_, which never reallocates
    total_bytes_ += tensors_[i].nbytes();
  }
}

const Tensor* StateDict::find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const Tensor& StateDict::at(std::string_view name) const {
  const Tensor* t = find(name);
  if (t != nullptr) return *t;
  if (files_.empty()) throw NotFoundError("no such tensor in the state dict", ErrorContext{"", std::string(name)});
  if (files_.size() == 1) throw NotFoundError("no such tensor in the file", ErrorContext{files_[0], std::string(name)});
  // Several files: each named, the first few of a long list.
  constexpr std::size_t kNamed = 8;
  std::string which;
  for (std::size_t i = 0; i < files_.size() && i < kNamed; ++i) which += (i ? ", " : "") + files_[i];
  if (files_.size() > kNamed) which += " and " + std::to_string(files_.size() - kNamed) + " more";
  throw NotFoundError("no such tensor in the " + std::to_string(files_.size()) + " files loaded (" + which + ")",
                      ErrorContext{"", std::string(name)});
}

}  // namespace pinload
