// Internal: idle pool memory that was first touched in 4 KiB pages, collapsed
// into huge pages in the background.
//
// Note [Huge pages for a kept pool]
// Note [Page size of fresh memory] (first_touch.h) may fault a fresh block in
// 4 KiB pages, because they arrive faster. A kept pool then reads into that
// memory on every later load, and there huge pages are faster: on the VM of
// docs/benchmarks.md, cold re-loads of a 906 MB file into a kept pool ran at
// 1.28-1.40 GB/s (medians of two runs) in 4 KiB pages and at 1.70-1.78 GB/s
// once the pool was collapsed (docs/tuning.md, "The page size of fresh
// memory"): virtio passes a read into 2 MiB pages in fewer, larger segments.
// So when such a block returns to its pool's free list, the pool hands it to
// one background thread per process (nice 19: it takes idle CPU), which
// re-advises MADV_HUGEPAGE and collapses it 2 MiB at a time (MADV_COLLAPSE,
// Linux 6.1). The kernel keeps the contents; a page a read has pinned is
// skipped (EAGAIN). The pool stops a block's collapse when it hands the
// block out again (the rest waits for its next release) and waits for the
// step in progress before it returns memory to the OS. No step starts while
// a load or prefetch of the process reads (ReadsInFlight), nor within a
// second of its end, so the collapse takes only time that no load wants: a
// library of small files loaded one call after another (fresh_bench's LoRA
// cell) gets no step between its calls (a step waits for a fresh huge page
// from the host and takes the address space's lock). The first load of a
// fresh process keeps its fast 4 KiB first touch; the pool's later loads
// read into huge pages. PINLOAD_FRESH_PAGES=small keeps 4 KiB pages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>

namespace pinload::detail {

// What a pool shares with the collapsing thread: which of its idle blocks
// are to collapse.
class IdleBlocks {
 public:
  // A released block to collapse, queued to the process's thread.
  static void collapse_later(const std::shared_ptr<IdleBlocks>& blocks, std::byte* data, std::size_t bytes);

  // The pool hands `data` out again: no further step on it. True where it
  // was still to collapse (the new block is marked for its next release).
  bool take(std::byte* data);
  // Before the pool returns [begin, end) to the OS: forgets the blocks in it
  // and waits for a step in progress.
  void forget(const std::byte* begin, const std::byte* end);
  // Before the pool goes: forgets every block, takes no more, and waits for a
  // step in progress.
  void close();
  // Bytes collapsed into huge pages so far.
  std::uint64_t collapsed_bytes() const;

  // Tests: waits until the thread has nothing queued.
  static void wait_idle();

 private:
  friend class Collapser;
  // One 2 MiB step, at `at`, of the collapse of block [data, data + bytes)
  // (the first step re-advises MADV_HUGEPAGE): false where the block is no
  // longer idle or no huge page can be had (the job ends).
  bool step(std::byte* data, std::size_t bytes, std::byte* at, bool first);

  mutable std::mutex mu_;  // guards pending_, closed_, collapsed_
  std::set<std::byte*> pending_;
  bool closed_ = false;
  std::uint64_t collapsed_ = 0;
};

// Held by a load's or prefetch's reads (ReadSession::execute): while any is
// held, and for a second after the last, no collapse step starts.
class ReadsInFlight {
 public:
  ReadsInFlight();
  ~ReadsInFlight();
  ReadsInFlight(const ReadsInFlight&) = delete;
  ReadsInFlight& operator=(const ReadsInFlight&) = delete;
};

}  // namespace pinload::detail
