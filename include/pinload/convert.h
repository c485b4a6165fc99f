// pinload/convert.h: FP8 copies of checkpoints (convert once), and the
// dtype a load hands tensors out in (convert on the way).
//
// convert_checkpoint() reads any checkpoint pinload reads (a file, an index,
// a model folder, a diffusers pipeline folder) and writes an FP8 copy in
// ComfyUI's layout (Note [FP8 layout]). A load with LoadOptions::dtype set
// (loader.h) turns the stored elements into that dtype inside the copy that
// happens anyway (Note [Conversion on load]).
//
// Note [FP8 layout]
// For every quantised weight `<layer>.weight` (F8_E4M3 or F8_E5M2) the file
// holds `<layer>.weight_scale` (F32; shape [] per tensor, [rows, 1] per row)
// and `<layer>.comfy_quant`, a U8 tensor holding the JSON
// {"format": "float8_e4m3fn"} (or "float8_e5m2"). The header's __metadata__
// keeps the source's keys and adds `_quantization_metadata`, the JSON
// {"format_version": "1.0", "layers": {"<layer>": {"format": ...}}} of the
// layers in that file. Dequantised, a weight is fp8.to(float32) * scale.
// Quantised are the 2-D floating (F32, F16, BF16) tensors named `*.weight`
// that no keep rule matches; kept as they are: every other tensor, and
// names with a dotted part containing "norm" or "embed" (norms, embeddings),
// plus ConvertOptions::keep.
//
// Note [FP8 clamp]
// The scale is amax(|w|) / max (max = 448 for e4m3fn, 57344 for e5m2; 1
// where amax is 0), per tensor or per row, and the stored value is
// fp8(clamp(float32(w) / scale, -max, max)): torch's float-to-fp8 cast did
// not saturate before 2.9 (a value past the range became NaN), so the clamp
// is part of the format's definition and matches
// `(w.float() / scale).clamp(-max, max).to(fp8)` bit for bit.
//
// Note [Converted file layout]
// Output is written to a temporary name next to the target and renamed onto
// it once complete and fsync'ed (a folder: the whole folder is), so a crash
// leaves no output, only a `.pinload-tmp-*` that a later convert of the same
// target removes. Shards keep their names; every index is rewritten with the
// new scale and marker tensors mapped to their weight's shard. Other files of
// a folder (configs, tokenizers) are copied. The JSON header is padded with
// spaces so that the data section starts at a multiple of 4096, and tensors
// are laid out by decreasing power-of-two alignment of their sizes (up to
// 4096), so the large ones start at 4096-byte multiples as direct I/O wants,
// without the holes safetensors forbids.
//
// Note [Conversion on load]
// LoadOptions::dtype = {to, keep}: every floating tensor whose name no keep
// pattern matches is handed out as `to`; an FP8 weight with a scale in the
// checkpoint (ComfyUI's `<layer>.weight_scale`, or `<layer>.scale_weight` of
// older "scaled fp8" files) is dequantised with it, and the scale and
// `.comfy_quant` tensors it used are not handed out. Kept tensors stay as
// stored, or become keep_to when set; a kept FP8 tensor is dequantised to
// keep_to (F32 unless set): a conversion load never hands out FP8. Host
// loads convert each chunk out of the read block as it arrives, on
// converting threads beside the readers (Note [Converting beside the reads]
// in src/load/convert_on_load.cc: one per CPU, at most `threads`); a load
// converting most of its bytes reads them into a ring of staging blocks
// (24 chunks, 16 of them being read, 192 MiB at most) released once
// converted (Note [Staged conversion]);
// device loads copy the stored (smaller) bytes to the device and convert
// there (Device::convert_async: a CUDA kernel on a copy stream, or the CPU
// for "sim"), so FP8 crosses PCIe at half the bytes. Rounding is torch's
// (Note [Rounding as torch] in src/format/dtype_bits.h).
//
// Errors: InvalidFileError naming the tensor for a scale of the wrong dtype
// (not F32) or shape, for a quantised layer (a comfy_quant marker or
// _quantization_metadata entry) whose scale is missing, and for dtypes that
// cannot be converted.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "pinload/checkpoint.h"
#include "pinload/dtype.h"
#include "pinload/env.h"

namespace pinload {

// Whether a keep pattern matches a tensor name: a pattern with * ? or [ is
// a glob (fnmatch) over the whole name; any other pattern matches a run of
// whole dotted parts ("time_embed" matches "time_embed.0.weight" and
// "unet.time_embed.bias", not "time_embedding.weight").
bool keep_pattern_matches(const std::string& pattern, const std::string& name);

// The dtype a load hands tensors out in (Note [Conversion on load]).
struct DTypeOptions {
  std::optional<DType> to;         // unset: as stored
  std::vector<std::string> keep;   // patterns not converted to `to`
  // Kept tensors: unset, as stored (FP8 ones dequantised to F32); set, this
  // dtype (diffusers' keep_in_fp32_modules: F32).
  std::optional<DType> keep_to;
  bool active() const noexcept { return to.has_value(); }
};

enum class ScaleMode { kPerTensor, kPerRow };

struct ConvertOptions {
  DType to = DType::kF8_E4M3;  // or kF8_E5M2
  ScaleMode scale = ScaleMode::kPerTensor;
  std::vector<std::string> keep;  // kept beyond the default rules
  unsigned threads = 8;
  // Each thread reads and converts pieces of at most this many bytes:
  // memory stays within threads * (piece + its fp8 output).
  std::size_t piece_bytes = 16u << 20;
  ResolveOptions resolve;
  // Tests: called on a worker after each tensor is written, from several
  // workers at once; a throw aborts the conversion like any other failure.
  std::function<void(const std::string& tensor)> after_tensor;
  // Set (by a signal handler, say): the conversion stops before its next
  // piece and throws CancelledError, leaving nothing behind.
  const std::atomic<bool>* stop = nullptr;
};

struct ConvertStats {
  std::uint64_t files = 0;
  std::uint64_t tensors_quantized = 0;
  std::uint64_t tensors_kept = 0;
  std::uint64_t bytes_in = 0;   // input safetensors files, headers included (as bytes_out)
  std::uint64_t bytes_out = 0;  // output safetensors files, headers included
};

// Whether convert_checkpoint quantises a tensor (Note [FP8 layout]).
bool quantizes(const TensorInfo& tensor, const std::vector<std::string>& keep);

// Converts `input` (a .safetensors file, an index, a model or pipeline
// folder) to `output`: a file for a file input, else a folder with the same
// layout. Blocks; runs options.threads workers. `output` must not be the
// input. An existing output file is replaced; an existing output folder is
// an InvalidFileError. Throws pinload::Error; on a throw nothing is left at
// `output` and the temporary is removed. `env` null: the POSIX env (reads).
ConvertStats convert_checkpoint(const std::string& input, const std::string& output,
                                const ConvertOptions& options = {}, Env* env = nullptr);

}  // namespace pinload
