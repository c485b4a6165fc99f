// Internal: device copies straight from memory the process maps (a file's
// leased mapping of the page cache, a node-store entry), with no staging copy.
//
// Note [Copies from mapped memory]
// A file in the page cache, or a store entry, is already in host memory: the
// one copy that must happen is the DMA. Reading it into pinned pool blocks
// first is a second pass over host memory at memcpy speed, which caps a warm
// device load below the bus where memcpy is not far above it (docs/gpu.md).
// So a device load maps such a file and registers the mapping with the device
// (Device::register_host: CUDA's cudaHostRegister, read-only, so the pages'
// sharing stays) and copies from it:
//  - in chunks of registration_chunk_bytes(): chunk i+1 is registered while
//    chunk i copies (the copies are queued asynchronously, the registration
//    runs on the host), and no copy crosses the end of its registration;
//  - the registrations live as long as the RegisteredMapping, which every
//    host tensor handed out from it holds (block()): a second device load of
//    the same file or entry while its tensors live finds it (find_registered)
//    and registers nothing;
//  - where the driver refuses to register a file-backed mapping, the load
//    reads the file into pinned blocks as before (the staged path), and so
//    does every later load of the process: the refusal is logged once, at
//    debug level, with the driver's reason (file_registration_refused).
//    A store entry is shared memory; where its registration is refused, its
//    chunks copy as from pageable memory.
// On "sim" every registration is recorded and a copy from pageable memory is
// counted as staged (Note [Host copy counts] in device.h), so tests check by
// counts that these paths copy with no staging copy.
//
// Note [Registration chunks]
// A registration costs a fixed amount per call plus an amount per byte (the
// driver pins each page). The first chunk's registration is not hidden behind
// any copy and neither is the last chunk's copy, so chunks are as small as the
// per-call cost allows: the chunk is the size whose per-call cost is
// kRegistrationCallShare of its per-byte cost, rounded to 2 MiB and kept
// within [8 MiB, 256 MiB]. The cost used here is a model (kModelledRegistration:
// 50 us a call, and the H200's mmap + cudaHostRegister of 1 GiB at 5.2 GB/s,
// docs/gpu.md), not a measurement of this machine; scripts/gpu-check.sh
// measures the real one (CudaMeasure.RegistrationCost).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "pinload/checkpoint.h"
#include "pinload/copy_engine.h"
#include "pinload/device.h"
#include "pinload/loader.h"
#include "pinload/pool.h"
#include "pinload/state_dict.h"

namespace pinload::detail {

struct RegistrationCost {
  double seconds_per_call = 0;
  double seconds_per_gb = 0;
};
inline constexpr RegistrationCost kModelledRegistration{50e-6, 1.0 / 5.2};
inline constexpr double kRegistrationCallShare = 0.05;

// Note [Registration chunks].
std::size_t registration_chunk_bytes(const RegistrationCost& cost = kModelledRegistration);

// A mapping registered with one device chunk by chunk as copies reach it.
class RegisteredMapping : public std::enable_shared_from_this<RegisteredMapping> {
 public:
  // `data`: the mapping's first byte (page-aligned), `bytes`: its size in
  // whole pages; `mapping` keeps it alive. `file_backed`: a refused
  // registration ends the copy (the caller reads instead), else the chunks
  // copy unregistered. `register_chunks` false: never registers.
  static std::shared_ptr<RegisteredMapping> make(std::shared_ptr<Block> mapping, const std::byte* data, std::size_t bytes,
                                                 bool file_backed, bool register_chunks = true,
                                                 std::size_t chunk_bytes = registration_chunk_bytes());
  // False once the bytes may no longer be the registered pages (a leased
  // mapping moved out of its file: Note [Leased mappings]); find_registered
  // then makes a later load map afresh. Set before the first copy.
  std::function<bool()> still_valid;
  RegisteredMapping(const RegisteredMapping&) = delete;
  RegisteredMapping& operator=(const RegisteredMapping&) = delete;
  ~RegisteredMapping();

  // The mapping's Block, holding this (and so its registrations) alive.
  std::shared_ptr<Block> block();
  const std::byte* data() const noexcept { return data_; }

  // Queues the copy of mapping[offset, +bytes) to dst[dst_offset, +bytes) on
  // `engine`, chunk by chunk, registering each chunk not registered yet just
  // before its copy. False where a file-backed registration was refused: the
  // copies queued before it complete, nothing after it is queued. Throws what
  // CopyEngine::submit throws.
  bool copy(CopyEngine& engine, std::size_t offset, std::size_t bytes, const std::shared_ptr<DeviceBuffer>& dst,
            std::size_t dst_offset);

 private:
  RegisteredMapping() = default;
  std::shared_ptr<Block> mapping_;
  const std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t chunk_bytes_ = 0;
  bool file_backed_ = false;
  bool register_ = true;
  std::mutex mu_;                                // chunks_, refused_: loads of one mapping at once
  std::uint64_t device_id_ = 0;                  // the device its chunks are registered with
  std::vector<std::shared_ptr<void>> chunks_;    // after mapping_: unregistered before it goes
  bool refused_ = false;
};

// The registered mapping of `key` on `device` that a load before made and
// whose tensors still live, or null. Keys: "file:<path>:<identity>",
// "store:<path>:<identity>".
std::shared_ptr<RegisteredMapping> find_registered(const Device& device, const std::string& key);
void keep_registered(const Device& device, const std::string& key, const std::shared_ptr<RegisteredMapping>& mapping);

// True once a device of this process refused to register a file-backed
// mapping: device loads then read their files (Note [Copies from mapped memory]).
bool file_registration_refused() noexcept;
// Forgets a refusal: for tests, which run loads of both kinds in one process.
void forget_file_registration_refusal() noexcept;

// One device allocation per file of `checkpoint`, its data section. Throws
// OutOfMemoryError naming the file, DeviceError.
std::vector<std::shared_ptr<DeviceBuffer>> allocate_file_buffers(const Checkpoint& checkpoint, Device& device);

// Copies the data section of each file of `checkpoint` from files[i] (every
// one set) to buffers[i] (allocate_file_buffers), and waits for the copies.
// The tensors are on the device and, from the mapping, on the host. nullopt
// where a file-backed registration was refused (every queued copy has
// completed). Throws DeviceError.
std::optional<StateDict> copy_mapped_to_device(const Checkpoint& checkpoint,
                                               const std::vector<std::shared_ptr<RegisteredMapping>>& files,
                                               const std::vector<std::shared_ptr<DeviceBuffer>>& buffers,
                                               Device& device, const CopyOptions& copy);

// The warm device load (Note [Copies from mapped memory]): each local file
// that is in the page cache (at least options.resident_threshold of it under
// ZeroCopy::kAuto; any under kOn) and a lease is granted for is mapped,
// registered and copied to the device from its mapping; the other files are
// loaded by `read` (a checkpoint of just those), and every tensor comes back
// in load order. kCached tensors keep the mapping as their host copy;
// kStreaming ones are on the device only. The mapped files' tensors go to
// counters->ready, and the state dict is empty when counters->stream, as a
// load's. nullopt, having copied nothing that stays, where no file is mapped
// or a file-backed registration is refused (then and from then on the load
// reads its files). Throws what `read`, populate_mapped and the copies throw.
std::optional<StateDict> load_mapped_to_device(const LoadOptions& options, Env* env, const Checkpoint& checkpoint,
                                               Loader::Counters* counters, std::stop_token stop,
                                               const std::function<StateDict(const Checkpoint&)>& read);

}  // namespace pinload::detail
