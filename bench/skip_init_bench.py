#!/usr/bin/env python3
"""How long building a full-size FLUX transformer takes, normally and on the meta device.

    bench/skip_init_bench.py [--dtype float32|bfloat16] [--repeat N] [--full]
                             [--config key=value ...]

"normal" is ``FluxTransformer2DModel(**config)``: every parameter allocated and initialised (the
work ``load_state_dict`` then overwrites). "meta" is ``pinload.skip_init.empty_model`` of the same
config: shapes only. The default config is diffusers' default, i.e. FLUX.1's 12B-parameter
transformer (47.6 GB in float32). When the normal build would not fit in the memory available,
the normal time is extrapolated by parameter count from a build with the same widths and fewer
blocks (say so with ``--full`` to build it anyway); the output says which it did.
"""

from __future__ import annotations

import argparse
import ast
import gc
import time
from typing import Any, Dict, Tuple


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _parse_config(items) -> Dict[str, Any]:
    config: Dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--config takes key=value, not {item!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        config[key] = tuple(value) if isinstance(value, list) else value
    return config


def _count(model) -> Tuple[int, int]:
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, nbytes


def _time_normal(cls, config, dtype, repeat) -> Tuple[float, int]:
    import torch

    best = float("inf")
    params = 0
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        for _ in range(repeat):
            gc.collect()
            start = time.perf_counter()
            model = cls(**config)
            best = min(best, time.perf_counter() - start)
            params = _count(model)[0]
            del model
            gc.collect()
    finally:
        torch.set_default_dtype(previous)
    return best, params


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/skip_init_bench.py", description=__doc__.split("\n")[1])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="default dtype of the build (diffusers builds in float32 unless told)")
    parser.add_argument("--repeat", type=int, default=3, help="builds per measurement (best is shown)")
    parser.add_argument("--full", action="store_true", help="build the full model normally even if it will not fit")
    parser.add_argument("--config", nargs="*", metavar="KEY=VALUE",
                        help="FluxTransformer2DModel arguments to override (axes_dims_rope=[4,6,6])")
    args = parser.parse_args(argv)

    import torch
    from diffusers import FluxTransformer2DModel

    from pinload.skip_init import empty_model

    dtype = getattr(torch, args.dtype)
    config = _parse_config(args.config)

    meta_best = float("inf")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        for _ in range(max(1, args.repeat)):
            start = time.perf_counter()
            model = empty_model(FluxTransformer2DModel, **config)
            meta_best = min(meta_best, time.perf_counter() - start)
    finally:
        torch.set_default_dtype(previous)
    params, nbytes = _count(model)
    full_config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    del model
    layers = f"num_layers={full_config['num_layers']}, num_single_layers={full_config['num_single_layers']}"
    print(f"FluxTransformer2DModel ({layers}): {params / 1e9:.2f}e9 parameters, {nbytes / 1e9:.1f} GB in {args.dtype}")
    print(f"meta   (pinload.skip_init.empty_model): {meta_best:8.3f} s  (best of {max(1, args.repeat)})")

    available = _available_bytes()
    fits = available == 0 or nbytes < 0.7 * available
    if fits or args.full:
        normal, _ = _time_normal(FluxTransformer2DModel, config, dtype, max(1, args.repeat))
        how = f"best of {max(1, args.repeat)}"
    else:
        small = dict(config, num_layers=1, num_single_layers=2)
        small_time, small_params = _time_normal(FluxTransformer2DModel, small, dtype, 1)
        normal = small_time * params / small_params
        how = (f"extrapolated by parameter count from a num_layers=1, num_single_layers=2 build: {small_time:.2f} s "
               f"for {small_params / 1e9:.2f}e9 parameters; the full build needs {nbytes / 1e9:.1f} GB, "
               f"{available / 1e9:.1f} GB available (--full builds it anyway)")
    print(f"normal (allocate + initialise):         {normal:8.3f} s  ({how})")
    print(f"speed-up of skip-init construction: {normal / meta_best:.0f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
