// The CPU stand-in device ("sim"): see device.h.
//
// Each stream is a FIFO of copies numbered 1, 2, ... and run in order by a
// thread of its own. An event is a number: it completes once the stream has
// finished the copy of that number (every copy queued before the event). A
// failed copy makes the stream fail from that copy on, as a sticky CUDA error
// would: later copies are skipped, and events at or after it throw.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <new>
#include <optional>
#include <thread>
#include <vector>

#include "base/log.h"
#include "format/dtype_convert.h"
#include "pinload/device.h"
#include "pinload/error.h"
#include "pinload/memory_limit.h"

namespace pinload {
namespace {

constexpr std::size_t kSimAlignment = 4096;
constexpr unsigned char kPoison = 0xA5;  // fresh sim device memory, so a missed copy shows

// Note [Host copy counts] (device.h): what the stand-in saw of the host
// memory it copied from. Shared by the device, its streams and its pinned
// backends, any of which may outlive the others.
struct SimHostState {
  std::mutex mu;
  HostCopyCounts counts;
  // SimDeviceOptions::bus_bytes_per_second: when the bus is free again.
  std::chrono::steady_clock::time_point bus_free_at{};
  std::map<const std::byte*, std::size_t> pinned;  // the pinned backends' live slabs, by start

  // Whether [p, p + bytes) lies in one pinned slab.
  bool pinned_locked(const std::byte* p, std::size_t bytes) const {
    auto it = pinned.upper_bound(p);
    if (it == pinned.begin()) return false;
    --it;
    return p + bytes <= it->first + it->second;
  }
};

// The locked backend, with its slabs recorded as memory copies run from
// directly (a CUDA pinned backend's).
class SimPinnedBackend final : public HostMemoryBackend {
 public:
  SimPinnedBackend(std::unique_ptr<HostMemoryBackend> inner, std::shared_ptr<SimHostState> state)
      : inner_(std::move(inner)), state_(std::move(state)) {}
  HostRange reserve(std::size_t bytes) override {
    HostRange r = inner_->reserve(bytes);
    try {
      std::lock_guard lock(state_->mu);
      state_->pinned[static_cast<const std::byte*>(r.data)] = r.bytes;
    } catch (...) {
      inner_->release(r);
      throw;
    }
    return r;
  }
  void release(const HostRange& range) noexcept override {
    {
      std::lock_guard lock(state_->mu);
      state_->pinned.erase(static_cast<const std::byte*>(range.data));
    }
    inner_->release(range);
  }
  std::size_t alignment() const noexcept override { return inner_->alignment(); }
  std::string_view name() const noexcept override { return inner_->name(); }

 private:
  std::unique_ptr<HostMemoryBackend> inner_;
  std::shared_ptr<SimHostState> state_;
};

class SimStreamCore {
 public:
  SimStreamCore(std::shared_ptr<const SimDeviceOptions> options, std::string device_name,
                std::shared_ptr<SimHostState> host)
      : options_(std::move(options)), device_name_(std::move(device_name)), host_(std::move(host)) {
    thread_ = std::thread([this] { run(); });
  }
  ~SimStreamCore() { shut_down(); }

  // Lets queued copies finish, then joins. Idempotent.
  void shut_down() {
    {
      std::lock_guard lock(mu_);
      if (stop_) return;
      stop_ = true;
    }
    work_.notify_all();
    thread_.join();
  }

  // `registration`: the register_host range `src` lies in, if any (it must
  // outlive the copy).
  void enqueue_copy(void* dst, const void* src, std::size_t bytes, std::shared_ptr<const void> registration = {}) {
    {
      std::lock_guard lock(mu_);
      throw_if_failed_locked(UINT64_MAX, "cudaMemcpyAsync (sim)");
      if (stop_) throw DeviceError("copy queued on a destroyed sim stream");
      queue_.push_back(Task{++enqueued_, dst, src, bytes, {}, registration, registration != nullptr});
    }
    work_.notify_one();
  }

  // Queues device work other than a copy (a conversion), run in order with
  // the copies; a throw fails the stream as a failed copy does.
  void enqueue_work(std::function<void()> work) {
    {
      std::lock_guard lock(mu_);
      throw_if_failed_locked(UINT64_MAX, "kernel launch (sim)");
      if (stop_) throw DeviceError("work queued on a destroyed sim stream");
      queue_.push_back(Task{++enqueued_, nullptr, nullptr, 0, std::move(work), {}, false});
    }
    work_.notify_one();
  }

  // The number an event recorded now waits for.
  std::uint64_t mark() {
    std::lock_guard lock(mu_);
    throw_if_failed_locked(UINT64_MAX, "cudaEventRecord (sim)");
    return enqueued_;
  }

  bool reached(std::uint64_t seq) {
    std::lock_guard lock(mu_);
    throw_if_failed_locked(seq, "cudaEventQuery (sim)");
    return completed_ >= seq;
  }

  void wait_for(std::uint64_t seq, const char* call) {
    std::unique_lock lock(mu_);
    done_.wait(lock, [&] { return completed_ >= seq; });
    throw_if_failed_locked(seq, call);
  }

  void synchronize() {
    std::uint64_t target;
    {
      std::lock_guard lock(mu_);
      target = enqueued_;
    }
    wait_for(target, "cudaStreamSynchronize (sim)");
  }

  bool idle() {
    std::lock_guard lock(mu_);
    throw_if_failed_locked(UINT64_MAX, "cudaStreamQuery (sim)");
    return completed_ >= enqueued_;
  }

 private:
  struct Task {
    std::uint64_t seq;
    void* dst;
    const void* src;
    std::size_t bytes;
    std::function<void()> work;  // set: a kernel, not a copy
    std::weak_ptr<const void> registration;
    bool registered;  // src lay in a register_host range when the copy was queued
  };

  // Work numbered `seq` or earlier is affected when the failure came at or
  // before it.
  void throw_if_failed_locked(std::uint64_t seq, const char* call) const {
    if (failed_at_ && *failed_at_ <= seq) {
      throw DeviceError(std::string(call) + " failed on " + device_name_ + ": an earlier copy failed: " + error_);
    }
  }

  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      Task task = queue_.front();
      queue_.pop_front();
      const bool skip = failed_at_.has_value();
      lock.unlock();
      std::string error;
      if (!skip) {
        try {
          if (task.work) {
            task.work();
          } else {
            copy(task);
          }
        } catch (const std::exception& e) {
          error = e.what();
          if (error.empty()) error = "copy failed";
        } catch (...) {
          error = "copy failed";
        }
      }
      lock.lock();
      if (!error.empty() && !failed_at_) {
        failed_at_ = task.seq;
        error_ = std::move(error);
      }
      completed_ = task.seq;
      done_.notify_all();
    }
  }

  void copy(const Task& task) {
    const SimDeviceOptions& o = *options_;
    if (o.before_copy) o.before_copy(task.bytes);
    auto delay = std::chrono::duration_cast<std::chrono::nanoseconds>(o.copy_delay);
    if (o.bytes_per_second != 0) {
      delay += std::chrono::nanoseconds(static_cast<std::int64_t>(
          static_cast<double>(task.bytes) * 1e9 / static_cast<double>(o.bytes_per_second)));
    }
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    if (o.bus_bytes_per_second != 0) {
      // Takes the bus after the copies that took it before: done at `until`.
      const auto hold = std::chrono::nanoseconds(static_cast<std::int64_t>(
          static_cast<double>(task.bytes) * 1e9 / static_cast<double>(o.bus_bytes_per_second)));
      std::chrono::steady_clock::time_point until;
      {
        std::lock_guard lock(host_->mu);
        host_->bus_free_at = std::max(host_->bus_free_at, std::chrono::steady_clock::now()) + hold;
        until = host_->bus_free_at;
      }
      std::this_thread::sleep_until(until);
    }
    if (task.registered && task.registration.expired()) {
      {
        std::lock_guard lock(host_->mu);
        host_->counts.expired_copies++;
      }
      throw DeviceError("a copy from host memory whose register_host handle went before the copy ran");
    }
    std::memcpy(task.dst, task.src, task.bytes);
  }

  const std::shared_ptr<const SimDeviceOptions> options_;
  const std::string device_name_;
  const std::shared_ptr<SimHostState> host_;
  std::mutex mu_;
  std::condition_variable work_;  // queue_ grew, or stop_
  std::condition_variable done_;  // completed_ grew
  std::deque<Task> queue_;
  std::uint64_t enqueued_ = 0;
  std::uint64_t completed_ = 0;
  std::optional<std::uint64_t> failed_at_;
  std::string error_;
  bool stop_ = false;
  std::thread thread_;  // last: started once everything above exists
};

class SimStream final : public detail::StreamImpl {
 public:
  SimStream(std::uint64_t device, std::shared_ptr<SimStreamCore> stream_core)
      : StreamImpl(device), core(std::move(stream_core)) {}
  ~SimStream() override { core->shut_down(); }
  void synchronize() override { core->synchronize(); }
  bool query() override { return core->idle(); }
  const std::shared_ptr<SimStreamCore> core;
};

class SimEvent final : public detail::EventImpl {
 public:
  SimEvent(std::shared_ptr<SimStreamCore> core, std::uint64_t seq) : core_(std::move(core)), seq_(seq) {}
  bool query() override { return core_->reached(seq_); }
  void synchronize() override { core_->wait_for(seq_, "cudaEventSynchronize (sim)"); }
  const std::shared_ptr<SimStreamCore>& core() const noexcept { return core_; }
  std::uint64_t seq() const noexcept { return seq_; }

 private:
  std::shared_ptr<SimStreamCore> core_;  // outlives the stream: a joined core still answers
  std::uint64_t seq_;
};

// Host memory standing in for device memory. Freed buffers are kept and
// handed out again (like torch's caching allocator over cudaMalloc), so a
// re-load does not pay page faults that a GPU would not pay either.
class SimAllocator final : public DeviceAllocator {
 public:
  SimAllocator(std::uint64_t limit, bool poison) : limit_(limit), poison_(poison) {}
  ~SimAllocator() override {
    for (auto& [bytes, data] : cached_) ::operator delete(data, std::align_val_t{kSimAlignment});
  }

  void* allocate(std::size_t bytes) override {
    if (bytes == 0) bytes = 1;
    if (limit_ != 0) {
      std::uint64_t used = used_.load(std::memory_order_relaxed);
      do {
        if (bytes > limit_ - used) {
          throw OutOfMemoryError("sim device memory exhausted: " + std::to_string(bytes) + " bytes requested, " +
                                 std::to_string(limit_ - used) + " of " + std::to_string(limit_) + " free");
        }
      } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    }
    void* data = take_cached(bytes);
    if (data == nullptr) {
      // The stand-in's memory is the host's: past the process's memory limit
      // it fails as a full GPU would, instead of the process being OOM-killed
      // when the copies touch it (Note [Memory limits] in memory_limit.h).
      if (const std::optional<HostMemoryLimit> host = read_host_memory_limit(default_env());
          host && bytes > host->available_bytes) {
        if (limit_ != 0) used_.fetch_sub(bytes, std::memory_order_relaxed);
        throw OutOfMemoryError("sim device memory is host memory: " + std::to_string(bytes) +
                               " bytes requested, more than the " + std::to_string(host->available_bytes) +
                               " bytes the memory limit leaves (" + host->source + ")");
      }
      data = ::operator new(bytes, std::align_val_t{kSimAlignment}, std::nothrow);
    }
    if (data == nullptr) {
      if (limit_ != 0) used_.fetch_sub(bytes, std::memory_order_relaxed);
      throw OutOfMemoryError("sim device allocation of " + std::to_string(bytes) + " bytes failed");
    }
    if (poison_) std::memset(data, kPoison, bytes);
    return data;
  }

  void deallocate(void* data, std::size_t bytes) noexcept override {
    if (bytes == 0) bytes = 1;
    if (limit_ != 0) used_.fetch_sub(bytes, std::memory_order_relaxed);
    std::lock_guard lock(mu_);
    try {
      cached_.emplace(bytes, data);
    } catch (...) {
      ::operator delete(data, std::align_val_t{kSimAlignment});
    }
  }

  std::string_view name() const noexcept override { return "sim-host"; }

 private:
  // A cached buffer of exactly `bytes`, or nullptr.
  void* take_cached(std::size_t bytes) {
    std::lock_guard lock(mu_);
    auto it = cached_.find(bytes);
    if (it == cached_.end()) return nullptr;
    void* data = it->second;
    cached_.erase(it);
    return data;
  }

  const std::uint64_t limit_;
  const bool poison_;
  std::atomic<std::uint64_t> used_{0};
  std::mutex mu_;
  std::multimap<std::size_t, void*> cached_;  // freed buffers by size
};

class SimDevice final : public Device {
 public:
  explicit SimDevice(SimDeviceOptions options)
      : options_(std::make_shared<const SimDeviceOptions>(std::move(options))),
        allocator_(std::make_shared<SimAllocator>(options_->memory_bytes, options_->poison)) {}

  const std::string& name() const noexcept override { return name_; }
  std::string description() const override { return "CPU stand-in device (sim): streams are threads, copies memcpy"; }
  DeviceKind kind() const noexcept override { return DeviceKind::kSim; }
  std::string pci_bus_id() const override { return options_->pci_bus_id; }
  int numa_node(const NumaTopology& topology) const override {
    return options_->numa_node >= 0 ? options_->numa_node : Device::numa_node(topology);
  }

  std::unique_ptr<HostMemoryBackend> make_pinned_backend(PinnedMemoryOptions options) override {
    LockedMemoryOptions locked;
    locked.huge_pages = options.huge_pages;
    locked.numa_node = options.numa_node;
    return std::make_unique<SimPinnedBackend>(
        make_locked_memory_backend(options.env != nullptr ? options.env : default_env(), locked), host_);
  }

  HostCopyCounts host_copy_counts() const override {
    std::lock_guard lock(host_->mu);
    return host_->counts;
  }

  std::vector<RegisteredRange> registered_ranges() const override {
    std::vector<RegisteredRange> out;
    std::lock_guard lock(mu_);
    for (const auto& w : registrations_) {
      if (std::shared_ptr<const Registration> r = w.lock()) out.push_back({r->begin, r->bytes});
    }
    return out;
  }

  std::shared_ptr<DeviceAllocator> default_allocator() const override { return allocator_; }

  std::shared_ptr<void> register_host(const void* data, std::size_t bytes, std::string* why) noexcept override {
    if (data == nullptr || bytes == 0) return nullptr;
    try {
      if (options_->refuse_register) {
        if (std::string reason = options_->refuse_register(data, bytes); !reason.empty()) {
          log::debug("sim: register_host of {} bytes refused ({})", bytes, reason);
          if (why != nullptr) *why = std::move(reason);
          std::lock_guard lock(host_->mu);
          host_->counts.registrations_refused++;
          return nullptr;
        }
      }
      auto owned = std::make_unique<Registration>(Registration{static_cast<const std::byte*>(data), bytes});
      if (options_->on_register) options_->on_register(bytes, true);
      // From here the deleter reports the end, also where making the handle fails.
      std::shared_ptr<Registration> r(owned.release(), [options = options_, host = host_](Registration* q) {
        if (options->on_register) options->on_register(q->bytes, false);
        {
          std::lock_guard lock(host->mu);
          host->counts.live_registrations--;
        }
        delete q;
      });
      {
        std::lock_guard lock(host_->mu);
        host_->counts.registrations++;
        host_->counts.registered_bytes += bytes;
        host_->counts.live_registrations++;
      }
      std::lock_guard lock(mu_);
      std::erase_if(registrations_, [](const std::weak_ptr<const Registration>& w) { return w.expired(); });
      registrations_.push_back(r);
      return r;
    } catch (...) {
      return nullptr;
    }
  }

  Stream create_stream() override {
    auto core = std::make_shared<SimStreamCore>(options_, name_, host_);
    {
      std::lock_guard lock(mu_);
      std::erase_if(streams_, [](const std::weak_ptr<SimStreamCore>& w) { return w.expired(); });
      streams_.push_back(core);
    }
    return Stream(std::make_unique<SimStream>(id(), std::move(core)));
  }

  void synchronize() override {
    std::vector<std::shared_ptr<SimStreamCore>> live;
    {
      std::lock_guard lock(mu_);
      for (const auto& w : streams_) {
        if (auto core = w.lock()) live.push_back(std::move(core));
      }
    }
    for (const auto& core : live) core->synchronize();
  }

 protected:
  Event do_record(Stream& stream) override {
    auto& core = static_cast<SimStream*>(stream.impl())->core;
    return Event(std::make_unique<SimEvent>(core, core->mark()));
  }

  void do_copy_to_device_async(void* dst, const void* src, std::size_t bytes, Stream& stream) override {
    std::shared_ptr<const void> registration;
    {
      const auto* from = static_cast<const std::byte*>(src);
      std::lock_guard lock(mu_);
      for (const auto& w : registrations_) {
        std::shared_ptr<const Registration> r = w.lock();
        if (r && from >= r->begin && from + bytes <= r->begin + r->bytes) {
          registration = std::move(r);
          break;
        }
      }
    }
    {
      std::lock_guard lock(host_->mu);
      if (registration || host_->pinned_locked(static_cast<const std::byte*>(src), bytes)) {
        host_->counts.direct_copies++;
        host_->counts.direct_bytes += bytes;
      } else {
        host_->counts.staged_copies++;
        host_->counts.staged_bytes += bytes;
      }
    }
    static_cast<SimStream*>(stream.impl())->core->enqueue_copy(dst, src, bytes, std::move(registration));
  }

  // The conversion a CUDA kernel does, with the host loops, in stream order.
  void do_convert_async(void* dst, const void* src, const ElementConversion& c, Stream& stream) override {
    static_cast<SimStream*>(stream.impl())->core->enqueue_work([dst, src, c, options = options_] {
      if (options->before_convert) options->before_convert(c.elements);
      convert_elements(c, src, dst);
    });
  }

  // A task on `stream` that waits for the event's stream to pass it (work
  // on the same stream is in order already).
  void do_wait(Stream& stream, const Event& event) override {
    auto* e = dynamic_cast<SimEvent*>(event.impl());
    if (e == nullptr) throw InvalidFileError("an event of another device given to sim");
    const auto& core = static_cast<SimStream*>(stream.impl())->core;
    if (e->core() == core) return;
    core->enqueue_work([waited = e->core(), seq = e->seq()] { waited->wait_for(seq, "cudaStreamWaitEvent (sim)"); });
  }

  void do_copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    synchronize();
    std::memcpy(dst, src, bytes);
  }

 private:
  const std::string name_ = "sim";
  const std::shared_ptr<const SimDeviceOptions> options_;
  const std::shared_ptr<SimAllocator> allocator_;
  const std::shared_ptr<SimHostState> host_ = std::make_shared<SimHostState>();
  struct Registration {
    const std::byte* begin;
    std::size_t bytes;
  };
  mutable std::mutex mu_;
  std::vector<std::weak_ptr<SimStreamCore>> streams_;
  std::vector<std::weak_ptr<const Registration>> registrations_;  // register_host's live ranges
};

}  // namespace

std::unique_ptr<Device> make_sim_device(SimDeviceOptions options) {
  return std::make_unique<SimDevice>(std::move(options));
}

}  // namespace pinload
