#include "options.h"

#include <pybind11/stl.h>

#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "common.h"
#include "pinload/convert.h"
#include "pinload/copy_engine.h"
#include "pinload/device.h"
#include "pinload/error.h"
#include "pinload/size.h"

namespace pinload::python {
namespace {

[[noreturn]] void type_error(const char* option, const char* expected, const py::handle& value) {
  throw py::type_error(std::string(option) + " must be " + expected + ", not " +
                       std::string(py::str(py::type::of(value).attr("__name__"))));
}

// An int >= 0 (not a bool) that fits T.
template <class T>
T count_from_python(const py::handle& value, const char* option) {
  if (PyBool_Check(value.ptr()) || !PyLong_Check(value.ptr())) type_error(option, "an int", value);
  const auto n = value.cast<long long>();
  if (n < 0) throw InvalidArgumentError(std::string(option) + " must be >= 0, not " + std::to_string(n));
  if (static_cast<unsigned long long>(n) > std::numeric_limits<T>::max()) {
    throw InvalidArgumentError(std::string(option) + " is too large: " + std::to_string(n));
  }
  return static_cast<T>(n);
}

DirectIo direct_from_python(const py::handle& value) {
  if (PyBool_Check(value.ptr())) return value.cast<bool>() ? DirectIo::kOn : DirectIo::kOff;
  if (!PyUnicode_Check(value.ptr())) type_error("direct", "'auto', 'on', 'off' or a bool", value);
  const std::string text = value.cast<std::string>();
  const std::optional<DirectIo> direct = parse_direct_io(text);
  if (!direct) throw InvalidArgumentError("direct must be 'auto', 'on' or 'off', not '" + text + "'");
  return *direct;
}

ZeroCopy zero_copy_from_python(const py::handle& value) {
  if (PyBool_Check(value.ptr())) return value.cast<bool>() ? ZeroCopy::kOn : ZeroCopy::kOff;
  if (!PyUnicode_Check(value.ptr())) type_error("zero_copy", "'auto', 'on', 'off' or a bool", value);
  const std::string text = value.cast<std::string>();
  const std::optional<ZeroCopy> zero_copy = parse_zero_copy(text);
  if (!zero_copy) throw InvalidArgumentError("zero_copy must be 'auto', 'on' or 'off', not '" + text + "'");
  return *zero_copy;
}

PageCache page_cache_from_python(const py::handle& value) {
  if (!PyUnicode_Check(value.ptr())) type_error("page_cache", "'auto', 'keep' or 'bypass'", value);
  const std::string text = value.cast<std::string>();
  const std::optional<PageCache> page_cache = parse_page_cache(text);
  if (!page_cache) throw InvalidArgumentError("page_cache must be 'auto', 'keep' or 'bypass', not '" + text + "'");
  return *page_cache;
}

// A conversion dtype from Python: None (as stored), a torch dtype or a name
// ('bfloat16', 'bf16', 'BF16', 'float16', 'half', 'fp16', 'F16', 'float32',
// 'float', 'fp32', 'F32').
std::optional<DType> conversion_dtype_from_python(const py::handle& value, const char* option) {
  if (value.is_none()) return std::nullopt;
  std::string text = py::str(value);
  if (text.rfind("torch.", 0) == 0) text = text.substr(6);
  if (const std::optional<DType> d = parse_conversion_dtype(text)) return d;  // the one table (dtype.h)
  throw InvalidArgumentError(std::string(option) + " must be torch.bfloat16, torch.float16 or torch.float32 (or None), not " +
                             std::string(py::repr(value)));
}

// Name patterns from Python: a str, or an iterable of them.
std::vector<std::string> patterns_from_python(const py::handle& value, const char* option) {
  std::vector<std::string> out;
  if (PyUnicode_Check(value.ptr())) {
    out.push_back(value.cast<std::string>());
    return out;
  }
  for (const py::handle item : py::iter(value)) out.push_back(std::string(py::str(item)));
  (void)option;
  return out;
}

// verify=: a manifest's path (str or os.PathLike), or {file name: sha256
// hex} of whole files (Note [Verified loads] in manifest.h).
VerifyOptions verify_from_python(const py::object& value) {
  VerifyOptions out;
  if (value.is_none()) return out;
  if (PyDict_Check(value.ptr())) {
    for (const auto& [name, digest] : value.cast<py::dict>()) {
      if (!PyUnicode_Check(name.ptr()) || !PyUnicode_Check(digest.ptr())) {
        type_error("verify", "a manifest path or a dict of file name -> sha256 hex (str -> str)", value);
      }
      out.file_sha256.emplace_back(name.cast<std::string>(), digest.cast<std::string>());
    }
    if (out.file_sha256.empty()) throw InvalidArgumentError("verify: an empty dict of digests checks nothing");
    return out;
  }
  if (!PyUnicode_Check(value.ptr()) && !PyObject_HasAttrString(value.ptr(), "__fspath__")) {
    type_error("verify", "a manifest path or a dict of file name -> sha256 hex", value);
  }
  const std::string path = py::module_::import("os").attr("fsdecode")(value).cast<std::string>();
  Manifest manifest;
  {
    py::gil_scoped_release release;
    manifest = load_manifest(path);
  }
  out.manifest = std::make_shared<const Manifest>(std::move(manifest));
  return out;
}

// store=: a socket path (str or os.PathLike), True or "default" for the
// default socket, None or False for none (PINLOAD_STORE still applies: Note
// [Store clients] in store.h).
StoreOptions store_from_python(const py::object& value, const py::object& required) {
  StoreOptions out;
  if (!PyBool_Check(required.ptr())) type_error("store_required", "a bool", required);
  out.required = required.cast<bool>();
  if (value.is_none() || (PyBool_Check(value.ptr()) && !value.cast<bool>())) {
    if (out.required) {
      out = StoreOptions::from_environment(out);
      if (!out.active()) out.socket = default_store_socket();
    }
    return out;
  }
  if (PyBool_Check(value.ptr())) {
    out.socket = default_store_socket();
    return out;
  }
  py::object path = value;
  if (!PyUnicode_Check(value.ptr())) {
    if (!py::hasattr(value, "__fspath__")) type_error("store", "a socket path (str or os.PathLike), True or None", value);
    path = value.attr("__fspath__")();
    if (!PyUnicode_Check(path.ptr())) type_error("store", "a socket path (str or os.PathLike), True or None", value);
  }
  out.socket = path.cast<std::string>();
  if (out.socket == "default") out.socket = default_store_socket();
  if (out.socket.empty()) throw InvalidArgumentError("store must be a socket path, not ''");
  return out;
}

PyLoadOptions make_options(const py::object& threads, const py::object& block_size, const py::object& direct,
                           const py::object& files_in_flight, const py::object& streams, const py::object& chunk_bytes,
                           const py::object& staging_bytes, const py::object& variant, const py::object& dtype,
                           const py::object& keep, const py::object& keep_dtype, const py::object& pool_bytes,
                           const py::object& connections, const py::object& zero_copy, const py::object& verify,
                           const py::object& page_cache, const py::object& store, const py::object& store_required) {
  PyLoadOptions o;
  o.load.threads = count_from_python<unsigned>(threads, "threads");
  o.load.block_size = size_from_python(block_size, "block_size");
  o.load.direct = direct_from_python(direct);
  o.load.files_in_flight = count_from_python<std::size_t>(files_in_flight, "files_in_flight");
  o.load.target.copy.streams = count_from_python<std::size_t>(streams, "streams");
  o.load.target.copy.chunk_bytes = size_from_python(chunk_bytes, "chunk_bytes");
  if (!staging_bytes.is_none()) {
    o.staging_bytes = size_from_python(staging_bytes, "staging_bytes");
    o.load.target.staging_bytes = *o.staging_bytes;
  }
  if (!variant.is_none()) {
    if (!PyUnicode_Check(variant.ptr())) type_error("variant", "a str or None", variant);
    o.load.resolve.variant = variant.cast<std::string>();
  }
  // Note [Conversion on load] in convert.h.
  o.load.dtype.to = conversion_dtype_from_python(dtype, "dtype");
  o.load.dtype.keep = patterns_from_python(keep, "keep");
  o.load.dtype.keep_to = conversion_dtype_from_python(keep_dtype, "keep_dtype");
  if (!pool_bytes.is_none()) {
    o.pool_bytes = size_from_python(pool_bytes, "pool_bytes");
    if (*o.pool_bytes == 0) throw InvalidArgumentError("pool_bytes must be > 0, not 0");
  }
  // Remote sources (docs/remote.md); None: PINLOAD_CONNECTIONS, else 16.
  if (!connections.is_none()) {
    o.load.resolve.remote.connections = count_from_python<unsigned>(connections, "connections");
    if (o.load.resolve.remote.connections == 0) throw InvalidArgumentError("connections must be 1..1024, not 0");
  }
  o.load.zero_copy = zero_copy_from_python(zero_copy);
  o.load.verify = verify_from_python(verify);
  o.load.page_cache = page_cache_from_python(page_cache);
  o.load.store = store_from_python(store, store_required);
  o.load.validate();
  if (o.staging_bytes && *o.staging_bytes == 0) throw InvalidArgumentError("staging_bytes must be > 0, not 0");
  return o;
}

// The keywords of LoadOptions(...), as py::arg names them in register_options (same order).
constexpr const char* kOptionNames[] = {"threads",     "block_size", "direct",   "files_in_flight", "streams",
                                        "chunk_bytes", "staging_bytes", "variant", "dtype",        "keep",
                                        "keep_dtype",  "pool_bytes", "connections", "zero_copy", "verify",
                                        "page_cache",  "store",      "store_required"};

// Note [Unknown options]
// LoadOptions(...) takes every option as a py::object and checks it itself, so pybind11's own
// overload resolution fails only for a keyword it does not know (or a positional argument), and
// then says "incompatible constructor arguments" with the whole signature. A second overload takes
// whatever the first refused and raises TypeError naming the keyword, with the closest option
// (difflib's get_close_matches, as Python's own "Did you mean" does).
[[noreturn]] PyLoadOptions refuse_options(const py::args& args, const py::kwargs& kwargs) {
  if (!args.empty()) throw py::type_error("LoadOptions() takes keyword arguments only");
  py::list known;
  for (const char* name : kOptionNames) known.append(name);
  for (const auto& item : kwargs) {
    const std::string name = py::str(item.first);
    bool found = false;
    for (const char* option : kOptionNames) found = found || name == option;
    if (found) continue;
    std::string text = "unexpected keyword argument '" + name + "'";
    const py::list close = py::module_::import("difflib").attr("get_close_matches")(name, known, 1);
    if (!close.empty()) text += " (did you mean '" + std::string(py::str(close[0])) + "'?)";
    text += "; the load options are " + std::string(py::str(py::str(", ").attr("join")(known)));
    throw py::type_error(text);
  }
  throw py::type_error("LoadOptions(): invalid arguments");
}

const char* kind_name(DeviceSpec::Kind kind) {
  switch (kind) {
    case DeviceSpec::Kind::kHost: return "cpu";
    case DeviceSpec::Kind::kSim: return "sim";
    case DeviceSpec::Kind::kCuda: return "cuda";
  }
  return "?";
}

}  // namespace

LoadOptions PyLoadOptions::for_device(Device* device, bool stream_by_default) const {
  LoadOptions out = load;
  out.target.device = device;
  if (staging_bytes || (device != nullptr && stream_by_default)) out.target.mode = DeviceMode::kStreaming;
  return out;
}

std::uint64_t size_from_python(const py::handle& value, const char* option) {
  if (PyUnicode_Check(value.ptr())) return parse_size_option(value.cast<std::string>(), option);
  return count_from_python<std::uint64_t>(value, option);
}

void register_options(py::module_& m) {
  py::class_<PyLoadOptions>(m, "LoadOptions",
                            "The options of a load, checked once (LoadOptions::validate in include/pinload/loader.h); "
                            "immutable. Sizes are ints or strings such as '64K', '8M', '1G'.")
      .def(py::init(&make_options), py::kw_only(), py::arg("threads") = kDefaultThreads,
           py::arg("block_size") = kDefaultBlockSize, py::arg("direct") = "auto",
           py::arg("files_in_flight") = kDefaultFilesInFlight, py::arg("streams") = kDefaultCopyStreams,
           py::arg("chunk_bytes") = kDefaultCopyChunkBytes, py::arg("staging_bytes") = py::none(),
           py::arg("variant") = py::none(), py::arg("dtype") = py::none(), py::arg("keep") = py::tuple(),
           py::arg("keep_dtype") = py::none(), py::arg("pool_bytes") = py::none(), py::arg("connections") = py::none(),
           py::arg("zero_copy") = "auto", py::arg("verify") = py::none(), py::arg("page_cache") = "auto",
           py::arg("store") = py::none(), py::arg("store_required") = false,
           "verify: a manifest's path (pinload.write_manifest, `pinload manifest`) or a dict {file name: sha256} "
           "of whole files, checked as the bytes are read; a mismatch raises IntegrityError and returns nothing "
           "(docs/manifest.md). zero_copy ('auto', 'on', 'off'; or a bool): host files handed out as leased file mappings (Note "
           "[Zero-copy loads] in loader.h). page_cache ('auto', 'keep', 'bypass'): whether cold files are read "
           "through the page cache and left there for the next process (Note [Keeping the page cache]; "
           "PINLOAD_PAGE_CACHE overrides 'auto'). store: the node store's socket (True or 'default': the default one; "
           "None: PINLOAD_STORE, else none): local files of host loads are mapped from the store's shared copy "
           "(docs/store.md); store_required=True raises UnavailableError where it cannot be reached instead of "
           "loading without it. dtype: converts floating tensors inside the load (torch.bfloat16, torch.float16, torch.float32 or "
           "their names; None: as stored), except names matching a `keep` pattern (those become `keep_dtype`, "
           "or stay as stored). pool_bytes: the budget of the pool the load's blocks come from (one shared pool "
           "per device and budget; None: the device's shared pool). Raises InvalidArgumentError (a ValueError) naming the option for a value out of range, TypeError "
           "for a value of the wrong type or an unknown option.")
      .def(py::init(&refuse_options))  // Note [Unknown options]
      .def_property_readonly("threads", [](const PyLoadOptions& o) { return o.load.threads; })
      .def_property_readonly("block_size", [](const PyLoadOptions& o) { return o.load.block_size; })
      .def_property_readonly("direct", [](const PyLoadOptions& o) { return std::string(direct_io_name(o.load.direct)); })
      .def_property_readonly("files_in_flight", [](const PyLoadOptions& o) { return o.load.files_in_flight; })
      .def_property_readonly("streams", [](const PyLoadOptions& o) { return o.load.target.copy.streams; })
      .def_property_readonly("chunk_bytes", [](const PyLoadOptions& o) { return o.load.target.copy.chunk_bytes; })
      .def_property_readonly("staging_bytes", [](const PyLoadOptions& o) { return o.staging_bytes; })
      .def_property_readonly("variant", [](const PyLoadOptions& o) { return o.load.resolve.variant; })
      .def_property_readonly("dtype",
                             [](const PyLoadOptions& o) -> std::optional<std::string> {
                               if (!o.load.dtype.to) return std::nullopt;
                               return std::string(dtype_name(*o.load.dtype.to));
                             })
      .def_property_readonly("keep", [](const PyLoadOptions& o) { return o.load.dtype.keep; })
      .def_property_readonly("keep_dtype",
                             [](const PyLoadOptions& o) -> std::optional<std::string> {
                               if (!o.load.dtype.keep_to) return std::nullopt;
                               return std::string(dtype_name(*o.load.dtype.keep_to));
                             })
      .def_property_readonly("pool_bytes", [](const PyLoadOptions& o) { return o.pool_bytes; })
      .def_property_readonly("zero_copy",
                             [](const PyLoadOptions& o) { return std::string(zero_copy_name(o.load.zero_copy)); })
      .def_property_readonly("verify",
                             [](const PyLoadOptions& o) -> std::optional<std::string> {
                               if (o.load.verify.manifest) return "manifest";
                               if (o.load.verify.active()) return "sha256";
                               return std::nullopt;
                             },
                             "'manifest', 'sha256' (whole-file digests) or None: what the load is verified against")
      .def_property_readonly("page_cache",
                             [](const PyLoadOptions& o) { return std::string(page_cache_name(o.load.page_cache)); })
      .def_property_readonly("store",
                             [](const PyLoadOptions& o) -> std::optional<std::string> {
                               if (!o.load.store.active()) return std::nullopt;
                               return o.load.store.socket;
                             })
      .def_property_readonly("store_required", [](const PyLoadOptions& o) { return o.load.store.required; })
      .def_property_readonly("connections",
                             [](const PyLoadOptions& o) -> std::optional<unsigned> {
                               const unsigned n = o.load.resolve.remote.connections;
                               return n == 0 ? std::nullopt : std::optional<unsigned>(n);
                             })
      .def("__repr__", [](const PyLoadOptions& o) {
        return "pinload.LoadOptions(threads=" + std::to_string(o.load.threads) +
               ", block_size=" + std::to_string(o.load.block_size) + ", direct='" + direct_io_name(o.load.direct) +
               "', files_in_flight=" + std::to_string(o.load.files_in_flight) +
               ", streams=" + std::to_string(o.load.target.copy.streams) +
               ", chunk_bytes=" + std::to_string(o.load.target.copy.chunk_bytes) + ", staging_bytes=" +
               (o.staging_bytes ? std::to_string(*o.staging_bytes) : std::string("None")) + ", variant='" +
               o.load.resolve.variant + "', dtype=" +
               (o.load.dtype.to ? "'" + std::string(dtype_name(*o.load.dtype.to)) + "'" : std::string("None")) +
               ", pool_bytes=" + (o.pool_bytes ? std::to_string(*o.pool_bytes) : std::string("None")) + ")";
      });

  py::class_<DeviceSpec>(m, "DeviceSpec", "A parsed device string (parse_device_spec in include/pinload/device.h).")
      .def_property_readonly("kind", [](const DeviceSpec& s) { return std::string(kind_name(s.kind)); },
                             "'cpu' (host memory), 'sim' (the CPU stand-in) or 'cuda'.")
      .def_property_readonly(
          "ordinal",
          [](const DeviceSpec& s) -> std::optional<int> {
            if (s.kind != DeviceSpec::Kind::kCuda || !s.ordinal_given) return std::nullopt;
            return s.ordinal;
          },
          "The N of 'cuda:N'; None for 'cuda' (the caller's current device) and for 'cpu' and 'sim'.")
      .def_property_readonly("name", &DeviceSpec::name, "The canonical spelling: 'cpu', 'sim', 'cuda:N'.")
      .def("__repr__", [](const DeviceSpec& s) { return "pinload.DeviceSpec('" + s.name() + "')"; });
  m.def(
      "parse_device_spec", [](const std::string& text) { return parse_device_spec(text); }, py::arg("device"),
      "Parses 'cpu', 'sim', 'cuda' or 'cuda:N'; raises InvalidArgumentError naming 'device' otherwise.");
  m.def(
      "parse_size", [](const py::object& value, const std::string& option) { return size_from_python(value, option.c_str()); },
      py::arg("value"), py::arg("option") = "size",
      "Bytes from an int >= 0 or a size string ('4096', '64K', '8M', '1GiB'); raises InvalidArgumentError naming "
      "`option`.");
}

}  // namespace pinload::python
