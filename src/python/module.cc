// pinload._core: the Python extension module behind python/pinload.
//
// It exposes loads (Loader::load_async on a module-wide pool per device,
// registry.h), their options (options.h), safetensors headers, pool
// statistics and pinload's errors (errors.h), and hands tensor memory to
// Python through DLPack (dlpack_export.h: Note [DLPack export]). Blocking
// calls release the GIL (Note [GIL] in common.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "common.h"
#include "conversions.h"
#include "dlpack_export.h"
#include "errors.h"
#include "handles.h"
#include "options.h"
#include "pinload/copy_engine.h"
#include "pinload/device.h"
#include "pinload/dtype.h"
#include "pinload/env.h"
#include "pinload/loader.h"
#include "pinload/manifest.h"
#include "pinload/pool.h"
#include "pinload/store.h"
#include "registry.h"

#ifndef PINLOAD_VERSION
#define PINLOAD_VERSION "0.0.0"
#endif

namespace pinload::python {
namespace {

py::dict stats_dict(const PoolStats& s, std::string_view backend) {
  py::dict d;
  d["backend"] = py::str(std::string(backend));
  d["capacity"] = s.capacity_bytes;
  d["reserved"] = s.reserved_bytes;
  d["in_use"] = s.in_use_bytes;
  d["peak"] = s.peak_in_use_bytes;
  d["peak_reserved"] = s.peak_reserved_bytes;
  d["allocations"] = s.allocations;
  d["free_list_hits"] = s.free_list_hits;
  d["os_reservations"] = s.os_reservations;
  d["os_releases"] = s.os_releases;
  d["budget_waits"] = s.budget_waits;
  d["live_blocks"] = s.live_blocks;
  d["collapsed"] = s.collapsed_bytes;
  return d;
}

}  // namespace
}  // namespace pinload::python

PYBIND11_MODULE(_core, m) {
  using namespace pinload;
  using namespace pinload::python;
  m.doc() = "pinload's native core: parallel direct-I/O loads into pinned pools, handed out through DLPack.";
  m.attr("__version__") = PINLOAD_VERSION;
  m.attr("DEFAULT_THREADS") = kDefaultThreads;
  m.attr("DEFAULT_BLOCK_SIZE") = kDefaultBlockSize;
  m.attr("DEFAULT_STREAMS") = kDefaultCopyStreams;
  m.attr("DEFAULT_CHUNK_BYTES") = kDefaultCopyChunkBytes;
  m.attr("DEFAULT_STAGING_BYTES") = kDefaultStagingBytes;
  m.attr("DEFAULT_FILES_IN_FLIGHT") = kDefaultFilesInFlight;
  register_errors(m);
  register_options(m);
  register_dlpack(m);
  register_handles(m);
  register_conversions(m);

  m.def(
      "pool_stats",
      [](const std::string& device, std::optional<std::uint64_t> pool_bytes, std::optional<std::uint64_t> staging_bytes) {
        if (pool_bytes && staging_bytes) throw InvalidArgumentError("pool_stats: pool_bytes or staging_bytes, not both");
        std::shared_ptr<Pool> pool;
        if (staging_bytes) {
          Placement placement;
          LoadOptions options;
          options.target.device = device_for(device, &placement);
          if (options.target.device == nullptr) throw InvalidArgumentError("staging_bytes: staging pools are a device's");
          options.target.staging_bytes = *staging_bytes;
          pool = staging_pool_for(options, placement.device());
        } else {
          pool = pool_for(device, pool_bytes);
        }
        return stats_dict(pool->stats(), pool->backend_name());
      },
      py::arg("device") = "cpu", py::arg("pool_bytes") = py::none(), py::arg("staging_bytes") = py::none(),
      "Statistics of the pool shared by loads to `device` (with `pool_bytes`: by the loads with that budget; with "
      "`staging_bytes`: the staging pool of the streaming loads with that budget).");
  m.def(
      "trim_pool",
      [](const std::string& device) {
        auto pool = pool_for(device);
        py::gil_scoped_release release;
        pool->trim();
      },
      py::arg("device") = "cpu", "Returns the idle memory of `device`'s pool to the OS.");
  // Note [Verified loads] (manifest.h): `pinload manifest` from Python.
  m.def(
      "write_manifest",
      [](const std::vector<std::string>& paths, std::optional<std::string> output, std::string variant,
         py::object piece_bytes) -> py::object {
        ManifestOptions options;
        options.variant = std::move(variant);
        if (!piece_bytes.is_none()) options.piece_bytes = size_from_python(piece_bytes, "piece_bytes");
        std::string json;
        {
          py::gil_scoped_release release;
          const Manifest manifest = make_manifest(paths, options);
          if (output) {
            save_manifest(manifest, *output);
          } else {
            json = manifest_to_json(manifest);
          }
        }
        if (output) return py::none();
        return py::str(json);
      },
      py::arg("paths"), py::arg("output") = py::none(), py::kw_only(), py::arg("variant") = "",
      py::arg("piece_bytes") = py::none(),
      "The manifest (docs/manifest.md) of `paths`: written atomically to `output`, or returned as JSON text.");
  m.def("dtype_names", [] {
    py::list out;
    for (int i = 0; i < kDTypeCount; ++i) out.append(py::str(std::string(dtype_name(static_cast<DType>(i)))));
    return out;
  });
  // The node store's status (docs/store.md): what an engine counts for host memory.
  m.def(
      "store_status",
      [](const std::string& socket) {
        StoreStatus s;
        {
          py::gil_scoped_release release;
          s = pinload::store_status(socket);
        }
        py::list entries;
        for (const StoreEntryStatus& e : s.entries) {
          py::dict d;
          d["path"] = e.path;
          d["dtype"] = e.dtype;
          d["bytes"] = e.bytes;
          d["holders"] = e.holders;
          d["hits"] = e.hits;
          entries.append(d);
        }
        py::dict d;
        d["budget_bytes"] = s.budget_bytes;
        d["bytes"] = s.bytes;
        d["huge_page_bytes"] = s.huge_page_bytes;
        d["shmem_huge_pages"] = s.shmem_huge_pages;
        d["hits"] = s.hits;
        d["misses"] = s.misses;
        d["reads"] = s.reads;
        d["bytes_read"] = s.bytes_read;
        d["evictions"] = s.evictions;
        d["clients"] = s.clients;
        d["refused"] = s.refused;
        d["errors"] = s.errors;
        d["numa_node"] = s.numa_node;
        d["entries"] = entries;
        return d;
      },
      py::arg("socket"));
  m.def("default_store_socket", &default_store_socket);
  m.def("built_with_cuda", &built_with_cuda);
  m.def("cuda_available", [] {
    std::string why;
    bool ok = false;
    {
      py::gil_scoped_release release;
      ok = cuda_available(&why);
    }
    return py::make_tuple(ok, why);
  }, "(available, reason): whether pinload can use a CUDA device, and why not.");
}
