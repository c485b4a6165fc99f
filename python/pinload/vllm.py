"""pinload as a vLLM model loader: ``vllm serve MODEL --load-format pinload``.

Installing pinload registers the ``vllm.general_plugins`` entry point ``pinload`` (pyproject.toml);
vLLM calls :func:`register` in every process, which registers :class:`PinloadModelLoader` under
the load format ``"pinload"``. The loader is vLLM's default loader (model resolution, Hugging Face
downloads into vLLM's cache, ``model.load_weights``, weight tracking) with the safetensors reads
replaced by pinload's: ``model.load_weights`` is fed by :func:`pinload_weights_iterator`, which
yields each ``(name, tensor)`` as soon as its bytes have arrived (``pinload.iter_tensors``).

Options come from ``--model-loader-extra-config`` (``LoadConfig.model_loader_extra_config``), e.g.
``'{"threads": 16, "connections": 32, "block_size": "8M", "budget": "4G"}'``: every load option of
``pinload.torch.load_files`` passes through (threads, connections, block_size, direct,
files_in_flight, streams, chunk_bytes, staging_bytes, variant, progress, pool_bytes), plus

- ``device``: where pinload puts the tensors ("cpu", default; "cuda" for pinload's pipelined
  device loads, which falls back to "cpu" with a warning where pinload has no CUDA);
- ``dtype``: a torch dtype name; floating-point tensors are cast to it as they are yielded;
- ``cache``: a budget ("16G"): loads go through a process-wide ``pinload.ModelCache``, so a model
  loaded again (a restarted engine in the same process, a switch back) is not read again;
- ``budget``: the streaming memory budget ("4G"), the most host memory the load holds at once
  beyond what vLLM keeps: a device load streams through that much pinned staging memory
  (``staging_bytes``); a host load of local files is read batch by batch, about two batches of
  budget / 4 in flight (``pinload.distributed.iter_sharded`` with one rank; a tensor larger than
  a batch is a batch of its own, so the budget should exceed twice the largest tensor). A host load of
  remote files streams within the budget shard by shard (``pool_bytes``), which needs the budget
  to hold the largest shard; where it does not, it warns and loads without the budget. Not
  with ``cache`` (a cache keeps whole models) or ``staging_bytes`` (the same knob);
- ``connections``: parallel connections for remote files (1..1024; default ``PINLOAD_CONNECTIONS``,
  else 16).

The model may live on object storage or an HTTP server: a model path (or ``--model``) that is
``s3://bucket/prefix/`` (a folder, listed), ``s3://…/model.safetensors.index.json`` or
``http(s)://…/model.safetensors.index.json`` (HTTP has no listing: name the index or the file) is
read by pinload directly, over ``connections`` connections, through its write-through cache where
``PINLOAD_CACHE_DIR`` is set (docs/remote.md); vLLM's own file resolution (Hugging Face downloads)
is skipped for it. Its config must still reach vLLM (``--hf-config-path`` / a local folder).

vLLM's own keys of the default loader (``enable_multithread_load``, ``num_threads``,
``enable_weights_track``) keep their meaning; any other key is a ValueError. A checkpoint without
safetensors files (``.bin``/``.pt``) falls back to vLLM's default iterator, with a warning.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Dict, Iterator, List, Tuple

import torch

from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ._options import LoadKwargs, request, size

logger = logging.getLogger("pinload.vllm")

LOAD_FORMAT = "pinload"

# The load options pinload.torch takes (prefetch is a handle, not a config value).
_PASS_THROUGH = frozenset(LoadKwargs.__annotations__) | {"progress"}
_PLUGIN_KEYS = frozenset({"device", "dtype", "cache", "budget"})
_REMOTE_PREFIXES = ("s3://", "http://", "https://")
_VLLM_KEYS = frozenset({"enable_multithread_load", "num_threads", "enable_weights_track"})

_caches: Dict[int, Any] = {}


def split_extra_config(extra: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(pinload options, vLLM's own keys) of a ``model_loader_extra_config``; raises ValueError for
    an unknown key or a bad value."""
    if not isinstance(extra, dict):
        raise ValueError(f"model_loader_extra_config must be a dict, not {type(extra).__name__}")
    ours, theirs = {}, {}
    for key, value in extra.items():
        if key in _PASS_THROUGH or key in _PLUGIN_KEYS:
            ours[key] = value
        elif key in _VLLM_KEYS:
            theirs[key] = value
        else:
            raise ValueError(
                f"model_loader_extra_config: unknown key {key!r} for load format {LOAD_FORMAT!r}; pinload "
                f"takes {sorted(_PASS_THROUGH | _PLUGIN_KEYS)} and vLLM's {sorted(_VLLM_KEYS)}")
    if "dtype" in ours:
        name = str(ours["dtype"]).replace("torch.", "")
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"model_loader_extra_config: dtype {ours['dtype']!r} is not a torch dtype")
        ours["dtype"] = dtype
    if "budget" in ours:
        ours["budget"] = size(ours["budget"], "budget")
        if ours["budget"] == 0:
            raise ValueError("model_loader_extra_config: budget must be > 0")
        for other in ("cache", "staging_bytes"):
            if other in ours:
                raise ValueError(f"model_loader_extra_config: budget and {other} exclude each other (module docstring)")
    if "device" in ours:
        ours["device"] = str(ours["device"])
        if ours["device"].startswith("cuda"):
            import pinload

            ok, why = pinload.cuda_available()
            if not ok:
                logger.warning("pinload: device %r unavailable (%s); loading to host memory", ours["device"], why)
                ours["device"] = "cpu"
    request(**{k: v for k, v in ours.items() if k in _PASS_THROUGH})  # checks the values now, not mid-load
    return ours, theirs


def is_remote(path: str) -> bool:
    """Whether pinload reads `path` from object storage or an HTTP server (docs/remote.md)."""
    return str(path).startswith(_REMOTE_PREFIXES)


def _remote_source(model_or_path: str, subfolder) -> str:
    """The remote path pinload resolves for a model: the model path, with vLLM's subfolder."""
    path = str(model_or_path)
    if subfolder:
        path = path.rstrip("/") + "/" + str(subfolder).strip("/") + "/"
    return path


def _natural_key(path: str):
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def pinload_weights_iterator(hf_weights_files: List[str], use_tqdm_on_load: bool = False,
                             **options: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` of every tensor of ``hf_weights_files`` as its bytes arrive: the
    iterator vLLM's ``safetensors_weights_iterator`` is, read by pinload. Options as in the module
    docstring (``device``, ``dtype``, ``cache`` and pinload's load options)."""
    import pinload

    options = dict(options)
    dtype = options.pop("dtype", None)
    device = options.pop("device", "cpu")
    cache_budget = options.pop("cache", None)
    budget = options.pop("budget", None)
    options.setdefault("progress", bool(use_tqdm_on_load))
    files = sorted((os.fspath(f) for f in hf_weights_files), key=_natural_key)
    remote = any(is_remote(f) for f in files)
    if budget is not None:
        budget = size(budget, "budget")
        if str(device) != "cpu":
            options["staging_bytes"] = budget  # streaming device load: host memory capped at the budget
            if "block_size" not in options:  # staging holds blocks: a few of them fit the budget
                from pinload import _core

                options["block_size"] = max(4096, min(_core.DEFAULT_BLOCK_SIZE, budget // 4 // 4096 * 4096))
        elif remote:
            # Streaming within the pool budget (Note [Streaming within a budget]): each shard's
            # block is taken as the read reaches it and given back once its tensors are dropped.
            # That needs the budget to hold the largest shard; if it does not (an error before any
            # byte is read), the load goes on without the budget, and says so.
            # Nothing here keeps a tensor once it is yielded: a block held past its file's last
            # tensor would stall the load (Note [Streaming within a budget]).
            source = pinload.iter_tensors(files, device=device, pool_bytes=budget, **options)
            first: List[Tuple[str, torch.Tensor]] = []
            try:
                first.append(next(source))
            except StopIteration:
                return
            except pinload.OutOfMemoryError as e:
                logger.warning("pinload: budget %d holds no whole shard of this remote checkpoint (%s); "
                               "loading without it", budget, e)
                source = pinload.iter_tensors(files, device=device, **options)
            while True:
                if first:
                    name, tensor = first.pop()
                else:
                    try:
                        name, tensor = next(source)
                    except StopIteration:
                        return
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor
                del tensor
        else:
            from pinload.distributed import iter_sharded

            # One rank, no split rules: every tensor whole, read in batches (Note [Shard batches]):
            # about two batches in flight, so a quarter each leaves room for the pool's block
            # rounding and a tensor larger than a batch (a batch of its own).
            source = iter_sharded(files, rank=0, world_size=1, mode="slice", rules=[],
                                  batch_bytes=max(budget // 4, 1),
                                  **{k: options[k] for k in ("threads", "block_size", "direct") if k in options})
            for name, tensor in source:
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor
            return
    if cache_budget is not None:
        cache_bytes = size(cache_budget, "cache")
        cache = _caches.get(cache_bytes)
        if cache is None:
            cache = _caches[cache_bytes] = pinload.ModelCache(
                cache_bytes, **{k: v for k, v in options.items() if k in ("threads", "connections", "block_size",
                                                                       "direct", "files_in_flight", "variant")})
        source = iter(cache.get(files, device=device).items())
    else:
        source = pinload.iter_tensors(files, device=device, **options)
    for name, tensor in source:
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


@register_model_loader(LOAD_FORMAT)
class PinloadModelLoader(DefaultModelLoader):
    """vLLM's default loader with pinload's reads (module docstring)."""

    def __init__(self, load_config) -> None:
        self.pinload_options, vllm_keys = split_extra_config(load_config.model_loader_extra_config or {})
        base_config = copy.copy(load_config)
        base_config.model_loader_extra_config = vllm_keys
        super().__init__(base_config)
        self.load_config = load_config
        # vLLM's file resolution knows its own formats only: resolve as "auto" does (safetensors
        # first, else .bin/.pt, which then go through the fallback).
        self._auto_config = copy.copy(load_config)
        self._auto_config.load_format = "auto"
        self._auto_config.model_loader_extra_config = vllm_keys

    def _prepare_weights(self, model_name_or_path, *args, **kwargs):
        if is_remote(model_name_or_path):
            # pinload resolves it (folder listing, index, file) at load time; nothing to download.
            subfolder = args[0] if args else kwargs.get("subfolder")
            path = _remote_source(model_name_or_path, subfolder)
            return path, [path], True, None
        saved, self.load_config = self.load_config, self._auto_config
        try:
            return super()._prepare_weights(model_name_or_path, *args, **kwargs)
        finally:
            self.load_config = saved

    def _get_weights_iterator(self, source):
        _folder, files, use_safetensors, _index = self._prepare_weights(
            source.model_or_path, source.subfolder, source.revision, source.fall_back_to_pt,
            source.allow_patterns_overrides)
        if not use_safetensors or not files:
            logger.warning("pinload: %s has no safetensors files; falling back to vLLM's default reads",
                           source.model_or_path)
            saved, self.load_config = self.load_config, self._auto_config
            try:
                yield from super()._get_weights_iterator(source)
            finally:
                self.load_config = saved
            return
        if source.is_unused_weight is not None and not any(is_remote(f) for f in files):
            from vllm.model_executor.model_loader.weight_utils import filter_safetensors_files_by_weight_name

            files = filter_safetensors_files_by_weight_name(files, source.is_unused_weight)
        if self.counter_before_loading_weights == 0.0:
            import time

            self.counter_before_loading_weights = time.perf_counter()
        for name, tensor in pinload_weights_iterator(files, self.load_config.use_tqdm_on_load, **self.pinload_options):
            yield source.prefix + name, tensor


def register() -> None:
    """The ``vllm.general_plugins`` entry point: importing this module registered the loader; vLLM
    may call this more than once, in every process."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not PinloadModelLoader:
        register_model_loader(LOAD_FORMAT)(PinloadModelLoader)
