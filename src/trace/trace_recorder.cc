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

void TraceRecorder::add(const TemplateFile& file, std::uint64_t offset, std::uint64_t length, pid_t reader,
                        bool mapped) {
  ++events_;
  readers_[reader] += 1;
  if (offset >= file.size || length == 0) return;
  const std::uint64_t end = std::min(file.size, offset + std::min(length, file.size));
  const std::uint32_t f = file_index(file);
  add_to(mapped ? mapped_ : read_, f, offset, end);
}

void TraceRecorder::add_to(Ranges& ranges, std::uint32_t f, std::uint64_t offset, std::uint64_t end) {
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
    if (!reads.empty() && reads.back().file == f && reads.back().offset + reads.back().length == b) {
      reads.back().length += e - b;
    } else {
      reads.push_back(TemplateRead{f, b, e - b});
    }
  }
}

IoTemplate TraceRecorder::result() const {
  IoTemplate t;
  t.files = files_;
  t.set(TemplateReads{std::string(kPageCacheDestination), read_.reads});
  if (!mapped_.reads.empty()) t.set(TemplateReads{std::string(kMappedDestination), mapped_.reads});
  return t;
}

std::vector<std::string> TraceRecorder::paths() const {
  std::vector<std::string> out;
  for (const TemplateFile& f : files_) out.push_back(f.path);
  return out;
}

}  // namespace pinload::trace
