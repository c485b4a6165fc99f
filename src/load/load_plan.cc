#include "load/load_plan.h"

#include <algorithm>

namespace pinload::detail {

const char* load_route_name(LoadRoute route) noexcept {
  switch (route) {
    case LoadRoute::kStore: return "store";
    case LoadRoute::kStoreConverted: return "store-converted";
    case LoadRoute::kStoreToDevice: return "store-to-device";
    case LoadRoute::kZeroCopy: return "zero-copy";
    case LoadRoute::kMappedToDevice: return "mapped-to-device";
  }
  return "?";
}

LoadRoutes plan_routes(const LoadFacts& facts) {
  LoadRoutes out;
  const bool host = !facts.to_device;
  // Files handed out from memory that holds them whole: not for a verified
  // load, an adopted prefetch or a recorded template, which need the reads.
  const bool whole = facts.may_map && !facts.verifying && !facts.adopting && !facts.recording;
  if (whole && host && !facts.converting) out.routes.push_back(LoadRoute::kStore);
  if (whole && host && facts.converting) out.routes.push_back(LoadRoute::kStoreConverted);
  if (whole && !host && !facts.converting) out.routes.push_back(LoadRoute::kStoreToDevice);
  if (whole && host && !facts.converting && facts.zero_copy != ZeroCopy::kOff) {
    out.routes.push_back(LoadRoute::kZeroCopy);
  }
  if (whole && !host && !facts.converting && facts.zero_copy != ZeroCopy::kOff) {
    out.routes.push_back(LoadRoute::kMappedToDevice);
  }
  // A host load reading afresh may stage its conversions (Note [Staged conversion]).
  out.may_stage = host && !facts.adopting;
  return out;
}

bool page_cache_only_copy(const LoadFacts& facts) {
  return facts.to_device && facts.device_streaming && !facts.conversions;
}

bool streams_within_budget(const LoadFacts& facts) {
  return facts.streams && facts.hands_out_ready && !facts.to_device && !facts.converting;
}

LoadPlan plan_load(const LoadFacts& facts) {
  LoadPlan plan;
  const bool host = !facts.to_device;
  if (facts.streams && facts.verify_whole_files) {
    plan.refusal =
        "verify: a load that hands tensors out as they arrive and keeps none (iter_tensors) cannot wait for a "
        "whole-file sha256; verify against a manifest with tensor digests (pinload manifest)";
  }
  plan.read_buffered = facts.direct == DirectIo::kAuto && facts.page_cache_keeps && !facts.adopting;
  // Note [Streaming within a budget]: a host load that keeps nothing it hands
  // out takes each file's block as it reaches it, within a budget; one file at
  // a time where the budget may make it wait.
  if (streams_within_budget(facts)) {
    plan.budget_bytes = std::max<std::uint64_t>(facts.streaming_budget_bytes, 1);
    plan.one_file_in_flight = facts.most_block_bytes > plan.budget_bytes;
  }
  plan.stage_in_pool = facts.conversions_staged;
  plan.device_copies = facts.to_device;
  plan.device_conversions = facts.to_device && facts.conversions;
  plan.host_conversions = host && facts.conversions;
  plan.conversion_ring = plan.host_conversions && facts.conversions_staged;
  // A whole file's digest is known at its end only: its tensors go out then.
  plan.hand_out_by_chunk = host && !facts.conversions && !facts.verify_whole_files;
  return plan;
}

}  // namespace pinload::detail
