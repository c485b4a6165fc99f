// Internal: a private mapping of a whole local file that stays safe when the
// file is written or cut short, for zero-copy host loads (Note [Zero-copy
// loads] in loader.h).
//
// Note [Leased mappings]
// safetensors hands out tensors that are views of a mapping of the file, and
// dies of SIGBUS when another process truncates that file. pinload promises
// never to crash, so a mapping it hands out is guarded by a read lease
// (fcntl F_SETLEASE F_RDLCK):
//  - The lease is refused (EAGAIN) while any process, this one included, has
//    the file open for writing (a writable shared mapping keeps its file open
//    for writing). So once it is granted, nobody can change the file without
//    opening it for writing or truncating it by name, and both of those break
//    the lease first: the kernel blocks that open(2) or truncate(2) for up to
//    /proc/sys/fs/lease-break-time seconds (45 by default) and signals the
//    lease's owner.
//  - The owner is one watcher thread (F_SETOWN_EX F_OWNER_TID), which keeps
//    the lease's signal (F_SETSIG, a real-time signal, so that it carries the
//    fd) and SIGIO (the kernel's fallback when real-time signals overflow)
//    blocked and reads them from a signalfd. No handler runs: the one change
//    to the process's signal state is that the chosen real-time signal, unused
//    before (SIG_DFL), is set to SIG_IGN, so that a break in the instant
//    between F_SETLEASE (which makes the whole process the owner) and
//    F_SETOWN_EX is dropped instead of killing the process; that instant is
//    covered by reading F_GETLEASE once the mapping is registered.
//  - On a break the watcher moves the bytes out of the file without changing
//    their address: it maps anonymous memory, copies the mapping into it
//    (pages written by this process since carry their writes: the mapping is
//    copy-on-write), mremap(MREMAP_FIXED)s it over the file mapping, gives the
//    lease up and closes the file. Only then can the writer proceed, so every
//    tensor keeps the bytes of the version it was loaded from.
//    An opener with O_NONBLOCK (coreutils' truncate is one) is not blocked:
//    its open fails with EWOULDBLOCK, the break starts all the same, and it
//    succeeds once the move is done.
//  - A mapping whose lease cannot be taken (not the file's owner and no
//    CAP_LEASE, a writer has it open, a filesystem without leases, leases
//    disabled) is not made: the caller reads the file instead.
// What remains: a write to a tensor during the move may be lost (the copy
// may already have passed that page); a move that outlasts the lease break
// time lets the writer go first, and the copy then stops at a page the file
// lost (SIGBUS caught: mapped_copy.h) and logs the tensors' bytes as lost; a
// child forked while the file is mapped shares the lease but not the
// watcher, and its copy of the mapping is not moved.
//
// Thread safety: any thread may create and drop mappings; the watcher moves a
// mapping while holding the registry's lock, which a mapping's destructor
// takes before unmapping.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "pinload/env.h"
#include "pinload/file_identity.h"
#include "pinload/pool.h"

namespace pinload::detail {

class LeasedMapping : public std::enable_shared_from_this<LeasedMapping> {
 public:
  // Maps all of `path` under a read lease if the file is still `expected`
  // (the version whose header was read). Returns null and sets *why where it
  // cannot; never throws for a refusal (it throws only std::bad_alloc).
  // The file is opened, checked and mapped through `env` (open_read, stat,
  // map_file_private); the lease and the move out use the OS directly, and the
  // mapping may outlive `env`.
  static std::shared_ptr<LeasedMapping> open(Env* env, const std::string& path, const FileIdentity& expected,
                                             std::string* why);
  ~LeasedMapping();
  LeasedMapping(const LeasedMapping&) = delete;
  LeasedMapping& operator=(const LeasedMapping&) = delete;

  std::size_t size() const noexcept { return size_; }
  const std::byte* data() const noexcept { return base_; }
  // A Block spanning the whole file that keeps this mapping alive (tensors
  // point into it as into a pool block).
  std::shared_ptr<Block> block();
  // True once the bytes live in anonymous memory (a lease break, or
  // move_out()).
  bool moved() const noexcept;
  // Moves the bytes out of the file now, as a lease break does, and gives the
  // lease up. For tests and callers that want the file released.
  void move_out();

  // How many mappings hold a lease now, and whether the watcher thread runs.
  static std::size_t live_count() noexcept;
  static bool watcher_running() noexcept;

 private:
  friend class LeaseWatcher;
  LeasedMapping() = default;
  void move_locked() noexcept;  // with the watcher's registry lock held

  std::string path_;
  int fd_ = -1;               // holds the lease; -1 once moved
  std::byte* base_ = nullptr;
  std::size_t size_ = 0;      // file size
  std::size_t mapped_ = 0;    // bytes mapped (>= 1 page)
  bool moved_ = false;
  Block block_{nullptr, 0, 0, false, nullptr};
};

}  // namespace pinload::detail
