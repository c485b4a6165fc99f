// Internal: where a load's pool and readers go (Note [NUMA placement] in
// numa.h), shared by the Loader and the Session that makes its pools.
#pragma once

#include "pinload/loader.h"
#include "pinload/numa.h"

namespace pinload::detail {

// The placement of loads with `options`: the requested node, or under
// kNumaAuto the target device's on a multi-node machine. Under kNumaAuto a
// sysfs that cannot be read turns placement off; an explicit node that
// cannot be placed throws.
NumaPlacement choose_numa_placement(const LoadOptions& options);

}  // namespace pinload::detail
