#include "conversions.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "format/dtype_convert.h"
#include "pinload/convert.h"
#include "pinload/device.h"
#include "pinload/error.h"
#include "pinload/loader.h"
#include "registry.h"

namespace pinload::python {
namespace {

DType dtype_named(const std::string& name) {
  const std::optional<DType> d = dtype_from_name(name);
  if (!d) throw InvalidArgumentError("unknown dtype '" + name + "'");
  return *d;
}

ElementConversion conversion_of(const std::string& src_dtype, const std::string& dst_dtype, std::size_t src_bytes,
                                float scale, const std::optional<std::string>& row_scales, std::uint64_t row_elements) {
  ElementConversion c;
  c.from = dtype_named(src_dtype);
  c.to = dtype_named(dst_dtype);
  if (!is_convertible(c.from, c.to)) throw InvalidArgumentError("no conversion from " + src_dtype + " to " + dst_dtype);
  const unsigned in = dtype_bits(c.from) / 8;
  if (src_bytes % in != 0) throw InvalidArgumentError("source bytes are not whole elements");
  c.elements = src_bytes / in;
  c.scale = scale;
  if (row_scales) {
    if (row_elements == 0 || row_scales->size() % 4 != 0 ||
        row_scales->size() / 4 * row_elements < c.elements) {
      throw InvalidArgumentError("row_scales must hold one float32 per row of row_elements elements");
    }
    c.row_elements = row_elements;
  }
  return c;
}

// Host: the loops the reader threads run.
py::bytes convert_bytes(const std::string& src, const std::string& src_dtype, const std::string& dst_dtype,
                        float scale, const std::optional<std::string>& row_scales, std::uint64_t row_elements) {
  ElementConversion c = conversion_of(src_dtype, dst_dtype, src.size(), scale, row_scales, row_elements);
  if (row_scales) c.row_scales = reinterpret_cast<const float*>(row_scales->data());
  std::string out(c.elements * (dtype_bits(c.to) / 8), '\0');
  convert_elements(c, src.data(), out.data());
  return py::bytes(out);
}

// A device ("sim", "cuda:N"): copy up, Device::convert_async on a stream, copy back.
py::bytes convert_bytes_on_device(const std::string& device_spec, const std::string& src, const std::string& src_dtype,
                                  const std::string& dst_dtype, float scale,
                                  const std::optional<std::string>& row_scales, std::uint64_t row_elements) {
  const ElementConversion base = conversion_of(src_dtype, dst_dtype, src.size(), scale, row_scales, row_elements);
  std::string out(base.elements * (dtype_bits(base.to) / 8), '\0');
  {
    py::gil_scoped_release release;
    Placement placement;
    Device* device = device_for(device_spec, &placement);
    if (device == nullptr) throw InvalidArgumentError("device must be 'sim' or 'cuda:N' here, not '" + device_spec + "'");
    Stream stream = device->create_stream();
    auto in_buf = device->allocate(std::max<std::size_t>(src.size(), 1));
    auto out_buf = device->allocate(std::max<std::size_t>(out.size(), 1));
    std::shared_ptr<DeviceBuffer> rows;
    ElementConversion c = base;
    if (row_scales) {
      rows = device->allocate(std::max<std::size_t>(row_scales->size(), 1));
      device->copy_to_device_async(*rows, 0, row_scales->data(), row_scales->size(), stream);
      c.row_scales = static_cast<const float*>(rows->data());
    }
    if (!src.empty()) device->copy_to_device_async(*in_buf, 0, src.data(), src.size(), stream);
    device->convert_async(*out_buf, 0, *in_buf, 0, c, stream);
    stream.synchronize();
    if (!out.empty()) device->copy_to_host(out.data(), *out_buf, 0, out.size());
  }
  return py::bytes(out);
}

py::bytes quantize_bytes(const std::string& src, const std::string& src_dtype, const std::string& dst_dtype,
                         float scale, const std::optional<std::string>& row_scales, std::uint64_t row_elements) {
  const DType from = dtype_named(src_dtype);
  const DType to = dtype_named(dst_dtype);
  const unsigned in = dtype_bits(from) / 8;
  const std::uint64_t n = src.size() / in;
  std::string out(n, '\0');
  quantize_elements(from, to, src.data(), reinterpret_cast<std::uint8_t*>(out.data()), n, scale,
                    row_scales ? reinterpret_cast<const float*>(row_scales->data()) : nullptr, row_elements, 0);
  return py::bytes(out);
}

py::dict convert_file(const std::string& input, const std::string& output, const std::string& to,
                      const std::string& scale, const std::vector<std::string>& keep, unsigned threads,
                      const std::string& variant) {
  ConvertOptions options;
  if (to == "fp8-e4m3fn" || to == "F8_E4M3") options.to = DType::kF8_E4M3;
  else if (to == "fp8-e5m2" || to == "F8_E5M2") options.to = DType::kF8_E5M2;
  else throw InvalidArgumentError("to must be 'fp8-e4m3fn' or 'fp8-e5m2', not '" + to + "'");
  if (scale == "per-tensor") options.scale = ScaleMode::kPerTensor;
  else if (scale == "per-row") options.scale = ScaleMode::kPerRow;
  else throw InvalidArgumentError("scale must be 'per-tensor' or 'per-row', not '" + scale + "'");
  if (threads == 0 || threads > kMaxThreads) {
    throw InvalidArgumentError("threads must be 1.." + std::to_string(kMaxThreads) + ", not " + std::to_string(threads));
  }
  options.keep = keep;
  options.threads = threads;
  options.resolve.variant = variant;
  ConvertStats s;
  {
    py::gil_scoped_release release;
    s = convert_checkpoint(input, output, options);
  }
  py::dict d;
  d["files"] = s.files;
  d["tensors_quantized"] = s.tensors_quantized;
  d["tensors_kept"] = s.tensors_kept;
  d["bytes_in"] = s.bytes_in;
  d["bytes_out"] = s.bytes_out;
  return d;
}

}  // namespace

void register_conversions(py::module_& m) {
  m.def("convert_bytes", &convert_bytes, py::arg("src"), py::arg("src_dtype"), py::arg("dst_dtype"),
        py::arg("scale") = 1.0f, py::arg("row_scales") = py::none(), py::arg("row_elements") = 0,
        "Converts raw little-endian elements as a conversion load does on the host (float(x) * scale, rounded "
        "as torch's .to()); row_scales: float32 bytes, one per row of row_elements elements.");
  m.def("convert_bytes_on_device", &convert_bytes_on_device, py::arg("device"), py::arg("src"), py::arg("src_dtype"),
        py::arg("dst_dtype"), py::arg("scale") = 1.0f, py::arg("row_scales") = py::none(),
        py::arg("row_elements") = 0,
        "convert_bytes through a device ('sim' or 'cuda:N'): copied up, converted by Device::convert_async, "
        "copied back.");
  m.def("quantize_bytes", &quantize_bytes, py::arg("src"), py::arg("src_dtype"), py::arg("dst_dtype"),
        py::arg("scale") = 1.0f, py::arg("row_scales") = py::none(), py::arg("row_elements") = 0,
        "fp8(clamp(float(x) / scale, +-max)) as pinload convert writes it.");
  m.def("convert", &convert_file, py::arg("input"), py::arg("output"), py::arg("to") = "fp8-e4m3fn",
        py::arg("scale") = "per-tensor", py::arg("keep") = std::vector<std::string>{}, py::arg("threads") = 8,
        py::arg("variant") = "",
        "Writes an FP8 copy of a checkpoint in ComfyUI's layout (include/pinload/convert.h); returns stats.");
}

}  // namespace pinload::python
