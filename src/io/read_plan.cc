#include "pinload/read_plan.h"

#include <algorithm>
#include <utility>

namespace pinload {

// Note [Tapered tail] in read_plan.h.
void taper_tail(ReadPlan& plan, const PlanOptions& options) {
  if (options.taper_bytes == 0 || options.taper_block_size == 0 || plan.total_bytes <= 4 * options.taper_bytes) return;
  // Back to front: taper_bytes in chunks of taper_block_size, the 2 x
  // taper_bytes before them in chunks twice that, and so on up to block_size.
  std::vector<ReadChunk> tail;  // back to front
  std::size_t first = plan.chunks.size();
  std::uint64_t step = options.taper_block_size, region = options.taper_bytes, region_end = options.taper_bytes;
  std::uint64_t covered = 0;
  while (first > 0 && step < options.block_size) {
    const ReadChunk& c = plan.chunks[--first];
    const FileRead& f = plan.files[c.file];
    const std::uint64_t align = std::max<std::uint32_t>(f.alignment, 1);
    const std::uint64_t piece_step = std::max<std::uint64_t>(align, step / align * align);
    const std::size_t at_end = tail.size();
    for (std::uint64_t at = c.offset; at < c.offset + c.length; at += piece_step) {
      ReadChunk piece = c;
      piece.offset = at;
      piece.length = std::min(piece_step, c.offset + c.length - at);
      piece.valid = std::min(at + piece.length, f.file_size) - at;  // at < file_size: read_end - file_size < align
      tail.push_back(piece);
    }
    std::reverse(tail.begin() + static_cast<std::ptrdiff_t>(at_end), tail.end());
    covered += c.length;
    while (covered >= region_end && step < options.block_size) {
      step *= 2;
      region *= 2;
      region_end += region;
    }
  }
  std::vector<ReadChunk> chunks(plan.chunks.begin(), plan.chunks.begin() + static_cast<std::ptrdiff_t>(first));
  chunks.insert(chunks.end(), tail.rbegin(), tail.rend());
  std::vector<std::uint32_t> count(plan.files.size(), 0);
  for (ReadChunk& c : chunks) c.index = count[c.file]++;  // each file's chunks stay in offset order
  for (std::size_t i = 0; i < plan.files.size(); ++i) plan.files[i].chunk_count = count[i];
  plan.chunks = std::move(chunks);
}

ReadPlan make_read_plan(std::vector<FileRead> files, const PlanOptions& options) {
  ReadPlan plan;
  std::vector<std::vector<ReadChunk>> per_file(files.size());
  for (std::size_t i = 0; i < files.size(); ++i) {
    FileRead& f = files[i];
    const std::uint64_t align = std::max<std::uint32_t>(f.alignment, 1);
    f.read_begin = f.data_offset / align * align;
    f.read_end = (f.file_size + align - 1) / align * align;
    const std::uint64_t step = std::max<std::uint64_t>(align, options.block_size / align * align);
    for (std::uint64_t at = f.read_begin; at < f.file_size; at += step) {
      ReadChunk c;
      c.file = static_cast<std::uint32_t>(i);
      c.index = static_cast<std::uint32_t>(per_file[i].size());
      c.offset = at;
      c.length = std::min(step, f.read_end - at);
      c.valid = std::min(at + c.length, f.file_size) - at;
      plan.total_bytes += c.valid;
      per_file[i].push_back(c);
    }
    f.chunk_count = static_cast<std::uint32_t>(per_file[i].size());
  }
  // Interleave `files_in_flight` files at a time, round-robin by chunk.
  const std::size_t lanes = std::max<std::size_t>(options.files_in_flight, 1);
  std::size_t next_file = 0;
  std::vector<std::size_t> active, cursor(files.size(), 0);
  while (next_file < files.size() || !active.empty()) {
    while (active.size() < lanes && next_file < files.size()) active.push_back(next_file++);
    for (std::size_t k = 0; k < active.size();) {
      const std::size_t f = active[k];
      if (cursor[f] < per_file[f].size()) {
        plan.chunks.push_back(per_file[f][cursor[f]++]);
        ++k;
      } else {
        active.erase(active.begin() + static_cast<std::ptrdiff_t>(k));
      }
    }
  }
  plan.files = std::move(files);
  taper_tail(plan, options);
  return plan;
}

std::optional<ReadPlan> replay_plan(const ReadPlan& plan, std::span<const TemplateRead> reads) {
  std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> spans(plan.files.size());
  ReadPlan out;
  out.files = plan.files;
  out.chunks.reserve(reads.size());
  for (const TemplateRead& r : reads) {
    if (r.file >= plan.files.size()) return std::nullopt;
    const FileRead& f = plan.files[r.file];
    const std::uint64_t align = std::max<std::uint32_t>(f.alignment, 1);
    if (r.length == 0 || r.offset < f.read_begin || r.offset >= f.file_size || r.offset % align != 0 ||
        r.length > f.read_end - r.offset || (r.offset + r.length) % align != 0) {
      return std::nullopt;
    }
    spans[r.file].emplace_back(r.offset, r.offset + r.length);
    ReadChunk c;
    c.file = r.file;
    c.offset = r.offset;
    c.length = r.length;
    c.valid = std::min(r.offset + r.length, f.file_size) - r.offset;
    out.total_bytes += c.valid;
    out.chunks.push_back(c);
  }
  for (std::size_t i = 0; i < spans.size(); ++i) {
    std::sort(spans[i].begin(), spans[i].end());
    const FileRead& f = plan.files[i];
    std::uint64_t at = f.read_begin;
    for (const auto& [begin, end] : spans[i]) {
      if (begin != at) return std::nullopt;
      at = end;
    }
    const std::uint64_t expected_end = f.file_size > f.read_begin ? f.read_end : f.read_begin;
    if (at != expected_end) return std::nullopt;
  }
  // Tiled: a chunk's index is the rank of its offset in its file.
  for (FileRead& f : out.files) f.chunk_count = 0;
  for (ReadChunk& c : out.chunks) {
    const auto& sp = spans[c.file];
    c.index = static_cast<std::uint32_t>(
        std::lower_bound(sp.begin(), sp.end(), std::make_pair(c.offset, std::uint64_t{0})) - sp.begin());
    ++out.files[c.file].chunk_count;
  }
  return out;
}

}  // namespace pinload
