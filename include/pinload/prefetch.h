// pinload/prefetch.h: start reading a checkpoint before anyone asks for it.
//
// prefetch() returns at once; background threads resolve the paths (or take
// the files of an I/O template), read the headers and then the data, with the
// loader's reader, into the loader's pool. A later Loader::load adopts it.
//
//   pinload::Loader loader(options, pool);
//   pinload::Prefetch p = pinload::prefetch(loader, {"/models/flux"});
//   init_framework();                                   // seconds of other work
//   pinload::StateDict sd = loader.load(p);             // finishes what is left
//
// Note [Prefetch and adoption]
// A prefetch and the load that adopts it share one ReadSession (internal):
// the open files, the plan, the destination blocks and a done flag per chunk.
// Adopting stops the prefetch's readers (a pread in flight finishes, nothing
// new starts), takes the session, and reads only the chunks not done with
// the loader's own threads. Blocks are handed over, never copied: host
// tensors are views of the very blocks the prefetch read into, and in
// streaming mode (loader.h, Note [Device loads]) every prefetched staging
// block is submitted to the copy engine, which gives it back to the staging
// pool as soon as its copy completes (burn after reading). Headers read by
// the prefetch are not read again, so every byte of the checkpoint is read
// once across the prefetch and the load.
//
// A prefetch never takes memory from data not yet consumed: it allocates from
// the same pool as the load, whose live blocks are never evicted. With a
// budget smaller than the model the loader must stream to a device; its
// staging pool waits when full (WhenFull::kWait), so the prefetch reads up to
// the budget and then waits until the load consumes what it read.
//
// A prefetch's read errors are not reported: the load reads the failed chunk
// again and reports its own error. A load whose options are incompatible
// (host vs streaming) or whose files differ drops the prefetch and reads
// everything itself.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pinload/io_template.h"
#include "pinload/loader.h"

namespace pinload {

namespace detail {
class ReadSession;
struct PrefetchHandover;  // load/prefetch_handover.h
}

// A prefetch in flight, or stopped with what it read. Move-only. Destroying
// it stops it and frees everything it holds (blocks, descriptors, threads).
// Thread safety: cancel(), done(), progress() and an adopting load may run
// concurrently with each other.
class Prefetch {
 public:
  Prefetch() = default;  // empty: nothing to adopt
  Prefetch(Prefetch&&) noexcept = default;
  Prefetch& operator=(Prefetch&&) noexcept = default;
  ~Prefetch();

  // Stops the readers and waits for them: reads in flight finish, nothing
  // new starts. What was read stays for a later load to adopt; blocks of
  // files that nothing was read into are released at once. Idempotent.
  void cancel() noexcept;
  // Waits until every chunk is read, or the prefetch stopped or failed.
  void wait() noexcept;
  // The readers have finished (all read, cancelled, failed or adopted).
  bool done() const noexcept;
  // Bytes read so far of bytes_total (0 until the headers are read).
  LoadProgress progress() const noexcept;
  // Whether a load has taken it over (it is then empty).
  bool adopted() const noexcept;
  // The paths it was started with (empty when started from a template).
  const std::vector<std::string>& paths() const noexcept;

  struct State;

 private:
  friend struct detail::PrefetchHandover;  // the hand-over to the adopting load
  friend Prefetch prefetch(const Loader&, std::vector<std::string>, const IoTemplate*);
  friend Prefetch prefetch(const Loader&, const IoTemplate&);
  explicit Prefetch(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

// Starts reading `paths` (as Loader::load resolves them) for `loader` (the
// prefetch keeps a copy; its Env and device must outlive the Prefetch and
// the load adopting it). With `plan` (whose files match the resolved ones), its reads for the
// loader's destination are replayed in their recorded order. Returns at once;
// never throws (failures leave nothing to adopt).
Prefetch prefetch(const Loader& loader, std::vector<std::string> paths, const IoTemplate* plan = nullptr);
// Starts reading the files of `plan` (load_template's result), in the
// recorded order for the loader's destination, before the caller has even
// resolved its paths. Adopt it with Loader::load(Prefetch&).
Prefetch prefetch(const Loader& loader, const IoTemplate& plan);

}  // namespace pinload
