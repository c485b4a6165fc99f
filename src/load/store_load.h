// Internal: a host load's files served by the node store (Note [Store
// clients] in pinload/store.h).
#pragma once

#include <functional>
#include <optional>
#include <stop_token>
#include <vector>

#include "pinload/checkpoint.h"
#include "pinload/loader.h"
#include "pinload/state_dict.h"

namespace pinload::detail {

// The load of `checkpoint` with its local files mapped from the store and the
// others (remote ones, those the store could not serve) loaded by `read`.
// nullopt, having done nothing, where no store is configured, or it cannot be
// reached and is not required (one warning per process). Throws
// UnavailableError where a required store cannot serve, IoError for a file
// replaced since its header was read, and what `read` throws.
std::optional<StateDict> load_from_store(const LoadOptions& options, Env* env, const Checkpoint& checkpoint,
                                         Loader::Counters* counters, std::stop_token stop,
                                         const std::function<void(std::vector<Tensor>)>& hand_out,
                                         const std::function<StateDict(const Checkpoint&)>& read);

// A host load with LoadOptions::dtype whose files the store serves converted,
// every one of them (Note [Converted store entries] in pinload/store.h):
// views of each file's converted image, in the order and with the metadata
// of a local conversion. nullopt where the store is not used, a file is
// remote, an FP8 weight's scale lies in another file, or the store does not
// serve every file (the load then converts locally). Throws as
// load_from_store.
std::optional<StateDict> load_converted_from_store(const LoadOptions& options, Env* env, const Checkpoint& checkpoint,
                                                   Loader::Counters* counters, std::stop_token stop,
                                                   const std::function<void(std::vector<Tensor>)>& hand_out);

// A device load of `checkpoint` whose files the store serves, every one of
// them: each is copied to the device from its mapping (upload(), no staging
// copy); kCached tensors keep the mapping as their host copy. nullopt where
// the store is not used or does not serve every file (the load then reads
// them itself). Throws as load_from_store, and what upload() throws.
std::optional<StateDict> load_to_device_from_store(const LoadOptions& options, Env* env, const Checkpoint& checkpoint,
                                                   Loader::Counters* counters, std::stop_token stop);

}  // namespace pinload::detail
