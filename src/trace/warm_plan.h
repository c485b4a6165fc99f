// trace/warm_plan.h: what a warmer reads, and in which order, as plain data;
// and the burn-after-reading bookkeeping that follows a consumer through it.
//
// Note [Burn after reading]
// A warm plan is a template's reads, each byte once, cut into pieces of at
// most piece_bytes, in template order. Without a budget the warmer reads
// every piece as fast as it can. With one, the pieces warmed (or touched by
// the consumer) and not yet dropped must fit in the budget, so the warmer
// stays a window ahead of the consumer: when the consumer has read every byte
// of a piece and then reads elsewhere, the template says the piece won't be
// read again, and the warmer drops it (POSIX_FADV_DONTNEED), freeing room
// ahead. A piece the consumer reached first is not read by the warmer.
// A mapping (mmap(2), Note [Mapped or read]) says nothing about progress:
// its pages are faulted in later, unseen, and can't be dropped while mapped;
// the warmer ignores it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "pinload/io_template.h"

namespace pinload::trace {

inline constexpr std::uint64_t kDefaultPieceBytes = 4u << 20;  // one buffered pread: big for the disk, small for the budget

struct WarmPiece {
  std::uint32_t file = 0;  // index into WarmPlan::files
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  bool operator==(const WarmPiece&) const = default;
};

struct WarmPlan {
  std::vector<TemplateFile> files;
  std::vector<WarmPiece> pieces;
  std::uint64_t bytes = 0;
};

// The plan of a template: the reads of its "page-cache" destination (a
// traced template) followed by the mapped ranges of files it never read,
// else the reads of "host", else of every destination in turn; each byte
// once, in that order; pieces of at most piece_bytes (> 0).
WarmPlan plan_from_template(const IoTemplate& t, std::uint64_t piece_bytes = kDefaultPieceBytes);
// The plan of whole files, in the order given.
WarmPlan plan_whole_files(const std::vector<TemplateFile>& files, std::uint64_t piece_bytes = kDefaultPieceBytes);

// Follows a consumer's reads through a plan (Note [Burn after reading]).
// Not thread-safe: the caller locks.
class BurnTracker {
 public:
  explicit BurnTracker(const WarmPlan& plan);

  // A consumer read of [offset, +length) of plan file `file`. Returns the
  // pieces to drop now (each once, ever).
  std::vector<std::size_t> on_consumer_read(std::uint32_t file, std::uint64_t offset, std::uint64_t length);
  // Whether the consumer has touched piece i (the warmer then skips it).
  bool touched(std::size_t i) const { return state_[i].touched; }
  // The warmer has read piece i. Returns false if it was already resident
  // (touched) and so counted.
  void on_warmed(std::size_t i);
  // Bytes of pieces warmed or touched and not dropped.
  std::uint64_t resident_bytes() const { return resident_; }
  std::uint64_t dropped_bytes() const { return dropped_; }

 private:
  struct PieceState {
    std::uint64_t covered = 0;
    bool touched = false, resident = false, done = false, dropped = false;
  };
  void make_resident(std::size_t i);

  const WarmPlan& plan_;
  std::vector<std::map<std::uint64_t, std::size_t>> by_offset_;  // per file: offset -> piece
  std::vector<PieceState> state_;
  std::vector<std::size_t> done_pending_;  // done, dropped at the next read elsewhere
  std::uint64_t resident_ = 0, dropped_ = 0;
};

}  // namespace pinload::trace
