#include "pinload/error.h"

#include <cerrno>
#include <cstring>
#include <utility>

namespace pinload {
namespace {

std::string format(const std::string& message, const ErrorContext& ctx) {
  std::string out;
  if (!ctx.file.empty()) out += ctx.file + ": ";
  if (!ctx.tensor.empty()) out += "tensor '" + ctx.tensor + "': ";
  out += message;
  if (ctx.begin && ctx.end) {
    out += " (bytes " + std::to_string(*ctx.begin) + ".." + std::to_string(*ctx.end) + ")";
  } else if (ctx.begin) {
    out += " (at byte " + std::to_string(*ctx.begin) + ")";
  }
  return out;
}

}  // namespace

const char* error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidFile: return "invalid_file";
    case ErrorCode::kNotFound: return "not_found";
    case ErrorCode::kIo: return "io";
    case ErrorCode::kOutOfMemory: return "out_of_memory";
    case ErrorCode::kDevice: return "device";
    case ErrorCode::kCancelled: return "cancelled";
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kIntegrity: return "integrity";
    case ErrorCode::kUnavailable: return "unavailable";
  }
  return "unknown";
}

Error::Error(ErrorCode code, std::string message, ErrorContext context)
    : std::runtime_error(format(message, context)),
      code_(code),
      message_(std::move(message)),
      context_(std::move(context)) {}

void throw_error(ErrorCode code, std::string message, ErrorContext context) {
  switch (code) {
    case ErrorCode::kInvalidFile: throw InvalidFileError(std::move(message), std::move(context));
    case ErrorCode::kNotFound: throw NotFoundError(std::move(message), std::move(context));
    case ErrorCode::kIo: throw IoError(std::move(message), std::move(context));
    case ErrorCode::kOutOfMemory: throw OutOfMemoryError(std::move(message), std::move(context));
    case ErrorCode::kDevice: throw DeviceError(std::move(message), std::move(context));
    case ErrorCode::kCancelled: throw CancelledError(std::move(message), std::move(context));
    case ErrorCode::kInvalidArgument: throw InvalidArgumentError(std::move(message), std::move(context));
    case ErrorCode::kIntegrity: throw IntegrityError(std::move(message), std::move(context));
    case ErrorCode::kUnavailable: throw UnavailableError(std::move(message), std::move(context));
  }
  throw Error(code, std::move(message), std::move(context));
}

void throw_os_error(const std::string& what, int err, ErrorContext context) {
  std::string message = what + ": " + std::strerror(err);
  if (err == ENOENT || err == ENOTDIR) throw NotFoundError(std::move(message), std::move(context));
  if (err == ENOMEM) throw OutOfMemoryError(std::move(message), std::move(context));
  throw IoError(std::move(message), std::move(context));
}

}  // namespace pinload
