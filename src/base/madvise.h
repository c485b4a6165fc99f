// Internal: madvise(2) advice newer than some system headers. An older
// kernel answers EINVAL, which each caller handles.
#pragma once

#include <sys/mman.h>

namespace pinload::detail {

#ifdef MADV_POPULATE_READ
inline constexpr int kMadvPopulateRead = MADV_POPULATE_READ;
#else
inline constexpr int kMadvPopulateRead = 22;  // Linux 5.14
#endif
#ifdef MADV_POPULATE_WRITE
inline constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
inline constexpr int kMadvPopulateWrite = 23;  // Linux 5.14
#endif
#ifdef MADV_COLLAPSE
inline constexpr int kMadvCollapse = MADV_COLLAPSE;
#else
inline constexpr int kMadvCollapse = 25;  // Linux 6.1
#endif

}  // namespace pinload::detail
