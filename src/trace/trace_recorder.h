// trace/trace_recorder.h: the reads a traced command made, as an IoTemplate.
//
// A traced template is an IoTemplate (io_template.h, format version 1) with
// one destination, kPageCacheDestination: its reads are the byte ranges the
// consumer read, in the order first read, page-rounded as the kernel reports
// them (Note [Pre-content events]) and clipped to the file; a second
// destination, kMappedDestination, holds the ranges mapped, the same way. Each byte appears
// at most once: a range read again is not recorded again, and a read next to
// the previous one of the same file by the same reader extends it, so the
// template stays small. Every read names its reader (IoTemplate::readers,
// template version 2): the process that read the byte first. Reads of two
// processes are never merged into one range, even when they abut, so each
// range has exactly one reader; a process is a new reader after an exec
// (another command name or executable).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "pinload/io_template.h"

namespace pinload::trace {

inline constexpr std::string_view kPageCacheDestination = "page-cache";
// The ranges mapped (mmap), apart (Note [Mapped or read] in pre_content.h).
inline constexpr std::string_view kMappedDestination = "page-cache-mapped";

// Not thread-safe: one thread (the listener's) adds.
class TraceRecorder {
 public:
  // Records a read of [offset, +length) of `file` (its identity as stat'ed
  // at the read) by `reader`. Reads past the file's end are clipped; empty
  // ones dropped.
  void add(const TemplateFile& file, std::uint64_t offset, std::uint64_t length, const TemplateReader& reader,
           bool mapped = false);

  // The template recorded so far.
  IoTemplate result() const;
  // Bytes recorded (each byte once), readers seen, events added.
  std::uint64_t bytes() const { return bytes_; }
  std::size_t readers() const { return readers_.size(); }
  std::uint64_t events() const { return events_; }
  bool empty() const { return read_.reads.empty() && mapped_.reads.empty(); }
  // The paths recorded, in the order first read or mapped (the order of
  // IoTemplate::files in result()).
  std::vector<std::string> paths() const;

 private:
  std::uint32_t file_index(const TemplateFile& file);
  std::uint32_t reader_index(const TemplateReader& reader);

  std::vector<TemplateFile> files_;
  std::unordered_map<std::string, std::uint32_t> index_;  // path -> files_ index
  struct Ranges {
    std::vector<std::map<std::uint64_t, std::uint64_t>> covered;  // per file: start -> end
    std::vector<TemplateRead> reads;
  };
  void add_to(Ranges& r, std::uint32_t f, std::uint64_t offset, std::uint64_t end, std::uint32_t reader);
  Ranges read_, mapped_;
  std::vector<TemplateReader> readers_;
  std::multimap<std::uint32_t, std::uint32_t> readers_by_pid_;  // pid -> readers_ index
  std::uint64_t bytes_ = 0, events_ = 0;
};

}  // namespace pinload::trace
