// pinload/batch.h: many independent checkpoints (a library of LoRA files) in
// one parallel load, one state dict each.
//
// load_batch(loader, paths) is what a loop of loader.load({path}) returns,
// path by path, but read in one sweep: the headers are read by the loader's
// `threads` workers at once, and then every file's chunks form one read plan
// whose workers keep `threads` reads in flight across the files (Note [Small
// files]). Each path is anything Loader::load takes alone (a file, an index, a
// folder); tensor names and metadata are those of a load of that path alone.
//
// Note [Small files]
// A file of a few MiB is one or two chunks of the default 8 MiB block. Loaded
// one per call, each call pays the fixed costs (a reader thread, three opens,
// a header read, a pool lookup) and reads with a queue depth of one or two. In
// one batch the fixed costs are paid once, header reads overlap, and the plan
// interleaves `threads` files (LoadOptions::files_in_flight is raised to
// `threads` for the batch), so `threads` files are open and read at once.
//
// Note [Batch errors]
// One path's failure is that path's alone: its BatchItem carries its own
// pinload::Error (naming the file, and the tensor and bytes where they apply),
// and every other item is complete and byte-equal to a load of that path
// alone. No item is ever partial: an item is either every tensor of its path
// or an error. How: a path whose header (or index, or folder) cannot be read
// fails at once and is left out of the sweep. Where the sweep itself fails (a
// file changed or shrank after its header was read, a read error, the pool's
// budget), every path of it is loaded again on its own, and each gets its own
// outcome from that load. Only cancellation fails the batch as a whole:
// load_batch throws CancelledError once `stop` is requested.
#pragma once

#include <exception>
#include <stop_token>
#include <string>
#include <vector>

#include "pinload/loader.h"
#include "pinload/state_dict.h"

namespace pinload {

// The outcome of one path of a batch.
struct BatchItem {
  std::string path;          // as given
  StateDict state;           // every tensor of the path, when ok()
  std::exception_ptr error;  // otherwise the path's own pinload::Error
  bool ok() const noexcept { return error == nullptr; }
};

// Loads every path of `paths` as its own state dict (Note [Batch errors]),
// with the loader's options, pool and env; the result has one item per path,
// in the order given (a path given twice is loaded twice). Blocks. Throws
// only CancelledError (once `stop` is requested); every other failure is the
// failing item's. Every block, descriptor and thread taken has been released
// on return, but for the blocks the returned tensors hold.
std::vector<BatchItem> load_batch(const Loader& loader, const std::vector<std::string>& paths,
                                  std::stop_token stop = {});

}  // namespace pinload
