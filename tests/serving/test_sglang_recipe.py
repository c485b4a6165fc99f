"""The SGLang recipe of docs/serving.md, run as written where SGLang's model loader imports.

The code block under "## SGLang" is read from the docs and executed, so the test checks what users
copy. Its iterator must yield exactly what the safetensors reference reads from the generated
Llama-shaped checkpoint (names, dtypes, shapes, bytes). Skips with the reason where SGLang does not
import (it is not installed on the development machine).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

try:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader
except Exception as e:  # noqa: BLE001 - any import failure means: no SGLang here
    pytest.skip(f"SGLang's model loader cannot be imported here ({type(e).__name__}: {e})", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def recipe_namespace():
    text = open(os.path.join(ROOT, "docs", "serving.md")).read()
    section = text[text.index("## SGLang"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    ns: dict = {}
    exec(compile(code, "docs/serving.md (SGLang recipe)", "exec"), ns)
    return ns


def test_recipe_iterates_what_safetensors_reads(llama_dir):
    from safetensors.torch import load_file

    loader_class = recipe_namespace()["PinloadSGLangLoader"]
    assert issubclass(loader_class, DefaultModelLoader)
    loader = loader_class(LoadConfig(load_format="auto"))
    source = DefaultModelLoader.Source(llama_dir, None, prefix="p.", fall_back_to_pt=False)
    ours = dict(loader._get_weights_iterator(source))
    theirs = {}
    for f in sorted(os.listdir(llama_dir)):
        if f.endswith(".safetensors"):
            theirs.update({"p." + k: v for k, v in load_file(os.path.join(llama_dir, f)).items()})
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
        assert torch.equal(ours[name].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), name
