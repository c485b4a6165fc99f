#include "trace/trace_recorder.h"

#include <algorithm>

namespace pinload::trace {

std::uint32_t TraceRecorder::file_index(const TemplateFile& file) {
  auto it = index_.find(file.path);
  if (it != index_.end() && files_[it->second] == file) return it->second;
  // A new file, or the same path with another identity (replaced while
  // traced): a new entry; the template then fails its identity check on
  // load, which is right, since the two versions can't both be replayed.
  const auto i = static_cast<std::uint32_t>(files_.size());
  files_.push_back(file);
  index_[file.path] = i;
  return i;
}

std::uint32_t TraceRecorder::reader_index(const TemplateReader& reader) {
  auto [b, e] = readers_by_pid_.equal_range(reader.pid);
  for (auto it = b; it != e; ++it) {
    if (readers_[it->second] == reader) return it->second;
  }
  const auto i = static_cast<std::uint32_t>(readers_.size());
  readers_.push_back(reader);
  readers_by_pid_.emplace(reader.pid, i);
  return i;
}

void TraceRecorder::add(const TemplateFile& file, std::uint64_t offset, std::uint64_t length,
                        const TemplateReader& reader, bool mapped) {
  ++events_;
  const std::uint32_t who = reader_index(reader);
  if (offset >= file.size || length == 0) return;
  const std::uint64_t end = std::min(file.size, offset + std::min(length, file.size));
  const std::uint32_t f = file_index(file);
  add_to(mapped ? mapped_ : read_, f, offset, end, who);
}

void TraceRecorder::add_to(Ranges& ranges, std::uint32_t f, std::uint64_t offset, std::uint64_t end,
                           std::uint32_t reader) {
  if (ranges.covered.size() <= f) ranges.covered.resize(f + 1);
  std::map<std::uint64_t, std::uint64_t>& covered = ranges.covered[f];
  std::vector<TemplateRead>& reads = ranges.reads;
  // The parts of [offset, end) not yet covered, in ascending order.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> fresh;
  std::uint64_t at = offset;
  auto it = covered.upper_bound(at);
  if (it != covered.begin()) {
    auto prev = std::prev(it);
    if (prev->second > at) at = prev->second;
  }
  while (at < end) {
    if (it == covered.end() || it->first >= end) {
      fresh.emplace_back(at, end);
      break;
    }
    if (it->first > at) fresh.emplace_back(at, it->first);
    at = std::max(at, it->second);
    ++it;
  }
  for (const auto& [b, e] : fresh) {
    // Covered set: insert and coalesce with neighbours.
    std::uint64_t nb = b, ne = e;
    auto next = covered.lower_bound(nb);
    if (next != covered.begin()) {
      auto prev = std::prev(next);
      if (prev->second == nb) {
        nb = prev->first;
        covered.erase(prev);
      }
    }
    next = covered.find(ne);
    if (next != covered.end()) {
      ne = next->second;
      covered.erase(next);
    }
    covered[nb] = ne;
    if (&ranges == &read_) bytes_ += e - b;
    // Merged only within one reader: each range has exactly one.
    if (!reads.empty() && reads.back().file == f && reads.back().reader == reader &&
        reads.back().offset + reads.back().length == b) {
      reads.back().length += e - b;
    } else {
      reads.push_back(TemplateRead{f, b, e - b, reader});
    }
  }
}

IoTemplate TraceRecorder::result() const {
  IoTemplate t;
  t.files = files_;
  // Only the readers that a read names (one whose reads were all
  // outside the files, or all seen before, is dropped), renumbered in order.
  std::vector<std::uint32_t> renumber(readers_.size(), kNoReader);
  auto used = [&](std::vector<TemplateRead> reads) {
    for (TemplateRead& r : reads) {
      if (renumber[r.reader] == kNoReader) {
        renumber[r.reader] = static_cast<std::uint32_t>(t.readers.size());
        t.readers.push_back(readers_[r.reader]);
      }
      r.reader = renumber[r.reader];
    }
    return reads;
  };
  t.set(TemplateReads{std::string(kPageCacheDestination), used(read_.reads)});
  if (!mapped_.reads.empty()) t.set(TemplateReads{std::string(kMappedDestination), used(mapped_.reads)});
  return t;
}

std::vector<std::string> TraceRecorder::paths() const {
  std::vector<std::string> out;
  for (const TemplateFile& f : files_) out.push_back(f.path);
  return out;
}

}  // namespace pinload::trace
