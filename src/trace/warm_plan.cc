#include "trace/warm_plan.h"

#include <algorithm>

#include "trace/trace_recorder.h"

namespace pinload::trace {

namespace {

WarmPlan cut(const IoTemplate& t, const std::vector<TemplateRead>& reads, std::uint64_t piece_bytes) {
  // Each byte once, through the recorder's bookkeeping.
  TraceRecorder once;
  // One reader for all: the plan merges across readers (it replays bytes, not processes).
  for (const TemplateRead& r : reads) once.add(t.files[r.file], r.offset, r.length, TemplateReader{});
  const IoTemplate unique = once.result();
  WarmPlan plan;
  plan.files = unique.files;
  for (const TemplateRead& r : unique.destinations.front().reads) {
    for (std::uint64_t at = 0; at < r.length; at += piece_bytes) {
      const std::uint64_t n = std::min(piece_bytes, r.length - at);
      plan.pieces.push_back(WarmPiece{r.file, r.offset + at, n});
      plan.bytes += n;
    }
  }
  return plan;
}

}  // namespace

WarmPlan plan_from_template(const IoTemplate& t, std::uint64_t piece_bytes) {
  std::vector<TemplateRead> reads;
  const TemplateReads* traced = t.find(kPageCacheDestination);
  const TemplateReads* mapped = t.find(kMappedDestination);
  if (traced != nullptr || mapped != nullptr) {
    // What was read, then what was mapped of the files never read (an mmap
    // consumer's); a mapping of a file also read was a header peek.
    std::vector<bool> read_file(t.files.size(), false);
    if (traced != nullptr) {
      reads = traced->reads;
      for (const TemplateRead& r : reads) read_file[r.file] = true;
    }
    if (mapped != nullptr) {
      for (const TemplateRead& r : mapped->reads) {
        if (!read_file[r.file]) reads.push_back(r);
      }
    }
  } else if (const TemplateReads* h = t.find(kHostDestination)) {
    reads = h->reads;
  } else {
    for (const TemplateReads& each : t.destinations) reads.insert(reads.end(), each.reads.begin(), each.reads.end());
  }
  return cut(t, reads, std::max<std::uint64_t>(piece_bytes, 1));
}

WarmPlan plan_whole_files(const std::vector<TemplateFile>& files, std::uint64_t piece_bytes) {
  IoTemplate t;
  t.files = files;
  std::vector<TemplateRead> reads;
  for (std::uint32_t i = 0; i < files.size(); ++i) {
    if (files[i].size > 0) reads.push_back(TemplateRead{i, 0, files[i].size});
  }
  return cut(t, reads, std::max<std::uint64_t>(piece_bytes, 1));
}

BurnTracker::BurnTracker(const WarmPlan& plan) : plan_(plan), by_offset_(plan.files.size()), state_(plan.pieces.size()) {
  for (std::size_t i = 0; i < plan.pieces.size(); ++i) by_offset_[plan.pieces[i].file][plan.pieces[i].offset] = i;
}

void BurnTracker::make_resident(std::size_t i) {
  if (state_[i].resident || state_[i].dropped) return;
  state_[i].resident = true;
  resident_ += plan_.pieces[i].length;
}

void BurnTracker::on_warmed(std::size_t i) { make_resident(i); }

std::vector<std::size_t> BurnTracker::on_consumer_read(std::uint32_t file, std::uint64_t offset, std::uint64_t length) {
  std::vector<std::size_t> drop;
  if (file >= by_offset_.size() || length == 0) return drop;
  const std::uint64_t end = offset + length;
  std::vector<std::size_t> hit;
  const auto& pieces = by_offset_[file];
  auto it = pieces.upper_bound(offset);
  if (it != pieces.begin()) --it;
  for (; it != pieces.end() && it->first < end; ++it) {
    const std::size_t i = it->second;
    const WarmPiece& p = plan_.pieces[i];
    const std::uint64_t b = std::max(offset, p.offset), e = std::min(end, p.offset + p.length);
    if (b >= e) continue;
    hit.push_back(i);
    PieceState& s = state_[i];
    s.touched = true;
    make_resident(i);
    s.covered = std::min(p.length, s.covered + (e - b));
  }
  // What finished at an earlier read and isn't read now goes.
  std::vector<std::size_t> still;
  for (std::size_t i : done_pending_) {
    if (std::find(hit.begin(), hit.end(), i) != hit.end()) {
      still.push_back(i);
      continue;
    }
    PieceState& s = state_[i];
    s.dropped = true;
    if (s.resident) resident_ -= plan_.pieces[i].length;
    s.resident = false;
    dropped_ += plan_.pieces[i].length;
    drop.push_back(i);
  }
  done_pending_ = std::move(still);
  for (std::size_t i : hit) {
    PieceState& s = state_[i];
    if (!s.done && s.covered >= plan_.pieces[i].length) {
      s.done = true;
      done_pending_.push_back(i);
    }
  }
  return drop;
}

}  // namespace pinload::trace
