// Internal to pinload._core: pinload::Error as Python exceptions.
//
// pinload.Error is the base; each ErrorCode has a subclass that is also the
// matching builtin (InvalidFileError and InvalidArgumentError: ValueError,
// NotFoundError: FileNotFoundError, IoError: OSError, OutOfMemoryError:
// MemoryError). Every instance carries code, message, file, tensor, begin,
// end (None where they do not apply). pinload.Error derives from
// safetensors.SafetensorError where safetensors imports (Note
// [SafetensorError] in errors.cc).
#pragma once

#include <pybind11/pybind11.h>

#include "pinload/error.h"

namespace pinload::python {

// The Python exception instance for `e` (its pinload.Error subclass, with the
// context as attributes), not raised.
pybind11::object error_object(const Error& e);

// Creates the exception types in `m` and installs the translator of
// pinload::Error into them. Call once, from the module's init.
void register_errors(pybind11::module_& m);

}  // namespace pinload::python
