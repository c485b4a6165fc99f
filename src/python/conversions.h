// Internal to pinload._core: the dtype conversions a conversion load runs,
// for tests (convert_bytes, convert_bytes_on_device, quantize_bytes), and the
// FP8 checkpoint converter (convert; include/pinload/convert.h).
#pragma once

#include <pybind11/pybind11.h>

namespace pinload::python {

// Binds convert_bytes, convert_bytes_on_device, quantize_bytes and convert.
// A bad argument raises InvalidArgumentError naming it.
void register_conversions(pybind11::module_& m);

}  // namespace pinload::python
