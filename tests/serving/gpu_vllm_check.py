"""GPU check of the vLLM plugin (scripts/gpu-check.sh): on one GPU, pinload's iterator against vLLM's
default safetensors iterator (names, dtypes, shapes, bytes), loading to cuda:0; then, where vLLM can
build the model, a tiny Llama loaded with --load-format pinload against the default loader, every
parameter compared. Prints one line "vllm_check: {json}"; exit 0 when every check that ran passed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    res = {}
    try:
        import torch
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        import pinload.vllm
        from llama_ckpt import write_llama
    except Exception as e:  # noqa: BLE001
        print("vllm_check: " + json.dumps({"skipped": f"{type(e).__name__}: {e}"}))
        return 0
    ok = True
    with tempfile.TemporaryDirectory() as d:
        write_llama(d)
        files = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))
        t = time.perf_counter()
        theirs = {n: x.to("cuda:0") for n, x in safetensors_weights_iterator(files, False)}
        res["default_iterator_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ours = dict(pinload.vllm.pinload_weights_iterator(files, False, device="cuda:0"))
        torch.cuda.synchronize()
        res["pinload_iterator_s"] = time.perf_counter() - t
        same = set(ours) == set(theirs) and all(
            ours[n].dtype == theirs[n].dtype and ours[n].shape == theirs[n].shape and ours[n].is_cuda
            and torch.equal(ours[n].view(torch.uint8), theirs[n].view(torch.uint8)) for n in theirs)
        res["iterator_equal"] = same
        ok &= same
        try:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            from vllm import LLM

            params = {}
            for fmt in ("auto", "pinload"):
                llm = LLM(model=d, load_format=fmt, skip_tokenizer_init=True, enforce_eager=True,
                          gpu_memory_utilization=0.2, max_model_len=128, dtype="bfloat16")
                params[fmt] = llm.apply_model(lambda m: {n: p.detach().cpu() for n, p in m.named_parameters()})[0]
                del llm
                torch.cuda.empty_cache()
            a, b = params["auto"], params["pinload"]
            res["model_params"] = len(a)
            res["model_equal"] = set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
            ok &= res["model_equal"]
        except Exception as e:  # noqa: BLE001 - the model-level half depends on the vLLM build
            res["model_skipped"] = f"{type(e).__name__}: {e}"[:500]
    res["ok"] = bool(ok)
    print("vllm_check: " + json.dumps(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
