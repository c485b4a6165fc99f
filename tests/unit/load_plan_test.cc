// The loader's mode choices (Note [Load plans] in src/load/load_plan.h) as
// table rows: facts in, plan out. Pure data, no I/O.
#include "load/load_plan.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace pinload::detail {
namespace {

using R = LoadRoute;

// ---- routes: what may serve a load whole before it reads ----

struct RouteRow {
  const char* name;
  std::function<void(LoadFacts&)> facts;
  std::vector<LoadRoute> routes;
  bool may_stage;
};

std::string names(const std::vector<LoadRoute>& routes) {
  std::string out;
  for (const LoadRoute r : routes) out += std::string(out.empty() ? "" : ",") + load_route_name(r);
  return out.empty() ? "(read)" : out;
}

class RouteTable : public ::testing::TestWithParam<RouteRow> {};

TEST_P(RouteTable, Routes) {
  const RouteRow& row = GetParam();
  LoadFacts facts;
  row.facts(facts);
  const LoadRoutes got = plan_routes(facts);
  EXPECT_EQ(names(got.routes), names(row.routes));
  EXPECT_EQ(got.may_stage, row.may_stage);
}

const RouteRow kRouteRows[] = {
    {"host", [](LoadFacts&) {}, {R::kStore, R::kZeroCopy}, true},
    {"host_zero_copy_off", [](LoadFacts& f) { f.zero_copy = ZeroCopy::kOff; }, {R::kStore}, true},
    {"host_zero_copy_on", [](LoadFacts& f) { f.zero_copy = ZeroCopy::kOn; }, {R::kStore, R::kZeroCopy}, true},
    {"host_converting", [](LoadFacts& f) { f.converting = true; }, {R::kStoreConverted}, true},
    {"device", [](LoadFacts& f) { f.to_device = true; }, {R::kStoreToDevice, R::kMappedToDevice}, false},
    {"device_streaming", [](LoadFacts& f) { f.to_device = f.device_streaming = true; },
     {R::kStoreToDevice, R::kMappedToDevice}, false},
    {"device_zero_copy_off", [](LoadFacts& f) { f.to_device = true; f.zero_copy = ZeroCopy::kOff; }, {R::kStoreToDevice},
     false},
    {"device_converting", [](LoadFacts& f) { f.to_device = f.converting = true; }, {}, false},
    {"verified", [](LoadFacts& f) { f.verifying = true; }, {}, true},
    {"verified_device", [](LoadFacts& f) { f.verifying = f.to_device = true; }, {}, false},
    {"adopting_a_prefetch", [](LoadFacts& f) { f.adopting = true; }, {}, false},
    {"recording_a_template", [](LoadFacts& f) { f.recording = true; }, {}, true},
    {"the_rest_after_a_route", [](LoadFacts& f) { f.may_map = false; }, {}, true},
    {"streaming_host", [](LoadFacts& f) { f.streams = f.hands_out_ready = true; }, {R::kStore, R::kZeroCopy}, true},
};

INSTANTIATE_TEST_SUITE_P(Rows, RouteTable, ::testing::ValuesIn(kRouteRows),
                         [](const auto& row) { return std::string(row.param.name); });

// ---- the plan of a load that reads ----

struct PlanRow {
  const char* name;
  std::function<void(LoadFacts&)> facts;
  std::function<void(LoadPlan&)> expected;  // changes from a plain host load's plan
};

// A host load that reads, converts nothing and hands its tensors out by chunk.
LoadPlan plain_host_plan() {
  LoadPlan p;
  p.hand_out_by_chunk = true;
  return p;
}

void expect_plans_equal(const LoadPlan& got, const LoadPlan& want) {
  EXPECT_EQ(got.read_buffered, want.read_buffered);
  EXPECT_EQ(got.budget_bytes, want.budget_bytes);
  EXPECT_EQ(got.one_file_in_flight, want.one_file_in_flight);
  EXPECT_EQ(got.stage_in_pool, want.stage_in_pool);
  EXPECT_EQ(got.device_copies, want.device_copies);
  EXPECT_EQ(got.device_conversions, want.device_conversions);
  EXPECT_EQ(got.host_conversions, want.host_conversions);
  EXPECT_EQ(got.conversion_ring, want.conversion_ring);
  EXPECT_EQ(got.hand_out_by_chunk, want.hand_out_by_chunk);
  EXPECT_EQ(got.refusal.empty(), want.refusal.empty()) << got.refusal;
}

class PlanTable : public ::testing::TestWithParam<PlanRow> {};

TEST_P(PlanTable, Plan) {
  const PlanRow& row = GetParam();
  LoadFacts facts;
  row.facts(facts);
  LoadPlan want = plain_host_plan();
  row.expected(want);
  expect_plans_equal(plan_load(facts), want);
}

constexpr std::uint64_t GiB = 1ull << 30;

void streaming(LoadFacts& f, std::uint64_t budget, std::uint64_t most) {
  f.streams = f.hands_out_ready = true;
  f.streaming_budget_bytes = budget;
  f.most_block_bytes = most;
}

const PlanRow kPlanRows[] = {
    {"host", [](LoadFacts&) {}, [](LoadPlan&) {}},
    // Note [Keeping the page cache]: only DirectIo::kAuto gives way to the rule.
    {"page_cache_kept", [](LoadFacts& f) { f.page_cache_keeps = true; }, [](LoadPlan& p) { p.read_buffered = true; }},
    {"page_cache_kept_direct_on",
     [](LoadFacts& f) {
       f.page_cache_keeps = true;
       f.direct = DirectIo::kOn;
     },
     [](LoadPlan&) {}},
    {"page_cache_kept_adopting",
     [](LoadFacts& f) { f.page_cache_keeps = f.adopting = true; }, [](LoadPlan&) {}},
    // Note [Streaming within a budget].
    {"streaming_within_a_roomy_budget", [](LoadFacts& f) { streaming(f, 8 * GiB, 2 * GiB); },
     [](LoadPlan& p) { p.budget_bytes = 8 * GiB; }},
    {"streaming_past_the_budget", [](LoadFacts& f) { streaming(f, 1 * GiB, 2 * GiB); },
     [](LoadPlan& p) {
       p.budget_bytes = 1 * GiB;
       p.one_file_in_flight = true;
     }},
    {"streaming_with_no_room_left", [](LoadFacts& f) { streaming(f, 0, 2 * GiB); },
     [](LoadPlan& p) {
       p.budget_bytes = 1;
       p.one_file_in_flight = true;
     }},
    {"streaming_without_a_ready_queue",
     [](LoadFacts& f) {
       streaming(f, 1 * GiB, 2 * GiB);
       f.hands_out_ready = false;
     },
     [](LoadPlan&) {}},
    {"streaming_a_conversion",
     [](LoadFacts& f) {
       streaming(f, 1 * GiB, 2 * GiB);
       f.converting = f.conversions = true;
     },
     [](LoadPlan& p) {
       p.host_conversions = true;
       p.hand_out_by_chunk = false;
     }},
    // Note [Conversion on load], Note [Staged conversion].
    {"host_conversion", [](LoadFacts& f) { f.converting = f.conversions = true; },
     [](LoadPlan& p) {
       p.host_conversions = true;
       p.hand_out_by_chunk = false;
     }},
    {"host_conversion_staged", [](LoadFacts& f) { f.converting = f.conversions = f.conversions_staged = true; },
     [](LoadPlan& p) {
       p.host_conversions = p.conversion_ring = p.stage_in_pool = true;
       p.hand_out_by_chunk = false;
     }},
    {"converting_but_nothing_converts", [](LoadFacts& f) { f.converting = true; }, [](LoadPlan&) {}},
    // Devices: copies as chunks land; conversions on the device.
    {"device", [](LoadFacts& f) { f.to_device = true; },
     [](LoadPlan& p) {
       p.device_copies = true;
       p.hand_out_by_chunk = false;
     }},
    {"device_conversion", [](LoadFacts& f) { f.to_device = f.converting = f.conversions = true; },
     [](LoadPlan& p) {
       p.device_copies = p.device_conversions = true;
       p.hand_out_by_chunk = false;
     }},
    {"device_streaming_keeps_the_page_cache",
     [](LoadFacts& f) { f.to_device = f.device_streaming = f.page_cache_keeps = true; },
     [](LoadPlan& p) {
       p.device_copies = p.read_buffered = true;
       p.hand_out_by_chunk = false;
     }},
    {"device_streaming_never_budgeted", [](LoadFacts& f) {
       streaming(f, 1 * GiB, 2 * GiB);
       f.to_device = f.device_streaming = true;
     },
     [](LoadPlan& p) {
       p.device_copies = true;
       p.hand_out_by_chunk = false;
     }},
    // Note [Verified loads]: a whole-file digest holds the tensors to the file's end.
    {"verified_by_tensor_digests", [](LoadFacts& f) { f.verifying = true; }, [](LoadPlan&) {}},
    {"verified_by_whole_files", [](LoadFacts& f) { f.verifying = f.verify_whole_files = true; },
     [](LoadPlan& p) { p.hand_out_by_chunk = false; }},
    {"streaming_verified_by_whole_files_is_refused",
     [](LoadFacts& f) {
       streaming(f, 8 * GiB, 1 * GiB);
       f.verifying = f.verify_whole_files = true;
     },
     [](LoadPlan& p) {
       p.budget_bytes = 8 * GiB;
       p.hand_out_by_chunk = false;
       p.refusal = "refused";
     }},
};

INSTANTIATE_TEST_SUITE_P(Rows, PlanTable, ::testing::ValuesIn(kPlanRows),
                         [](const auto& row) { return std::string(row.param.name); });

// The page cache would hold the only host copy of a streaming device load
// that converts nothing, and of nothing else.
TEST(LoadPlanTest, PageCacheOnlyCopy) {
  LoadFacts f;
  EXPECT_FALSE(page_cache_only_copy(f));
  f.to_device = true;
  EXPECT_FALSE(page_cache_only_copy(f));
  f.device_streaming = true;
  EXPECT_TRUE(page_cache_only_copy(f));
  f.conversions = true;
  EXPECT_FALSE(page_cache_only_copy(f));
}

}  // namespace
}  // namespace pinload::detail
