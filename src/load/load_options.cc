// LoadOptions::validate: the one check of a load's options (loader.h).
#include <cmath>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "load/option_spellings.h"
#include "pinload/error.h"
#include "pinload/loader.h"

namespace pinload {
namespace {

[[noreturn]] void out_of_range(const char* option, const char* range, const std::string& value) {
  throw InvalidArgumentError(std::string(option) + " must be " + range + ", not " + value);
}

}  // namespace

using detail::kCachedReadSpellings;
using detail::kDirectSpellings;
using detail::kPageCacheSpellings;
using detail::kZeroCopySpellings;
using detail::parse_spelling;
using detail::spelling_of;

std::optional<DirectIo> parse_direct_io(std::string_view text) noexcept { return parse_spelling(kDirectSpellings, text); }
const char* direct_io_name(DirectIo direct) noexcept { return spelling_of(kDirectSpellings, direct); }
std::optional<CachedRead> parse_cached_read(std::string_view text) noexcept {
  return parse_spelling(kCachedReadSpellings, text);
}
const char* cached_read_name(CachedRead cached_read) noexcept { return spelling_of(kCachedReadSpellings, cached_read); }
std::optional<ZeroCopy> parse_zero_copy(std::string_view text) noexcept {
  return parse_spelling(kZeroCopySpellings, text);
}
const char* zero_copy_name(ZeroCopy zero_copy) noexcept { return spelling_of(kZeroCopySpellings, zero_copy); }
std::optional<PageCache> parse_page_cache(std::string_view text) noexcept {
  return parse_spelling(kPageCacheSpellings, text);
}
const char* page_cache_name(PageCache page_cache) noexcept { return spelling_of(kPageCacheSpellings, page_cache); }

void LoadOptions::validate() const {
  static_assert(kMinBlockSize == 4096 && kMaxBlockSize == (1u << 30) && kMaxThreads == 1024 && kMaxCopyStreams == 64,
                "the ranges below spell these limits");
  if (threads < 1 || threads > kMaxThreads) out_of_range("threads", "1..1024", std::to_string(threads));
  if (block_size < kMinBlockSize || block_size > kMaxBlockSize) {
    out_of_range("block_size", "4 KiB..1 GiB", std::to_string(block_size));
  }
  if (resolve.remote.connections > kMaxThreads) {
    out_of_range("connections", "1..1024", std::to_string(resolve.remote.connections));
  }
  if (files_in_flight < 1) out_of_range("files_in_flight", ">= 1", std::to_string(files_in_flight));
  if (std::isnan(resident_threshold) || resident_threshold < 0) {
    out_of_range("resident_threshold", ">= 0", std::to_string(resident_threshold));
  }
  if (target.copy.streams < 1 || target.copy.streams > kMaxCopyStreams) {
    out_of_range("streams", "1..64", std::to_string(target.copy.streams));
  }
  if (target.copy.chunk_bytes < 1) out_of_range("chunk_bytes", "> 0", std::to_string(target.copy.chunk_bytes));
  if (target.mode == DeviceMode::kStreaming && target.staging_bytes < 1) {
    out_of_range("staging_bytes", "> 0", std::to_string(target.staging_bytes));
  }
  if (page_cache == PageCache::kBypass && zero_copy == ZeroCopy::kOn) {
    throw InvalidArgumentError("page_cache='bypass' contradicts zero_copy='on': a mapped file is read into the page cache");
  }
  if (!dtype.to && (!dtype.keep.empty() || dtype.keep_to)) {
    throw InvalidArgumentError("keep and keep_dtype need dtype: they name tensors not converted to it");
  }
  verify.validate();
}

}  // namespace pinload
