// pinload/torch.h: loaded tensors as at::Tensors, without a copy (pinload::torch).
//
// The only pinload header that includes torch; link the `pinload::torch`
// target (docs/torch.md). pinload::core stays torch-free.
//
// Note [Aliasing]
// to_torch wraps the tensor's memory with at::from_blob: the at::Tensor's
// data_ptr is the pool block (host) or the DeviceBuffer (device) itself. Its
// deleter holds a reference to that block or buffer, so the at::Tensor keeps
// the memory alive on its own: the StateDict, the Loader and the Pool object
// may go first. The memory goes back to the pool when the last pinload::Tensor
// and the last at::Tensor (and view of one) that point into it are gone.
// Writes through the at::Tensor change the pool memory that every other view
// of the same bytes sees.
//
// Note [Placement]
// A host tensor becomes a CPU tensor (pinned or not: torch is not told).
// A device tensor becomes a CUDA tensor on the ordinal that owns the memory
// when torch has CUDA and the memory is CUDA device memory; memory of the
// "sim" device is host memory, so a sim device tensor becomes a CPU tensor
// aliasing the sim DeviceBuffer. Where the adapter cannot tell (a torch
// without CUDA, in a process where pinload's CUDA layer sees a GPU) it throws
// DeviceError rather than hand out a CPU tensor over device memory.
//
// Note [Dtypes]
// Every safetensors dtype that torch has maps to its torch dtype: BOOL, U8,
// I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64, C64 (ComplexFloat),
// F8_E4M3 (Float8_e4m3fn), F8_E5M2 (Float8_e5m2), F8_E8M0 (Float8_e8m0fnu),
// F8_E4M3FNUZ, F8_E5M2FNUZ. F4 and F6_* have no torch dtype: to_torch throws
// InvalidFileError naming the tensor. Tensors are contiguous (row-major) and
// zero-size tensors become empty tensors of the right shape (no aliasing).
#pragma once

#include <ATen/ATen.h>
#include <torch/ordered_dict.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pinload/device.h"
#include "pinload/dtype.h"
#include "pinload/state_dict.h"

namespace pinload {

enum class TorchPlacement {
  kAuto,    // the device copy when the tensor has one, else the host copy
  kHost,    // the host copy (InvalidArgumentError when the tensor is device-only)
  kDevice,  // the device copy (InvalidArgumentError when the tensor is host-only)
};

// The torch dtype of `dtype`; nullopt for F4 and F6_*.
std::optional<at::ScalarType> torch_dtype(DType dtype) noexcept;

// `t` as an at::Tensor aliasing its memory (Note [Aliasing], [Placement]).
// Throws InvalidFileError (dtype without a torch equivalent, shape beyond
// int64), InvalidArgumentError (a placement the tensor lacks), DeviceError (see Note [Placement]).
at::Tensor to_torch(const Tensor& t, TorchPlacement where = TorchPlacement::kAuto);

// Every tensor of `sd`, in its (file) order.
std::vector<std::pair<std::string, at::Tensor>> to_torch(const StateDict& sd,
                                                         TorchPlacement where = TorchPlacement::kAuto);
// The same as a torch::OrderedDict (what torch::nn::Module::named_parameters
// returns), and as a map.
torch::OrderedDict<std::string, at::Tensor> to_torch_ordered_dict(const StateDict& sd,
                                                                  TorchPlacement where = TorchPlacement::kAuto);
std::unordered_map<std::string, at::Tensor> to_torch_map(const StateDict& sd,
                                                         TorchPlacement where = TorchPlacement::kAuto);

// Whether this build of pinload::torch has torch_cuda_allocator (torch was
// built with CUDA).
bool torch_built_with_cuda() noexcept;

// A DeviceAllocator over torch's CUDA caching allocator for the CUDA device
// `ordinal` (Device::set_allocator on the pinload Device of that ordinal), so
// that pinload's device memory is counted and reused by torch
// (torch.cuda.memory_allocated, empty_cache). Memory comes from
// c10::cuda::CUDACachingAllocator::raw_alloc_with_stream on torch's current
// stream of that device and goes back with raw_delete. Loads synchronize
// their copies before returning, so the memory is ready on every stream; a
// caller using it on another torch stream records that itself. Throws
// DeviceError when torch has no CUDA (torch_built_with_cuda() is false) or
// the ordinal is out of range.
std::shared_ptr<DeviceAllocator> torch_cuda_allocator(int ordinal = 0);

}  // namespace pinload
