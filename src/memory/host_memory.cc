#include "pinload/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>

#include "base/log.h"
#include "pinload/error.h"

namespace pinload {
namespace {

constexpr std::size_t kHugePage = 2u << 20;

class LockedMemoryBackend final : public HostMemoryBackend {
 public:
  LockedMemoryBackend(Env* env, LockedMemoryOptions options) : env_(env), options_(options) {}

  HostRange reserve(std::size_t bytes) override {
    HostRange range;
    range.bytes = bytes;
    int err = 0;
    if (options_.huge_pages == HugePages::kExplicit && bytes % kHugePage == 0) {
      range.data = env_->map_anonymous(bytes, MAP_HUGETLB, &err);
      range.huge_pages = range.data != nullptr;
    }
    if (range.data == nullptr) {
      range.data = env_->map_anonymous(bytes, 0, &err);
      if (range.data == nullptr) throw_os_error("cannot map " + std::to_string(bytes) + " bytes of host memory", err);
      if (options_.huge_pages != HugePages::kOff) env_->advise(range.data, bytes, MADV_HUGEPAGE);
    }
    // Before lock(): where mlock2(MLOCK_ONFAULT) is missing, mlock faults every page in.
    if (options_.numa_node >= 0) bind_to_node(range.data, bytes);
    if (options_.lock && !lock_refused_.load(std::memory_order_relaxed)) {
      const int rc = env_->lock(range.data, bytes);
      if (rc == 0) {
        range.locked = true;
      } else if (!lock_refused_.exchange(true)) {
        log::warn("mlock of {} bytes failed ({}); pool memory stays pageable. Raise RLIMIT_MEMLOCK "
                  "(ulimit -l) to lock it.", bytes, log::errno_text(-rc));
      }
    }
    return range;
  }

  void release(const HostRange& range) noexcept override {
    if (range.locked) env_->unlock(range.data, range.bytes);
    env_->unmap(range.data, range.bytes);
  }

  std::size_t alignment() const noexcept override {
    return options_.huge_pages == HugePages::kOff ? static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)) : kHugePage;
  }
  std::string_view name() const noexcept override { return options_.lock ? "locked-host" : "host"; }

 private:
  void bind_to_node(void* data, std::size_t bytes) {
    const int rc = env_->bind_memory(data, bytes, options_.numa_node);
    if (rc != 0 && !bind_refused_.exchange(true)) {
      log::warn("binding pool memory to NUMA node {} failed ({}); its pages go where the OS puts them",
                options_.numa_node, log::errno_text(-rc));
    }
  }

  Env* env_;
  LockedMemoryOptions options_;
  std::atomic<bool> lock_refused_{false};
  std::atomic<bool> bind_refused_{false};
};

}  // namespace

std::unique_ptr<HostMemoryBackend> make_locked_memory_backend(Env* env, LockedMemoryOptions options) {
  return std::make_unique<LockedMemoryBackend>(env, options);
}

}  // namespace pinload
