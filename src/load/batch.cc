// load_batch: see pinload/batch.h.
#include "pinload/batch.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>

#include "base/log.h"
#include "base/parallel_for.h"
#include "pinload/checkpoint.h"
#include "pinload/error.h"

namespace pinload {

namespace {

// The batch tags each path's tensors with "<index>:" in front of their names
// (CheckpointFile::name_prefix), so that paths whose tensors share names (LoRA
// files of one base model) can be read in one load; split() takes it off.
std::string tag(std::size_t index) { return std::to_string(index) + ":"; }

// The item index of a tagged name, and the name without the tag.
std::pair<std::size_t, std::string_view> untag(std::string_view name) {
  std::size_t index = 0;
  const auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), index);
  const std::size_t at = static_cast<std::size_t>(end - name.data());
  if (ec != std::errc() || at >= name.size() || name[at] != ':') {
    throw InvalidFileError("batch: untagged tensor name", ErrorContext{{}, std::string(name)});
  }
  return {index, name.substr(at + 1)};
}

Tensor renamed(const Tensor& t, std::string name) {
  if (!t.on_host()) return Tensor(std::move(name), t.dtype(), t.shape(), t.device_buffer(), t.device_offset(), t.nbytes());
  Tensor out(std::move(name), t.dtype(), t.shape(), t.block(), t.block_offset(), t.nbytes());
  if (t.on_device()) out.set_device(t.device_buffer(), t.device_offset());
  return out;
}


}  // namespace

std::vector<BatchItem> load_batch(const Loader& loader, const std::vector<std::string>& paths, std::stop_token stop) {
  const std::size_t n = paths.size();
  std::vector<BatchItem> items(n);
  std::vector<std::optional<Checkpoint>> checkpoints(n);
  // Note [Small files]: `threads` files in flight, for the batch's own loader.
  LoadOptions options = loader.options();
  options.files_in_flight = std::max<std::size_t>(options.files_in_flight, options.threads);
  const Loader batch(options, loader.pool(), loader.env());

  // Headers, `threads` at once; a path that fails here is out of the sweep.
  detail::parallel_for(n, options.threads, [&](std::size_t i) {
    items[i].path = paths[i];
    if (stop.stop_requested()) return;
    try {
      checkpoints[i] = open_checkpoint(loader.env(), {paths[i]}, options.resolve);
    } catch (...) {
      items[i].error = std::current_exception();
    }
  });
  if (stop.stop_requested()) throw CancelledError("batch load cancelled");

  Checkpoint sweep;
  std::vector<std::size_t> swept;  // items in the sweep
  for (std::size_t i = 0; i < n; ++i) {
    if (!checkpoints[i]) continue;
    swept.push_back(i);
    for (const CheckpointFile& f : checkpoints[i]->files) {
      CheckpointFile& tagged = sweep.files.emplace_back(f);
      tagged.name_prefix = tag(i) + f.name_prefix;
    }
  }
  if (swept.empty()) return items;

  std::optional<StateDict> all;
  try {
    all = batch.load(sweep, stop);
  } catch (const CancelledError&) {
    throw;
  } catch (const std::exception& e) {
    // Note [Batch errors]: each path again on its own, for its own outcome.
    log::debug("batch of {} paths failed ({}); loading each on its own", swept.size(), e.what());
  }
  if (all) {
    std::vector<std::vector<Tensor>> tensors(n);
    for (std::size_t i : swept) tensors[i].reserve(checkpoints[i]->tensor_count());
    for (const Tensor& t : *all) {
      auto [index, name] = untag(t.name());
      tensors.at(index).push_back(renamed(t, std::string(name)));
    }
    all.reset();
    for (std::size_t i : swept) {
      items[i].state = StateDict(std::move(tensors[i]), checkpoints[i]->metadata());
      std::vector<std::string> files;  // StateDict::at names them
      for (const CheckpointFile& f : checkpoints[i]->files) files.push_back(f.path);
      items[i].state.set_files(std::move(files));
    }
    return items;
  }
  for (std::size_t i : swept) {
    if (stop.stop_requested()) throw CancelledError("batch load cancelled");
    try {
      items[i].state = batch.load(*checkpoints[i], stop);
    } catch (const CancelledError&) {
      throw;
    } catch (...) {
      items[i].error = std::current_exception();
    }
  }
  return items;
}

}  // namespace pinload
