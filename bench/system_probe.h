// bench/system_probe.h: the machine's own limits and state, measured without
// pinload's reader: its description, the page cache, memcpy, a plain read(),
// fio's direct reads, and the first touch of fresh pool memory.
//
// Every function runs on the calling thread (memcpy_gbps starts and joins its
// own) and leaves nothing behind but HugeTlbReservation's sysctl, which its
// destructor restores. Failures of the probes that need a tool or root are
// reported in their result, never thrown, except where noted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "measurement.h"
#include "pinload/host_memory.h"

namespace pinload::bench {

// ---- machine description ----

// A field of /proc/meminfo in bytes, or -1.
std::int64_t meminfo(const std::string& key);

// The first line of a (proc or sys) file; empty if unreadable.
std::string read_first_line(const std::string& path);

// Host name, kernel, CPU, cores, memory, load average, THP and huge-page
// settings, and the filesystem and block device that hold files.front().
json host_info(const std::vector<std::string>& files);

// ---- explicit huge pages for the run ----

// Sets vm.nr_hugepages for the lifetime of the object and restores it after.
class HugeTlbReservation {
 public:
  HugeTlbReservation() = default;
  HugeTlbReservation(const HugeTlbReservation&) = delete;
  HugeTlbReservation& operator=(const HugeTlbReservation&) = delete;
  ~HugeTlbReservation();

  // Asks for `pages`; writes what happened into *report ("error" when not
  // root or the sysctl cannot be written). Returns whether it was set.
  bool set(long pages, json* report);

 private:
  std::string saved_;
};

// ---- page cache ----

// The fraction of the files' bytes in the page cache (sampled, weighted by
// size), or -1 where it cannot be measured.
double residency(const std::vector<std::string>& files, const std::vector<std::uint64_t>& sizes);

struct DropResult {
  std::string method;  // "drop_caches" (root) or "fadvise_dontneed"
  double resident_after = -1;
};

// sync, then `echo 1 > /proc/sys/vm/drop_caches` where that is writable,
// otherwise posix_fadvise(DONTNEED) on every file; measures the residency left.
DropResult drop_caches(const std::vector<std::string>& files, const std::vector<std::uint64_t>& sizes);

// ---- memory and plain reads ----

// memcpy of `bytes` from one prefaulted buffer to another, split over
// `threads`, best of `reps`, in GB/s.
double memcpy_gbps(std::size_t bytes, unsigned threads, int reps);

// One single-threaded read() sweep over the files with a 1 MiB buffer.
// Throws std::runtime_error if a file cannot be opened or read.
Sample buffered_read(const std::vector<std::string>& files);

// ---- fio ----

// One fio direct sequential read configuration (libaio, one job over all the
// files unless `parallel`), as plain data from which the command is built.
struct FioVariant {
  const char* name;
  const char* bs;
  int iodepth;
  bool parallel;  // 4 jobs, each a quarter of the bytes
  bool hugebuf;   // --iomem=shmhuge: buffers in explicit huge pages
};

// fio's direct sequential read of the files: one job over all of them
// (--filename=a:b:..., fio round-robins between the files), so a multi-file
// checkpoint is read with one queue of `iodepth` as deep as asked.
//   "iodepth32", "iodepth1": the reference runs (numjobs=1, libaio, bs 2M);
//   "parallel": 4 jobs x iodepth 8, each reading a quarter of the bytes: what
//               several concurrent streams (as pinload's threads) can get.
//   "iodepth32_hugebuf", "iodepth1_hugebuf": the same with buffers in explicit
//               huge pages (--iomem=shmhuge), where vm.nr_hugepages has room;
//   "iodepth8_bs8M_hugebuf": bs 8M, iodepth 8, huge-page buffers: pinload's
//               default request size and count (8 threads x 8 MiB) in one queue.
inline constexpr FioVariant kFioVariants[] = {
    {"iodepth32", "2M", 32, false, false},        {"iodepth1", "2M", 1, false, false},
    {"parallel", "2M", 8, true, false},           {"iodepth32_hugebuf", "2M", 32, false, true},
    {"iodepth1_hugebuf", "2M", 1, false, true},   {"iodepth8_bs8M_hugebuf", "8M", 8, false, true},
};

// The fio row's name in the summary table.
std::string fio_variant_title(const FioVariant& v);

// Runs fio once (capped at `runtime` seconds if > 0). On failure (fio
// missing, non-zero exit, unparsable output) returns nullopt with *error set.
std::optional<Sample> fio_read(const std::vector<std::string>& files, const FioVariant& variant, int runtime,
                               std::string* error);

// ---- first touch of fresh pool memory ----

struct FirstTouch {
  std::uint64_t reserved_bytes = 0;
  std::uint64_t os_reservations = 0;
  double reserve_seconds = 0;      // Pool::allocate of every block
  double first_touch_seconds = 0;  // one write per 4 KiB page
  bool locked = false;
};

// A fresh pool on `memory` reserving one block per file size (as a load
// would), then touching every page: what a first load pays before its first
// read, with no I/O. The pool and its blocks are released before it returns.
FirstTouch fresh_pool_first_touch(const pinload::LockedMemoryOptions& memory,
                                  const std::vector<std::uint64_t>& sizes);

}  // namespace pinload::bench
