// pinload/error.h: the one error model of pinload.
//
// Every failure is a pinload::Error (a std::exception) carrying a code and the
// context a person needs to act on it: the file, the tensor and the byte range
// where they apply. Subclasses exist per code so that callers, and Python
// (pinload.Error and its subclasses), can catch exactly what they handle.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace pinload {

enum class ErrorCode : std::uint8_t {
  kInvalidFile,      // a malformed safetensors file, index, template or sysfs file
  kNotFound,         // a path or tensor that does not exist
  kIo,               // the OS failed a read, open or stat
  kOutOfMemory,      // the OS or the pool's budget refused memory
  kDevice,           // the accelerator (or its driver) failed
  kCancelled,        // the caller cancelled the operation
  kInvalidArgument,  // a caller's mistake: an option out of range, an object
                     // of another device, a call out of order
  kIntegrity,        // bytes that differ from their expected digest (manifest.h)
  kUnavailable,      // a service a load requires (the node store: store.h) cannot be reached
};

inline constexpr int kErrorCodeCount = 9;

// Stable lowercase name of a code ("invalid_file", "io", ...).
const char* error_code_name(ErrorCode code) noexcept;

// Where an error happened. Every field is optional; what() prints those set.
struct ErrorContext {
  std::string file;
  std::string tensor;
  std::optional<std::uint64_t> begin;  // byte offset, absolute in the file
  std::optional<std::uint64_t> end;    // exclusive
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string message, ErrorContext context = {});

  ErrorCode code() const noexcept { return code_; }
  // The message without the context prefix.
  const std::string& message() const noexcept { return message_; }
  const ErrorContext& context() const noexcept { return context_; }

 private:
  ErrorCode code_;
  std::string message_;
  ErrorContext context_;
};

#define PINLOAD_DEFINE_ERROR(Name, Code)                                  \
  class Name : public Error {                                             \
   public:                                                                \
    explicit Name(std::string message, ErrorContext context = {})         \
        : Error(ErrorCode::Code, std::move(message), std::move(context)) {} \
  };
PINLOAD_DEFINE_ERROR(InvalidFileError, kInvalidFile)
PINLOAD_DEFINE_ERROR(NotFoundError, kNotFound)
PINLOAD_DEFINE_ERROR(IoError, kIo)
PINLOAD_DEFINE_ERROR(OutOfMemoryError, kOutOfMemory)
PINLOAD_DEFINE_ERROR(DeviceError, kDevice)
PINLOAD_DEFINE_ERROR(CancelledError, kCancelled)
PINLOAD_DEFINE_ERROR(InvalidArgumentError, kInvalidArgument)
PINLOAD_DEFINE_ERROR(IntegrityError, kIntegrity)
PINLOAD_DEFINE_ERROR(UnavailableError, kUnavailable)
#undef PINLOAD_DEFINE_ERROR

// Throws the subclass of Error that matches `code`.
[[noreturn]] void throw_error(ErrorCode code, std::string message, ErrorContext context = {});

// Throws IoError (or NotFoundError for ENOENT) for a failed system call:
// "<what>: <strerror(err)>".
[[noreturn]] void throw_os_error(const std::string& what, int err, ErrorContext context = {});

}  // namespace pinload
