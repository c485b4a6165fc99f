// trace/pre_content.h: fanotify pre-content events (Linux >= 6.14), the
// kernel's report of every read of a marked file, with its byte range and
// reader, before the read is served.
//
// Note [Pre-content events]
// A group made with FAN_CLASS_PRE_CONTENT and a mark for FAN_PRE_ACCESS gets
// one permission event per read(2)/pread(2) and per mmap(2) of a marked file
// (for a directory marked with FAN_EVENT_ON_CHILD: of a file in it). The
// event carries an info record FAN_EVENT_INFO_TYPE_RANGE with the range, in
// whole pages (measured on 6.18/ext4: pread of 100 bytes at 5000 arrives as
// off=4096 count=4096; a read near the end may run past it), a read of cached
// pages included; an mmap arrives once, covering the mapping, and its page
// faults arrive not at all; readahead(2) and posix_fadvise(2) arrive not at
// all. A write(2) is reported the same way (the event does not say which),
// so a traced template also holds what the command wrote under the roots;
// and a listener must never write into a folder it watches from the thread
// that answers. The reader blocks until the group answers, so the listener answers
// FAN_ALLOW to every event at once, before it looks at it. When the group's
// descriptor closes (the listener exits or crashes), the kernel allows every
// pending event: a dead listener never blocks a reader.
// The kernel decides at open(2) whether a file reports these events: a file
// opened before any group watched its filesystem reports nothing, ever.
// Listening needs CAP_SYS_ADMIN; the filesystem must support it (ext4, xfs
// and btrfs do; tmpfs, measured on 6.18, does not: EOPNOTSUPP); otherwise
// fanotify_init or fanotify_mark fails with the reason.
//
// Note [Mapped or read]
// The event does not say whether a read or an mmap caused it, and the two
// must differ: safetensors (0.8) maps every file it opens, to read the
// header through the mapping, even with backend="pread", which then reads
// the tensors with pread(2); a template of that mapping would say "the whole
// file". So the group reports thread ids (FAN_REPORT_TID), and before an
// event is allowed the listener reads the reader's current system call from
// /proc/<tid>/syscall (a few microseconds; the thread is blocked in it, or
// about to be, which the file shows as "running" and is asked again): mmap,
// or a page fault outside any system call, is a mapping; anything else a read.
//
// Note [Naming the reader]
// A template names the process behind each read (TemplateReader in
// io_template.h). With FAN_REPORT_TID the event carries the thread id only,
// so its process id, command name (both from /proc/<tid>/status, one read)
// and executable (/proc/<tid>/exe) are looked up before the event is
// allowed, while the thread is still blocked in its read: after the allow, a
// short reader (cat) may already be gone. This adds one /proc read and one
// readlink per event to the reader's wait, a few microseconds; the tracing
// overhead row of docs/trace.md measures the total.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace pinload::trace {

struct ReadEvent {
  pid_t pid = 0;      // the reader's process (thread group) id
  pid_t tid = 0;      // the reader's thread
  // The reader's command name and executable, looked up before the event is
  // allowed (the reader is blocked in the read then, so a short-lived reader
  // such as cat can't exit first; Note [Naming the reader]); "" if unknown.
  std::string comm;
  std::string exe;
  bool mapped = false;  // an mmap(2), not a read(2)/pread(2) (Note [Mapped or read])
  int fd = -1;        // the file, opened by the kernel; valid during the callback only
  std::uint64_t offset = 0;
  std::uint64_t length = 0;  // page-rounded by the kernel
};

// One fanotify pre-content group. Not thread-safe: one thread calls poll();
// other threads may read files meanwhile (their events are answered by poll).
class PreContentListener {
 public:
  // A group, or nullptr with the reason in *why (no CAP_SYS_ADMIN, a kernel
  // without pre-content events, ...).
  static std::unique_ptr<PreContentListener> open(std::string* why);
  ~PreContentListener();
  PreContentListener(const PreContentListener&) = delete;
  PreContentListener& operator=(const PreContentListener&) = delete;

  // Marks `dir` so that reads of the files directly in it report (not
  // recursive; mark_tree is). 0, or -errno (EOPNOTSUPP: the filesystem
  // lacks pre-content events).
  int mark_directory(const std::string& dir);
  // Marks `root` and every folder below it, never following a symlink.
  // Folders already marked (in *marked) are skipped; new ones are added.
  // Returns how many folders it marked, or -errno of the first failure.
  int mark_tree(const std::string& root, std::vector<std::string>* marked);

  // Waits up to timeout_ms for events, allows each at once, then calls
  // on_read for it. Returns the number of events, 0 on timeout, -errno on
  // failure (-EINTR: a signal; call again).
  int poll(int timeout_ms, const std::function<void(const ReadEvent&)>& on_read);

  int fd() const { return group_; }

 private:
  explicit PreContentListener(int group) : group_(group) {}
  int group_;
};

// The system call thread `tid` is blocked in (/proc/<tid>/syscall): its
// number; kOutsideSyscalls where it is blocked outside any (the kernel's -1:
// a page fault on a mapping); kSyscallUnknown where it is gone or still
// running after some 20 ms of asking.
inline constexpr long kOutsideSyscalls = -1;
inline constexpr long kSyscallUnknown = -2;
long blocked_syscall(pid_t tid);

// Whether pre-content events work for files under `dir`: "" when they do,
// else the reason (the kernel's, the filesystem's or the privilege's).
std::string pre_content_unavailable_reason(const std::string& dir);

// The path of an open descriptor (readlink of /proc/self/fd/N), "" if none.
std::string path_of_fd(int fd);

// `root` with symlinks resolved, absolute and normalized.
std::string canonical_root(const std::string& root);

// Whether `path` (absolute, normalized) is `root` or below it.
bool path_is_under(const std::string& path, const std::string& root);

// Whether `pid` is `ancestor` or one of its descendants (from /proc).
bool is_descendant(pid_t pid, pid_t ancestor);

}  // namespace pinload::trace
