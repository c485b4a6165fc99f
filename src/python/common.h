// Internal to pinload._core: helpers every part of the bindings uses.
//
// Note [GIL]
// Every call that may block (header reads, loads, waits, pool trims, the
// destruction of a load in flight) releases the GIL. Objects handed to Python
// (StateDict, LoadHandle) are only touched with the GIL held.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pinload::python {

namespace py = pybind11;

// File and tensor names are bytes to the OS: decoded with `errors`
// (surrogateescape: os.fsdecode's rule, so that names round-trip).
inline py::str decode(const std::string& text, const char* errors = "surrogateescape") {
  PyObject* s = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), errors);
  if (s == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(s);
}

inline py::list shape_list(const std::vector<std::uint64_t>& shape) {
  py::list out;
  for (std::uint64_t d : shape) out.append(py::int_(d));
  return out;
}

// Destroys *owned with the GIL released where that is allowed (not while the
// interpreter shuts down): its destructor joins threads that never need the
// GIL, and other Python threads may run meanwhile.
template <typename T>
void reset_without_gil(std::unique_ptr<T>& owned) {
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing();
#else
  const bool finalizing = _Py_IsFinalizing();
#endif
  if (!finalizing && PyGILState_Check()) {
    py::gil_scoped_release release;
    owned.reset();
  } else {
    owned.reset();
  }
}

}  // namespace pinload::python
