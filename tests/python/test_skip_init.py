"""pinload.skip_init: meta construction, assign-loading, buffer re-materialisation, ties."""

import math
import subprocess
import sys
import os

import pytest
import torch
from torch import nn
import safetensors.torch as st

import pinload
from pinload import skip_init
from pl_helpers import DEVICES, in_use

# The construction benchmark lives in bench/, outside the package.
_SKIP_INIT_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench", "skip_init_bench.py")


class Rotary(nn.Module):
    """Holds only non-persistent buffers computed from its arguments (like a rotary embedding)."""

    def __init__(self, dim, base=10000.0, max_len=16):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("position_ids", torch.arange(max_len).unsqueeze(0), persistent=False)

    def forward(self, x):
        t = self.position_ids[0, : x.shape[1]].float()
        freqs = torch.outer(t, self.inv_freq)
        return x * freqs.cos().repeat(1, 2)


class Toy(nn.Module):
    def __init__(self, vocab=11, dim=8, tie=False, base=500.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rotary = Rotary(dim, base=base)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("scale", torch.full((dim,), 0.5))  # persistent: in the checkpoint
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.rotary(self.embed(ids))
        return self.head(self.norm(self.proj(h)) * self.scale)


IDS = torch.tensor([[1, 2, 3, 4, 5]])


@pytest.fixture
def toy_file(tmp_path):
    torch.manual_seed(0)
    model = Toy().eval()
    path = tmp_path / "toy.safetensors"
    st.save_file(model.state_dict(), str(path))
    return model, path


def test_empty_model_is_on_meta_and_costs_no_init(monkeypatch):
    calls = []
    monkeypatch.setattr(nn.Linear, "reset_parameters",
                        lambda self: calls.append(self.weight.device.type))
    model = skip_init.empty_model(Toy, vocab=11, dim=8)
    assert set(skip_init.meta_tensors(model)) == {n for n, _ in model.named_parameters()} | {
        n for n, _ in model.named_buffers()}
    assert calls and set(calls) == {"meta"}  # any init ran on meta: no memory, no work


def test_empty_model_restores_module_classes():
    before = {cls: cls.__dict__.get("__init__") for cls in skip_init._module_classes()}
    skip_init.empty_model(Toy)
    after = {cls: cls.__dict__.get("__init__") for cls in before}
    assert before == after
    with pytest.raises(ZeroDivisionError):
        skip_init.empty_model(lambda: 1 / 0)
    assert before == {cls: cls.__dict__.get("__init__") for cls in before}


@pytest.mark.parametrize("device", DEVICES)
def test_load_into_matches_a_normal_load(toy_file, device):
    model, path = toy_file
    empty = skip_init.empty_model(Toy)
    loaded = skip_init.load_into(empty, path, device=device)
    assert loaded is empty
    assert not skip_init.meta_tensors(loaded)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name].cpu(), t), name
    # The non-persistent buffers, absent from the file, were re-created by re-running Rotary's init.
    assert torch.equal(loaded.rotary.inv_freq.cpu(), model.rotary.inv_freq)
    assert torch.equal(loaded.rotary.position_ids.cpu(), model.rotary.position_ids)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(IDS.to(loaded.proj.weight.device)).cpu(), model(IDS))


def test_rebuild_uses_the_recorded_arguments(tmp_path):
    torch.manual_seed(0)
    model = Toy(base=3.0)
    path = tmp_path / "toy3.safetensors"
    st.save_file(model.state_dict(), str(path))
    loaded = skip_init.load_into(skip_init.empty_model(Toy, base=3.0), path)
    assert torch.equal(loaded.rotary.inv_freq, model.rotary.inv_freq)
    assert not torch.equal(loaded.rotary.inv_freq, Toy().rotary.inv_freq)


def test_assign_is_zero_copy_and_cpu_first(toy_file):
    model, path = toy_file
    base = in_use()
    loaded = skip_init.load_into(skip_init.empty_model(Toy), path)
    assert in_use() > base  # the parameters are the pool tensors, not copies
    del loaded
    assert in_use() == base


def test_init_buffers_hook_wins(toy_file):
    model, path = toy_file

    class Hooked(Rotary):
        def _init_buffers(self):
            self.register_buffer("inv_freq", torch.full((4,), 7.0), persistent=False)
            self.register_buffer("position_ids", torch.arange(16).unsqueeze(0), persistent=False)

    class ToyHooked(Toy):
        def __init__(self):
            super().__init__()
            self.rotary = Hooked(8)

    with torch.device("meta"):  # not built by empty_model: only the hook can help
        empty = ToyHooked()
    loaded = skip_init.load_into(empty, path)
    assert torch.equal(loaded.rotary.inv_freq, torch.full((4,), 7.0))


def test_unrecoverable_buffer_is_named(toy_file):
    _, path = toy_file
    with torch.device("meta"):
        empty = Toy()  # no recorded constructor arguments, no hook
    with pytest.raises(RuntimeError, match=r"rotary\.inv_freq.*_init_buffers"):
        skip_init.load_into(empty, path)


def test_missing_parameter(tmp_path, toy_file):
    model, _ = toy_file
    sd = {k: v for k, v in model.state_dict().items() if k != "proj.bias"}
    with pytest.raises(RuntimeError, match="proj.bias"):
        skip_init.load_into(skip_init.empty_model(Toy), sd)  # strict: torch's missing-key error
    with pytest.raises(RuntimeError, match="still on the meta device.*proj.bias"):
        skip_init.load_into(skip_init.empty_model(Toy), sd, strict=False)


def test_tied_weights_stay_tied(tmp_path):
    torch.manual_seed(1)
    model = Toy(tie=True).eval()
    path = tmp_path / "tied.safetensors"
    st.save_model(model, str(path))  # writes the shared tensor once
    with pinload.safe_open(path) as f:
        assert len([k for k in f.keys() if k in ("embed.weight", "head.weight")]) == 1
    loaded = skip_init.load_into(skip_init.empty_model(Toy, tie=True), path)
    assert loaded.head.weight is loaded.embed.weight
    with torch.no_grad():
        assert torch.equal(loaded.eval()(IDS), model(IDS))


def test_dtype_cast(toy_file):
    _, path = toy_file
    loaded = skip_init.load_into(skip_init.empty_model(Toy), path, dtype=torch.float64)
    assert loaded.proj.weight.dtype == torch.float64
    assert loaded.rotary.position_ids.dtype == torch.int64


def test_load_options_pass_through(toy_file):
    model, path = toy_file
    loaded = skip_init.load_into(skip_init.empty_model(Toy), [path], threads=1, block_size="4K", direct="off")
    assert torch.equal(loaded.proj.weight, model.proj.weight)
    with pytest.raises(ValueError):
        skip_init.load_into(skip_init.empty_model(Toy), path, threads=0)


def test_bench_module_runs_on_a_tiny_flux():
    pytest.importorskip("diffusers")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run(
        [sys.executable, _SKIP_INIT_BENCH, "--repeat", "1", "--config",
         "num_layers=1", "num_single_layers=1", "num_attention_heads=2", "attention_head_dim=16",
         "joint_attention_dim=32", "pooled_projection_dim=16", "axes_dims_rope=[4,6,6]"],
        capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "normal" in out.stdout and "meta" in out.stdout and "speed-up" in out.stdout
