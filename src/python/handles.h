// Internal to pinload._core: the objects handed to Python (StateDict,
// LoadHandle, Prefetch, ModelCache) and the calls that make them.
#pragma once

#include <pybind11/pybind11.h>

namespace pinload::python {

// Binds StateDict, LoadHandle, Prefetch, ModelCache, load_async and prefetch.
// register_options and register_dlpack must have run.
void register_handles(pybind11::module_& m);

}  // namespace pinload::python
