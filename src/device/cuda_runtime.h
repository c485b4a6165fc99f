// Internal: the CUDA runtime API, loaded at run time (Note [CUDA at run time] in
// docs/gpu.md). No pinload binary links libcudart: the first CUDA call opens the
// process's copy (torch's, where torch is loaded) or the toolkit's, through dlopen.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace pinload::cuda {

// Every runtime function pinload calls.
#define PINLOAD_CUDART_FUNCTIONS(X)                                                                               \
  X(cudaGetErrorName)                                                                                              \
  X(cudaGetErrorString) X(cudaGetLastError) X(cudaGetDeviceCount) X(cudaGetDevice) X(cudaSetDevice) X(cudaFree)    \
  X(cudaMalloc) X(cudaHostAlloc) X(cudaFreeHost) X(cudaHostRegister) X(cudaHostUnregister)                         \
  X(cudaGetDeviceProperties) X(cudaDeviceGetPCIBusId) X(cudaDeviceSynchronize) X(cudaStreamCreateWithFlags)        \
  X(cudaStreamDestroy) X(cudaStreamSynchronize) X(cudaStreamQuery) X(cudaStreamWaitEvent)                          \
  X(cudaEventCreateWithFlags) X(cudaEventDestroy) X(cudaEventRecord) X(cudaEventQuery) X(cudaEventSynchronize)     \
  X(cudaMemcpyAsync) X(cudaMemcpy) X(cudaLibraryLoadData) X(cudaLibraryGetKernel) X(cudaLaunchKernel)

// The runtime's entry points, resolved once; members are named as the functions.
struct Runtime {
#define PINLOAD_CUDART_MEMBER(f) decltype(&::f) f = nullptr;
  PINLOAD_CUDART_FUNCTIONS(PINLOAD_CUDART_MEMBER)
#undef PINLOAD_CUDART_MEMBER
  std::string library;  // the file it was opened from, as dlopen reports it
};

// The process's CUDA runtime, opened on first use (thread-safe, never closed).
// Where none can be opened: nullptr, and *why says what was tried.
const Runtime* runtime(std::string* why = nullptr) noexcept;

// As runtime(), but throws DeviceError("<context>: <why>") where there is none.
const Runtime& require_runtime(const std::string& context);

}  // namespace pinload::cuda
