// Internal to the loading stage: what a load adopting a Prefetch takes from
// it (Note [Prefetch and adoption] in prefetch.h). The one door into a
// Prefetch's state; Prefetch befriends only this.
#pragma once

#include <memory>
#include <optional>

#include "io/read_session.h"
#include "pinload/checkpoint.h"
#include "pinload/prefetch.h"

namespace pinload::detail {

struct PrefetchHandover {
  // Stops the readers and hands over what they read (null when nothing).
  // The prefetch is adopted from then on.
  static std::unique_ptr<ReadSession> take(Prefetch& p);
  // Stops the readers; the checkpoint whose headers they read, if any.
  static std::optional<Checkpoint> checkpoint(Prefetch& p);
  // Whether it resolves paths as `options` do (the same variant).
  static bool resolves_like(const Prefetch& p, const ResolveOptions& options);
  // An empty prefetch, or one started from a template (no paths).
  static bool empty(const Prefetch& p);
};

}  // namespace pinload::detail
