// Internal: what a load does, decided from facts before anything is read.
//
// Note [Load plans]
// Loader::run gathers what a load depends on (its options, the request, the
// device, what converts, the page-cache rule, the pool's budget) into
// LoadFacts, plain values, and asks two pure functions what to do:
//  - plan_routes: the memory that may hold the load's files whole, tried in
//    order before reading (the node store, a leased mapping), and whether a
//    conversion may be staged;
//  - plan_load: how a load that reads runs: buffered or direct cold reads, a
//    streaming budget, where staging blocks come from, device copies, device
//    or host conversions, the conversion ring, tensors handed out by chunk or
//    by file, or a refusal before reading.
// The loader executes the plan and decides nothing else. Each rule is a row
// of load_plan_test.cc.
//
// Thread safety: plain data and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pinload/loader.h"

namespace pinload::detail {

// Memory that may hand a load's files out whole, without reading them.
enum class LoadRoute : std::uint8_t {
  kStore,           // host files mapped from the node store (Note [Store clients])
  kStoreConverted,  // a host conversion the store serves converted (Note [Converted store entries])
  kStoreToDevice,   // a device load copied from the store's pages (Note [Store device loads])
  kZeroCopy,        // host files handed out as leased mappings (Note [Zero-copy loads])
  kMappedToDevice,  // a device load copied from leased mappings of the page cache (Note [Copies from mapped memory])
};

const char* load_route_name(LoadRoute route) noexcept;

struct LoadFacts {
  // The load and its request.
  bool to_device = false;         // options.target.device is set
  bool device_streaming = false;  // DeviceMode::kStreaming
  bool converting = false;        // conversion_changes_anything(checkpoint, options.dtype)
  bool verifying = false;         // options.verify.active()
  bool verify_whole_files = false;  // some file's whole sha256 is checked (verify.h)
  bool adopting = false;          // request.adopt: a prefetch's reads are taken over
  bool recording = false;         // request.record: an I/O template is written
  bool may_map = true;            // false for the files left to read after a route served the rest
  ZeroCopy zero_copy = ZeroCopy::kAuto;
  bool streams = false;           // tensors handed out as they arrive, none kept (HandOut::kStream)
  bool hands_out_ready = false;   // a ready queue takes tensors as they arrive
  DirectIo direct = DirectIo::kAuto;
  // Known once the conversions are planned (plan_conversions).
  bool conversions = false;         // some tensor converts
  bool conversions_staged = false;  // Note [Staged conversion]
  // keep_page_cache(options, env, bytes, page_cache_only_copy(facts)).
  bool page_cache_keeps = false;
  // Note [Streaming within a budget]: what the pool leaves a streaming load,
  // and the most its files' blocks (and a slab) can take.
  std::uint64_t streaming_budget_bytes = 0;
  std::uint64_t most_block_bytes = 0;
};

struct LoadRoutes {
  std::vector<LoadRoute> routes;  // tried in order; the first that serves the load ends it
  bool may_stage = false;         // plan_conversions may stage a host conversion
};

struct LoadPlan {
  bool read_buffered = false;       // DirectIo::kAuto reads cold files buffered (Note [Keeping the page cache])
  std::uint64_t budget_bytes = 0;   // a budgeted streaming session; 0: none
  bool one_file_in_flight = false;  // the budget may make reads wait: one file at a time
  bool stage_in_pool = false;       // staging blocks from the load's pool (a staged conversion), else the staging pool
  bool device_copies = false;       // chunks go on to the device as they land (DevicePipeline)
  bool device_conversions = false;  // converted on the device as their copies complete
  bool host_conversions = false;    // converted beside the reads, one thread per CPU
  bool conversion_ring = false;     // the host conversions read a ring of staging blocks
  bool hand_out_by_chunk = false;   // tensors go out as their chunks land, else once their file is in
  std::string refusal;              // not empty: the load is refused before reading (InvalidArgumentError)
};

LoadRoutes plan_routes(const LoadFacts& facts);

// Whether the page cache would hold the load's only host copy: a streaming
// device load that converts nothing. Asked of keep_page_cache.
bool page_cache_only_copy(const LoadFacts& facts);

// Whether the load streams within a budget (Note [Streaming within a
// budget]): a host load without conversion that hands tensors out as they
// arrive and keeps none. Its budget facts are gathered only then.
bool streams_within_budget(const LoadFacts& facts);

LoadPlan plan_load(const LoadFacts& facts);

}  // namespace pinload::detail
