// Tests of the error model: what() formatting, code names, and the mapping of
// codes and errno values to Error subclasses.
#include "pinload/error.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <typeinfo>

namespace pinload {
namespace {

TEST(ErrorTest, WhatPrintsOnlyTheMessageWithoutContext) {
  const Error e(ErrorCode::kIo, "disk on fire");
  EXPECT_STREQ(e.what(), "disk on fire");
  EXPECT_EQ(e.message(), "disk on fire");
  EXPECT_EQ(e.code(), ErrorCode::kIo);
  EXPECT_TRUE(e.context().file.empty());
  EXPECT_TRUE(e.context().tensor.empty());
  EXPECT_FALSE(e.context().begin.has_value());
  EXPECT_FALSE(e.context().end.has_value());
}

TEST(ErrorTest, WhatPrintsFile) {
  const InvalidFileError e("bad header", ErrorContext{"/m/model.safetensors"});
  EXPECT_STREQ(e.what(), "/m/model.safetensors: bad header");
  EXPECT_EQ(e.message(), "bad header");
  EXPECT_EQ(e.context().file, "/m/model.safetensors");
}

TEST(ErrorTest, WhatPrintsFileAndTensor) {
  const InvalidFileError e("unknown dtype 'Q4'", ErrorContext{"a.safetensors", "layer.0.weight"});
  EXPECT_STREQ(e.what(), "a.safetensors: tensor 'layer.0.weight': unknown dtype 'Q4'");
}

TEST(ErrorTest, WhatPrintsByteRange) {
  const InvalidFileError e("overlap", ErrorContext{"a.safetensors", "w", 100, 164});
  EXPECT_STREQ(e.what(), "a.safetensors: tensor 'w': overlap (bytes 100..164)");
  EXPECT_EQ(e.context().begin, 100u);
  EXPECT_EQ(e.context().end, 164u);
}

TEST(ErrorTest, WhatPrintsSingleByteOffset) {
  const InvalidFileError e("not JSON", ErrorContext{"a.safetensors", {}, 17});
  EXPECT_STREQ(e.what(), "a.safetensors: not JSON (at byte 17)");
}

TEST(ErrorTest, WhatPrintsTensorWithoutFile) {
  const NotFoundError e("no such tensor", ErrorContext{{}, "w"});
  EXPECT_STREQ(e.what(), "tensor 'w': no such tensor");
}

TEST(ErrorTest, WhatPrintsLargeOffsets) {
  const std::uint64_t big = 18'446'744'073'709'551'615ull;
  const InvalidFileError e("x", ErrorContext{"f", {}, big - 1, big});
  EXPECT_STREQ(e.what(), "f: x (bytes 18446744073709551614..18446744073709551615)");
}

TEST(ErrorTest, ErrorIsARuntimeError) {
  try {
    throw IoError("read failed", ErrorContext{"f"});
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "f: read failed");
    return;
  }
  FAIL() << "IoError was not caught as std::runtime_error";
}

TEST(ErrorTest, CodeNamesAreStableAndDistinct) {
  EXPECT_STREQ(error_code_name(ErrorCode::kInvalidFile), "invalid_file");
  EXPECT_STREQ(error_code_name(ErrorCode::kNotFound), "not_found");
  EXPECT_STREQ(error_code_name(ErrorCode::kIo), "io");
  EXPECT_STREQ(error_code_name(ErrorCode::kOutOfMemory), "out_of_memory");
  EXPECT_STREQ(error_code_name(ErrorCode::kDevice), "device");
  EXPECT_STREQ(error_code_name(ErrorCode::kCancelled), "cancelled");
  EXPECT_STREQ(error_code_name(static_cast<ErrorCode>(200)), "unknown");
}

// throw_error(code) must throw exactly the subclass of that code.
template <typename Expected>
void expect_throw_error_maps(ErrorCode code) {
  SCOPED_TRACE(error_code_name(code));
  try {
    throw_error(code, "msg", ErrorContext{"file", "tensor", 1, 2});
  } catch (const Expected& e) {
    EXPECT_EQ(typeid(e), typeid(Expected));
    EXPECT_EQ(e.code(), code);
    EXPECT_EQ(e.message(), "msg");
    EXPECT_EQ(e.context().file, "file");
    EXPECT_EQ(e.context().tensor, "tensor");
    EXPECT_EQ(e.context().begin, 1u);
    EXPECT_EQ(e.context().end, 2u);
    EXPECT_STREQ(e.what(), "file: tensor 'tensor': msg (bytes 1..2)");
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw " << typeid(e).name() << " instead of " << typeid(Expected).name();
    return;
  }
}

TEST(ErrorTest, ThrowErrorMapsEveryCodeToItsSubclass) {
  expect_throw_error_maps<InvalidFileError>(ErrorCode::kInvalidFile);
  expect_throw_error_maps<NotFoundError>(ErrorCode::kNotFound);
  expect_throw_error_maps<IoError>(ErrorCode::kIo);
  expect_throw_error_maps<OutOfMemoryError>(ErrorCode::kOutOfMemory);
  expect_throw_error_maps<DeviceError>(ErrorCode::kDevice);
  expect_throw_error_maps<CancelledError>(ErrorCode::kCancelled);
}

// Caller mistakes have a code of their own, distinct from bad files.
TEST(ErrorTest, InvalidArgumentIsItsOwnCode) {
  EXPECT_STREQ(error_code_name(ErrorCode::kInvalidArgument), "invalid_argument");
  expect_throw_error_maps<InvalidArgumentError>(ErrorCode::kInvalidArgument);
  const InvalidArgumentError e("threads must be 1..1024, not 0");
  EXPECT_EQ(dynamic_cast<const InvalidFileError*>(static_cast<const Error*>(&e)), nullptr);
}

// A digest mismatch (manifest.h) has a code of its own.
TEST(ErrorTest, IntegrityIsItsOwnCode) {
  EXPECT_STREQ(error_code_name(ErrorCode::kIntegrity), "integrity");
  expect_throw_error_maps<IntegrityError>(ErrorCode::kIntegrity);
}

// An unreachable required service (the node store: store.h) has a code of its own.
TEST(ErrorTest, UnavailableIsTheLastCode) {
  EXPECT_STREQ(error_code_name(ErrorCode::kUnavailable), "unavailable");
  expect_throw_error_maps<UnavailableError>(ErrorCode::kUnavailable);
  EXPECT_EQ(static_cast<int>(ErrorCode::kUnavailable) + 1, kErrorCodeCount);
}

TEST(ErrorTest, ThrowErrorWithUnknownCodeStillThrowsError) {
  try {
    throw_error(static_cast<ErrorCode>(200), "odd");
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), 200);
    EXPECT_EQ(e.message(), "odd");
    return;
  }
  FAIL() << "nothing thrown";
}

TEST(ErrorTest, ThrowOsErrorMapsEnoentToNotFound) {
  try {
    throw_os_error("open", ENOENT, ErrorContext{"/no/such"});
  } catch (const NotFoundError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_EQ(e.message(), std::string("open: ") + std::strerror(ENOENT));
    EXPECT_EQ(e.context().file, "/no/such");
    EXPECT_EQ(std::string(e.what()), "/no/such: open: " + std::string(std::strerror(ENOENT)));
    return;
  }
  FAIL() << "nothing thrown";
}

TEST(ErrorTest, ThrowOsErrorMapsEnotdirToNotFound) {
  EXPECT_THROW(throw_os_error("open", ENOTDIR), NotFoundError);
}

TEST(ErrorTest, ThrowOsErrorMapsEioToIoError) {
  try {
    throw_os_error("pread", EIO, ErrorContext{"f", {}, 4096});
  } catch (const Error& e) {
    EXPECT_EQ(typeid(e), typeid(IoError));
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    EXPECT_EQ(e.message(), std::string("pread: ") + std::strerror(EIO));
    EXPECT_EQ(e.context().begin, 4096u);
    return;
  }
  FAIL() << "nothing thrown";
}

TEST(ErrorTest, ThrowOsErrorMapsOtherErrnosToIoError) {
  for (int err : {EACCES, EINVAL, EBADF, ENOSPC}) {
    SCOPED_TRACE(err);
    try {
      throw_os_error("x", err);
    } catch (const Error& e) {
      EXPECT_EQ(typeid(e), typeid(IoError));
      continue;
    }
    ADD_FAILURE() << "nothing thrown";
  }
}

TEST(ErrorTest, ThrowOsErrorMapsEnomemToOutOfMemory) {
  EXPECT_THROW(throw_os_error("mmap", ENOMEM), OutOfMemoryError);
}

}  // namespace
}  // namespace pinload
