"""scripts/demo.py (the README's first command runs it): cold loads beside safetensors' with the
page cache dropped (or a note why not), warm loads, and a switch back through ModelCache that
reads nothing."""

import importlib.util
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"


def test_demo_shows_cold_warm_and_a_switch(tmp_path, capsys):
    for model, components in (("flux", ("transformer", "vae")), ("sdxl", ("unet", "vae", "text_encoder"))):
        for i, component in enumerate(components):
            (tmp_path / model / component).mkdir(parents=True)
            save_file({"w": torch.full((64, 64), float(i)), "b": torch.ones(8)},
                      str(tmp_path / model / component / "diffusion_pytorch_model.safetensors"))
    spec = importlib.util.spec_from_file_location("demo", SCRIPT)
    demo = importlib.util.module_from_spec(spec)
    sys.modules["demo"] = demo
    spec.loader.exec_module(demo)
    assert demo.main([str(tmp_path / "flux"), str(tmp_path / "sdxl")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"-- cold: (dropped|NOT dropped \(.+\))", out), out
    for model in ("flux", "sdxl"):
        for state in ("cold", "warm"):
            assert re.search(rf"^{model} .* {state} +[0-9.]+ s +[0-9.]+ s +[0-9.]+ x", out, re.M), out
    # Back to the first model: its 2 files from the cache, none read again.
    assert re.search(r"^flux .* back .* from the cache \(hits 2, misses 5\); safetensors: ", out, re.M), out
