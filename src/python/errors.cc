#include "errors.h"

#include <cstddef>
#include <exception>
#include <string>

#include "common.h"
#include "pinload/error.h"

namespace pinload::python {
namespace {

struct ErrorTypes {
  py::object base;
  py::object by_code[kErrorCodeCount];
};
ErrorTypes& error_types() {
  static auto* types = new ErrorTypes;  // leaked: lives as long as the interpreter
  return *types;
}

}  // namespace

py::object error_object(const Error& e) {
  const auto code = static_cast<std::size_t>(e.code());
  py::object type = code < std::size(error_types().by_code) && error_types().by_code[code]
                        ? error_types().by_code[code]
                        : error_types().base;
  py::object instance = type(decode(e.what(), "backslashreplace"));
  const ErrorContext& ctx = e.context();
  instance.attr("file") = ctx.file.empty() ? py::object(py::none()) : py::object(decode(ctx.file));
  instance.attr("tensor") = ctx.tensor.empty() ? py::object(py::none()) : py::object(decode(ctx.tensor));
  instance.attr("begin") = ctx.begin ? py::object(py::int_(*ctx.begin)) : py::object(py::none());
  instance.attr("end") = ctx.end ? py::object(py::int_(*ctx.end)) : py::object(py::none());
  instance.attr("code") = py::str(error_code_name(e.code()));
  instance.attr("message") = decode(e.message(), "backslashreplace");
  return instance;
}

namespace {

void raise_error(const Error& e) {
  py::object instance = error_object(e);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(instance.ptr())), instance.ptr());
}

// Note [SafetensorError]: pinload's errors derive from
// safetensors.SafetensorError where safetensors can be imported, so that code
// written against the reference (`except SafetensorError`) catches them when
// it switches to pinload's drop-in; without safetensors, from Exception.
py::object error_base_class() {
  try {
    return py::module_::import("safetensors").attr("SafetensorError");
  } catch (const py::error_already_set&) {
    return py::reinterpret_borrow<py::object>(PyExc_Exception);
  }
}

py::object make_error_type(py::module_& m, const char* name, const char* doc, py::object bases) {
  const std::string qualified = std::string("pinload.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (type == nullptr) throw py::error_already_set();
  py::object out = py::reinterpret_steal<py::object>(type);
  m.attr(name) = out;
  return out;
}

}  // namespace

void register_errors(py::module_& m) {
  ErrorTypes& t = error_types();
  t.base = make_error_type(m, "Error",
                           "Base class of every pinload error. Attributes: code (str), message (the text without "
                           "the context), file, tensor, begin, end (None where they do not apply). A "
                           "safetensors.SafetensorError too when safetensors is installed.",
                           error_base_class());
  for (const char* attr : {"file", "tensor", "begin", "end", "message"}) t.base.attr(attr) = py::none();
  t.base.attr("code") = py::str("error");
  struct Spec {
    ErrorCode code;
    const char* name;
    PyObject* extra_base;
    const char* doc;
  };
  const Spec specs[] = {
      {ErrorCode::kInvalidFile, "InvalidFileError", PyExc_ValueError,
       "A malformed safetensors file, index or template (also a ValueError)."},
      {ErrorCode::kNotFound, "NotFoundError", PyExc_FileNotFoundError,
       "A path or tensor that does not exist (also a FileNotFoundError)."},
      {ErrorCode::kIo, "IoError", PyExc_OSError, "The OS failed a read, open or stat (also an OSError)."},
      {ErrorCode::kOutOfMemory, "OutOfMemoryError", PyExc_MemoryError,
       "The OS or the pool's budget refused memory (also a MemoryError)."},
      {ErrorCode::kDevice, "DeviceError", nullptr, "The accelerator or its driver failed, or is unavailable."},
      {ErrorCode::kCancelled, "CancelledError", nullptr, "The load was cancelled."},
      {ErrorCode::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError,
       "A caller's mistake: an option out of range, an unknown device, a call out of order (also a ValueError). "
       "The message names the argument."},
      {ErrorCode::kIntegrity, "IntegrityError", nullptr,
       "Bytes that differ from their expected digest (a manifest, or a file's published sha256): names the file, "
       "the tensor and the byte range."},
      {ErrorCode::kUnavailable, "UnavailableError", PyExc_ConnectionError,
       "A service the load requires cannot be reached: the node store with store_required=True (also a "
       "ConnectionError)."},
  };
  static_assert(sizeof(specs) / sizeof(specs[0]) == kErrorCodeCount, "one Python type per ErrorCode");
  for (const Spec& s : specs) {
    py::object bases = s.extra_base != nullptr
                           ? py::object(py::make_tuple(t.base, py::reinterpret_borrow<py::object>(s.extra_base)))
                           : py::object(py::make_tuple(t.base));
    py::object type = make_error_type(m, s.name, s.doc, bases);
    type.attr("code") = py::str(error_code_name(s.code));
    t.by_code[static_cast<std::size_t>(s.code)] = type;
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      raise_error(e);
    }
  });
}

}  // namespace pinload::python
