// Internal: the node store's daemon, with the converting fill supplied from
// above (Note [Converted store entries] in pinload/store.h): the load layer
// knows how to convert a checkpoint, the store only gives it memory.
// serve_store (store.h) is serve_store_with and load/store_image.cc's
// planner.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "pinload/env.h"
#include "pinload/store.h"
#include "store/wire.h"

namespace pinload::detail {

// A converted variant of one file, planned before the store makes room for it.
class ConvertedImage {
 public:
  virtual ~ConvertedImage() = default;
  // The image's bytes: the 8-byte length, the header, the data.
  virtual std::uint64_t bytes() const = 0;
  // Writes the image into `into` (bytes() of writable memory). Throws
  // pinload::Error naming the file.
  virtual void write(std::byte* into) = 0;
};

// Plans the image of the file open as `fd` (named `path`, read through
// `env` with `threads` readers) loaded with `variant`. Throws pinload::Error
// naming the file and tensor (a bad or missing FP8 scale, say).
using ImagePlanner = std::function<std::unique_ptr<ConvertedImage>(
    Env* env, int fd, const std::string& path, const StoreVariant& variant, unsigned threads)>;

// serve_store's daemon; converted entries need `planner` (without one they
// are refused with InvalidArgumentError).
int serve_store_with(const StoreServerOptions& options, const ImagePlanner& planner);

}  // namespace pinload::detail
