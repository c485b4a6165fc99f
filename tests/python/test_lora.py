"""pinload.lora: adapters in the pool, fused in place, unfused by restoring the pristine copy.

A tiny SDXL-like pipeline (UNet2DConditionModel with SDXL's block structure, two CLIP text
encoders; random weights built here) and adapters generated in each key layout (kohya / A1111 with
SGM block names, diffusers / PEFT with adapter metadata, ComfyUI). Fused weights are checked
against a float64 reference (tolerances below, per dtype) and against diffusers'
``load_lora_weights`` + ``fuse_lora``; switches and unfuse are checked bit for bit against the base.
"""

from __future__ import annotations

import copy
import gc
import json
import random

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.torch")

import pinload  # noqa: E402
import pinload.lora as pl  # noqa: E402
import pinload.lora.fuser as lora_fuser  # noqa: E402
import pinload.torch as pt  # noqa: E402

from pl_helpers import DEVICES  # noqa: E402

#: |fused - float64 reference| <= TOL[dtype] * (|reference| + sum |c| * (|up| @ |down|)):
#: one rounding to the weight's dtype (half an ulp, 2^-9 for bf16, 2^-12 for fp16) allowed as a full
#: ulp, and for fp32 the float32 accumulation of a rank-r product (r * 2^-24, r <= 16) with margin.
TOL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -18}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one intra-op thread. With two, each small matmul may wait for the other thread
    to be scheduled, and on a loaded 2-core machine that made a test of 100 switches take minutes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- a tiny SDXL-like pipeline ----


def _unet(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
        cross_attention_dim=64, norm_num_groups=1)
    return unet.to(dtype)


def _text_encoders(dtype=torch.float32, seed=1):
    torch.manual_seed(seed)
    cfg = transformers.CLIPTextConfig(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                                      vocab_size=1000, projection_dim=32, bos_token_id=0, eos_token_id=2,
                                      pad_token_id=1)
    return (transformers.CLIPTextModel(cfg).to(dtype), transformers.CLIPTextModelWithProjection(cfg).to(dtype))


def _pipeline(dtype=torch.float32):
    """A fresh copy of the pipeline of ``dtype`` (built once per dtype: the build is most of a test's time)."""
    cached = _PIPELINES.get(dtype)
    if cached is None:
        cached = _PIPELINES[dtype] = _build_pipeline(dtype)
    return copy.deepcopy(cached)


_PIPELINES: dict = {}


def _build_pipeline(dtype):
    te1, te2 = _text_encoders(dtype)
    vae = diffusers.AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                                  up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=4)
    return diffusers.StableDiffusionXLPipeline(vae=vae, text_encoder=te1, text_encoder_2=te2, tokenizer=None,
                                               tokenizer_2=None, unet=_unet(dtype),
                                               scheduler=diffusers.EulerDiscreteScheduler())


def _state(pipe_or_module):
    """name -> clone of every weight (the fuser's flat names)."""
    if isinstance(pipe_or_module, torch.nn.Module):
        return {k: v.detach().clone() for k, v in pipe_or_module.state_dict().items()}
    return {f"{c}/{k}": v.detach().clone() for c in ("unet", "text_encoder", "text_encoder_2")
            for k, v in getattr(pipe_or_module, c).state_dict().items()}


# ---- adapters: one logical adapter, written in each layout ----

# Modules of the tiny UNet an adapter targets (diffusers names), and their SGM names for kohya and
# ComfyUI: CrossAttnDownBlock2D down_blocks.1 -> input_blocks.4/5, mid -> middle_block.1,
# CrossAttnUpBlock2D up_blocks.0 -> output_blocks.0/1/2 (layers_per_block 2).
_UNET_ATTN = [("down_blocks.1.attentions.0", "input_blocks.4.1"), ("down_blocks.1.attentions.1", "input_blocks.5.1"),
              ("mid_block.attentions.0", "middle_block.1"), ("up_blocks.0.attentions.2", "output_blocks.2.1")]
_ATTN_LEAVES = ["proj_in", "proj_out", "transformer_blocks.0.attn1.to_q", "transformer_blocks.0.attn1.to_k",
                "transformer_blocks.0.attn1.to_v", "transformer_blocks.0.attn1.to_out.0",
                "transformer_blocks.1.attn2.to_q", "transformer_blocks.1.attn2.to_k", "transformer_blocks.1.ff.net.0.proj",
                "transformer_blocks.1.ff.net.2"]
_TE_LEAVES = ["encoder.layers.0.self_attn.q_proj", "encoder.layers.1.self_attn.out_proj", "encoder.layers.1.mlp.fc1",
              "encoder.layers.0.mlp.fc2"]


def _unet_targets(unet):
    out = []
    names = dict(unet.named_modules())
    for diff, sgm in _UNET_ATTN:
        for leaf in _ATTN_LEAVES:
            if f"{diff}.{leaf}" in names:
                out.append((f"{diff}.{leaf}", f"{sgm}.{leaf}"))
    return out


def make_adapter(pipe, rank=4, alpha=8.0, seed=0, dtype=torch.float32, text=True, conv=False):
    """{(component, diffusers module, sgm or None): (down, up)} with random values; alpha for all."""
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    unet = pipe.unet if hasattr(pipe, "unet") else pipe
    mods = dict(unet.named_modules())
    for diff, sgm in _unet_targets(unet):
        w = mods[diff].weight
        pairs[("unet", diff, sgm)] = (torch.randn(rank, w.shape[1], generator=g).to(dtype) * 0.2,
                                      torch.randn(w.shape[0], rank, generator=g).to(dtype) * 0.2)
    if conv:
        w = mods["down_blocks.1.resnets.0.conv1"].weight
        pairs[("unet", "down_blocks.1.resnets.0.conv1", "input_blocks.4.0.in_layers.2")] = (
            torch.randn(rank, w.shape[1], 3, 3, generator=g).to(dtype) * 0.2,
            torch.randn(w.shape[0], rank, 1, 1, generator=g).to(dtype) * 0.2)
    if text:
        for comp in ("text_encoder", "text_encoder_2"):
            te = getattr(pipe, comp)
            tm = dict(te.named_modules())
            for leaf in _TE_LEAVES:
                leaf = leaf if leaf in tm else f"text_model.{leaf}"  # CLIPTextModel is flattened in transformers 5
                w = tm[leaf].weight
                pairs[(comp, leaf, None)] = (torch.randn(rank, w.shape[1], generator=g).to(dtype) * 0.2,
                                             torch.randn(w.shape[0], rank, generator=g).to(dtype) * 0.2)
    return {"pairs": pairs, "alpha": alpha, "rank": rank}


def write_peft(adapter, path, with_metadata=True):
    sd, meta = {}, {}
    for (comp, mod, _), (down, up) in adapter["pairs"].items():
        sd[f"{comp}.{mod}.lora_A.weight"] = down
        sd[f"{comp}.{mod}.lora_B.weight"] = up
    md = None
    if with_metadata:
        for comp in {c for c, _, _ in adapter["pairs"]}:
            meta[f"{comp}.r"] = adapter["rank"]
            meta[f"{comp}.lora_alpha"] = adapter["alpha"]
            meta[f"{comp}.target_modules"] = sorted({m for c, m, _ in adapter["pairs"] if c == comp})
        md = {"lora_adapter_metadata": json.dumps(meta)}
    st.save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=md)
    return path


def write_kohya(adapter, path):
    sd = {}
    te_prefix = {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
    for (comp, mod, sgm), (down, up) in adapter["pairs"].items():
        if comp == "unet":
            name = "lora_unet_" + sgm.replace(".", "_")
        else:
            name = te_prefix[comp] + ("text_model." + mod.removeprefix("text_model.")).replace(".", "_")
        sd[f"{name}.lora_down.weight"] = down
        sd[f"{name}.lora_up.weight"] = up
        sd[f"{name}.alpha"] = torch.tensor(adapter["alpha"], dtype=torch.float32)
    st.save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def write_comfy(adapter, path):
    sd = {}
    te = {"text_encoder": "clip_l", "text_encoder_2": "clip_g"}
    for (comp, mod, sgm), (down, up) in adapter["pairs"].items():
        if comp == "unet":
            name = "diffusion_model." + sgm
        else:
            name = f"text_encoders.{te[comp]}.transformer.text_model.{mod.removeprefix('text_model.')}"
        sd[f"{name}.lora_down.weight"] = down
        sd[f"{name}.lora_up.weight"] = up
        sd[f"{name}.alpha"] = torch.tensor(adapter["alpha"], dtype=torch.float32)
    st.save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


WRITERS = {"kohya": write_kohya, "peft": write_peft, "comfyui": write_comfy}


def reference(base, adapters, single_component=None):
    """Float64: base + sum(scale * alpha / rank * up @ down) for each touched weight."""
    out = {}
    for adapter, scale in adapters:
        for (comp, mod, _), (down, up) in adapter["pairs"].items():
            if single_component is not None:
                if comp != single_component:
                    continue
                name = f"{mod}.weight"
            else:
                name = f"{comp}/{mod}.weight"
            w = out.get(name)
            if w is None:
                w = base[name].double()
            c = scale * adapter["alpha"] / adapter["rank"]
            out[name] = w + c * (up.double().flatten(1) @ down.double().flatten(1)).reshape(w.shape)
    return out


def _bound(base, adapters, name, comp, mod):
    m = torch.zeros_like(base[name], dtype=torch.float64)
    for adapter, scale in adapters:
        pair = next((v for k, v in adapter["pairs"].items() if k[0] == comp and k[1] == mod), None)
        if pair is not None:
            down, up = pair
            c = abs(scale * adapter["alpha"] / adapter["rank"])
            m += c * (up.double().abs().flatten(1) @ down.double().abs().flatten(1)).reshape(m.shape)
    return m


def assert_close_to_reference(weights, base, adapters, dtype, single_component=None):
    ref = reference(base, adapters, single_component)
    assert ref
    for name, r in ref.items():
        comp, _, rest = name.rpartition("/")
        mod = rest[: -len(".weight")]
        got = weights[name].double().cpu()
        bound = TOL[dtype] * (r.abs() + _bound(base, adapters, name, comp or single_component, mod))
        err = (got - r).abs()
        assert bool((err <= bound).all()), f"{name}: max error {err.max().item()} beyond the bound"
    for name, t in weights.items():  # everything else is the base, bit for bit
        if name not in ref:
            assert torch.equal(t.cpu(), base[name]), name


# ---- tests ----


@pytest.mark.parametrize("layout", ["kohya", "peft", "comfyui"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_matches_float64_reference_in_each_layout(tmp_path, layout, dtype):
    pipe = _pipeline(dtype)
    base = _state(pipe)
    lib = pl.LoraLibrary("64M")
    a = make_adapter(pipe, seed=3, conv=(layout != "peft"))
    b = make_adapter(pipe, rank=8, alpha=4.0, seed=4)
    pa = WRITERS[layout](a, tmp_path / "a.safetensors")
    pb = WRITERS[layout](b, tmp_path / "b.safetensors")
    fuser = pl.LoraFuser(pipe, base, library=lib)
    fuser.switch([(pa, 0.8), (pb, -0.5)])
    assert_close_to_reference(_state(pipe), base, [(a, 0.8), (b, -0.5)], dtype)
    assert fuser.last_switch["fused"] == len(reference(base, [(a, 1), (b, 1)]))
    fuser.unfuse()
    now = _state(pipe)
    assert all(torch.equal(now[k], base[k]) for k in base)


@pytest.mark.parametrize("in_weight_dtype", [True, False])
def test_bf16_adapters_on_bf16_weights_match_the_reference_on_both_product_paths(tmp_path, monkeypatch,
                                                                                   in_weight_dtype):
    """Adapters in the weights' dtype take the product in that dtype where oneDNN has kernels (Note
    [Products in the weight's dtype]); forced off, the float32 path. Both meet the reference's bound,
    with equal and with differing coefficients."""
    if in_weight_dtype and not lora_fuser._mkldnn_has(torch.bfloat16):
        pytest.skip("this CPU's oneDNN has no bf16 kernels: only the float32 path runs here")
    monkeypatch.setattr(lora_fuser, "_product_in_weight_dtype", lambda w, ups, real=lora_fuser._product_in_weight_dtype:
                        in_weight_dtype and real(w, ups))
    used = []
    real_mm = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda self, *a, **k: (used.append(self.dtype), real_mm(self, *a, **k))[1])
    pipe = _pipeline(torch.bfloat16)
    base = _state(pipe)
    a = make_adapter(pipe, rank=16, seed=11, dtype=torch.bfloat16)
    b = make_adapter(pipe, rank=8, alpha=4.0, seed=12, dtype=torch.bfloat16)
    pa = WRITERS["kohya"](a, tmp_path / "a.safetensors")
    pb = WRITERS["kohya"](b, tmp_path / "b.safetensors")
    fuser = pl.LoraFuser(pipe, base, library=pl.LoraLibrary("64M"))
    for sets in ([(a, 0.8)], [(a, 0.5), (b, 0.5)], [(a, 0.8), (b, -1.5)]):
        paths = [(pa if x is a else pb, c) for x, c in sets]
        used.clear()
        fuser.switch(paths)
        assert set(used) == {torch.bfloat16 if in_weight_dtype else torch.float32}
        assert_close_to_reference(_state(pipe), base, sets, torch.bfloat16)
    fuser.unfuse()
    assert all(torch.equal(v, base[k]) for k, v in _state(pipe).items())


def test_layouts_fuse_to_the_same_bits(tmp_path):
    pipe = _pipeline(torch.bfloat16)
    base = _state(pipe)
    a = make_adapter(pipe, seed=5, conv=True)
    fuser = pl.LoraFuser(pipe, base, library=pl.LoraLibrary("64M"))
    results = []
    for layout in ("kohya", "comfyui"):
        fuser.switch([(WRITERS[layout](a, tmp_path / f"{layout}.safetensors"), 1.25)])
        results.append(_state(pipe))
    for k in base:
        assert torch.equal(results[0][k], results[1][k]), k


def _diffusers_fused(layout, adapters, tmp_path, dtype):
    """diffusers' own path: load_lora_weights for each adapter, set_adapters, fuse_lora."""
    pytest.importorskip("peft")
    pipe = _pipeline(dtype)
    names = []
    for i, (adapter, scale) in enumerate(adapters):
        path = WRITERS[layout](adapter, tmp_path / f"diffusers-{i}.safetensors")
        pipe.load_lora_weights(str(path), adapter_name=f"a{i}")
        names.append(f"a{i}")
    pipe.set_adapters(names, adapter_weights=[s for _, s in adapters])
    pipe.fuse_lora(adapter_names=names, lora_scale=1.0)
    pipe.unload_lora_weights()  # fused weights stay; the PEFT layers go
    return _state(pipe)


@pytest.mark.parametrize("layout", ["kohya", "peft"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_matches_diffusers_fuse_lora(tmp_path, layout, dtype):
    pipe = _pipeline(dtype)
    base = _state(pipe)
    a = make_adapter(pipe, seed=7, conv=(layout == "kohya"))
    b = make_adapter(pipe, rank=8, alpha=2.0, seed=8)
    adapters = [(a, 0.7), (b, 1.3)]
    theirs = _diffusers_fused(layout, adapters, tmp_path, dtype)
    fuser = pl.LoraFuser(pipe, base, library=pl.LoraLibrary("64M"))
    fuser.switch([(WRITERS[layout](x, tmp_path / f"ours-{i}.safetensors"), s) for i, (x, s) in enumerate(adapters)])
    ours = _state(pipe)
    ref = reference(base, adapters)
    assert set(theirs) == set(ours)
    changed = {k for k in base if not torch.equal(theirs[k], base[k])}
    assert changed == set(ref), "diffusers touched other weights than the adapters name"
    for k in base:
        if dtype == torch.float32:
            torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6, msg=k)
        elif k in ref:
            # PEFT rounds each adapter's delta to bf16, then each partial sum (2 roundings per adapter,
            # ours 1 in all): apart by at most those roundings, each half an ulp of what it rounds.
            comp, _, rest = k.partition("/")
            mag = ref[k].abs() + _bound(base, adapters, k, comp, rest[: -len(".weight")])
            diff = (ours[k].double() - theirs[k].double()).abs()
            assert bool((diff <= 2.0 ** -9 * (1 + 2 * len(adapters)) * mag).all()), k
        else:
            assert torch.equal(ours[k], theirs[k]), k


def _random_sets(adapters, rng):
    k = rng.randint(0, 3)
    return [(p, rng.choice([1.0, 0.5, -0.75, 1.5])) for p in rng.sample(adapters, k)]


@pytest.mark.parametrize("device", DEVICES)
def test_100_random_switches_are_bit_exact(tmp_path, device):
    unet = _unet(torch.bfloat16)
    path = tmp_path / "unet.safetensors"
    st.save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(path))
    # The model's weights on the device (pinload loads them there); the pristine copy in a ModelCache.
    weights = pt.load_file(path, device=device)
    cache = pinload.ModelCache("64M", pool_device=device if device == "cuda" else "cpu")  # pinned for CUDA
    base = cache.get(path)
    assert all(w.data_ptr() != base[k].data_ptr() for k, w in weights.items())
    lib = pl.LoraLibrary("64M")
    files = []
    for i, layout in enumerate(["kohya", "peft", "comfyui", "peft", "kohya", "comfyui"]):
        a = make_adapter(unet, rank=4 + 2 * i, alpha=float(i + 1), seed=10 + i, dtype=torch.bfloat16, text=False,
                         conv=(layout != "peft"))
        files.append((WRITERS[layout](a, tmp_path / f"{i}.safetensors"), a))
    fuser = pl.LoraFuser(weights, base, library=lib, component="unet", unet_config=dict(unet.config))
    by_path = dict(files)
    rng = random.Random(0)
    for step in range(100):
        chosen = _random_sets([p for p, _ in files], rng)
        fuser.switch(chosen)
        if step % 10 == 0 and chosen:
            assert_close_to_reference(weights, base, [(by_path[p], s) for p, s in chosen], torch.bfloat16,
                                      single_component="unet")
        if step % 17 == 0:  # a switch from a fresh start gives the same bits as one after any history
            again = {k: v.clone() for k, v in weights.items()}
            fuser.unfuse()
            fuser.switch(chosen)
            assert all(torch.equal(weights[k], again[k]) for k in weights)
    fuser.unfuse()
    assert all(torch.equal(weights[k].cpu(), base[k]) for k in weights)
    assert lib.stats()["misses"] == len(files)


def test_switch_restores_then_fuses_each_weight_once(tmp_path):
    unet = _unet(torch.bfloat16)
    base = _state(unet)
    a = make_adapter(unet, seed=1, text=False)
    b = {"pairs": dict(list(a["pairs"].items())[:5]), "alpha": 2.0, "rank": 4}  # a subset of a's weights
    b["pairs"] = {k: (d * 2, u) for k, (d, u) in b["pairs"].items()}
    lib = pl.LoraLibrary("16M")
    pa, pb = write_peft(a, tmp_path / "a.safetensors"), write_peft(b, tmp_path / "b.safetensors")
    fuser = pl.LoraFuser(unet, base, library=lib)
    fuser.switch([(pa, 1.0)])
    fuser.switch([(pb, 1.0)])
    assert fuser.last_switch == {"restored": len(a["pairs"]) - 5, "fused": 5, "pairs": 5}
    assert_close_to_reference(_state(unet), base, [(b, 1.0)], torch.bfloat16, single_component="unet")
    fuser.fuse([(pa, 0.5)])  # on top: recomputed from the base, both sets
    assert [s for _, s in fuser.active] == [1.0, 0.5]
    assert_close_to_reference(_state(unet), base, [(b, 1.0), (a, 0.5)], torch.bfloat16, single_component="unet")


@pytest.mark.parametrize("device", [d for d in DEVICES if d in ("cpu", "sim")])
@pytest.mark.parametrize("scale", ["per-tensor", "per-row"])
def test_fp8_base_requantised_as_documented(tmp_path, device, scale):
    unet = _unet(torch.bfloat16)
    src = tmp_path / "unet.safetensors"
    st.save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(src))
    fp8 = tmp_path / "unet-fp8.safetensors"
    pinload.convert(src, fp8, scale=scale)
    weights = pt.load_file(fp8, device=device)
    base = pt.load_file(fp8)
    a = make_adapter(unet, rank=8, alpha=8.0, seed=2, dtype=torch.bfloat16, text=False)
    path = write_kohya(a, tmp_path / "a.safetensors")
    fuser = pl.LoraFuser(weights, base, library=pl.LoraLibrary("16M"), component="unet", unet_config=unet.config)
    fuser.switch([(path, 0.9)])
    touched = fuser.touched()
    assert touched and all(weights[w].dtype == torch.float8_e4m3fn for w in touched)
    # The high-precision sums, as the fuse forms them (dequantise, add in float32) ...
    hp = {}
    ref = reference({k: (base[k].float() * (base[k[:-6] + "weight_scale"].float())).to(torch.float64)
                     if k.endswith(".weight") and k[:-6] + "weight_scale" in base else base[k].double()
                     for k in base}, [(a, 0.9)], single_component="unet")
    for w in touched:
        s = base[w[:-6] + "weight_scale"].float()
        acc = base[w].float() * (s.reshape(-1, 1) if s.numel() > 1 else s)
        pair = next(v for k, v in a["pairs"].items() if f"{k[1]}.weight" == w)
        acc.addmm_(pair[1].float().flatten(1), pair[0].float().flatten(1), alpha=0.9 * 8.0 / 8)
        hp[w] = acc
        # ... are within the FP8 rounding of the float64 reference ...
        deq = weights[w].float() * weights[w[:-6] + "weight_scale"].float().reshape(-1, 1 if s.numel() > 1 else 1)
        if s.numel() == 1:
            deq = weights[w].float() * weights[w[:-6] + "weight_scale"].float()
        assert bool(((deq.double() - ref[w]).abs() <= 2.0 ** -3 * ref[w].abs() + 2 * weights[w[:-6] + "weight_scale"]
                     .double().reshape(-1, 1 if s.numel() > 1 else 1) * 2.0 ** -9).all()), w
    # ... and are re-quantised exactly as `pinload convert` writes them (docs/fp8.md).
    hp_file = tmp_path / "hp.safetensors"
    st.save_file({k: v.contiguous() for k, v in hp.items()}, str(hp_file))
    conv = tmp_path / "hp-fp8.safetensors"
    pinload.convert(hp_file, conv, scale=scale)
    expect = pt.load_file(conv)
    for w in touched:
        assert torch.equal(weights[w].view(torch.uint8), expect[w].view(torch.uint8)), w
        ws = w[:-6] + "weight_scale"
        assert torch.equal(weights[ws], expect[ws].reshape(weights[ws].shape)), ws
    fuser.unfuse()
    assert all(torch.equal(weights[k].view(torch.uint8) if weights[k].dtype == torch.float8_e4m3fn else weights[k],
                           base[k].view(torch.uint8) if base[k].dtype == torch.float8_e4m3fn else base[k])
               for k in weights)


def test_unknown_key_and_shape_mismatch_leave_the_model_unchanged(tmp_path):
    pipe = _pipeline(torch.bfloat16)
    base = _state(pipe)
    good = make_adapter(pipe, seed=1)
    lib = pl.LoraLibrary("64M")
    fuser = pl.LoraFuser(pipe, base, library=lib)
    pgood = write_peft(good, tmp_path / "good.safetensors")
    fuser.switch([(pgood, 1.0)])
    before = _state(pipe)

    unknown = dict(good["pairs"])
    unknown[("unet", "down_blocks.1.attentions.0.transformer_blocks.7.attn1.to_q", None)] = tuple(
        t.clone() for t in next(iter(unknown.values())))
    pu = write_peft({"pairs": unknown, "alpha": 8.0, "rank": 4}, tmp_path / "unknown.safetensors")
    with pytest.raises(pl.LoraKeyError) as e:
        fuser.switch([(pgood, 0.5), (pu, 1.0)])
    assert e.value.tensor == "unet.down_blocks.1.attentions.0.transformer_blocks.7.attn1.to_q.lora_A.weight"
    assert e.value.file == str(pu) and isinstance(e.value, pinload.InvalidFileError)

    bad = dict(good["pairs"])
    k0 = ("unet", "mid_block.attentions.0.proj_in", None)
    d, u = bad[("unet", "mid_block.attentions.0.proj_in", "middle_block.1.proj_in")]
    del bad[("unet", "mid_block.attentions.0.proj_in", "middle_block.1.proj_in")]
    bad[k0] = (torch.randn(4, d.shape[1] + 1), u)
    ps = write_peft({"pairs": bad, "alpha": 8.0, "rank": 4}, tmp_path / "shape.safetensors")
    with pytest.raises(pl.LoraShapeError) as e:
        fuser.switch([(ps, 1.0)])
    assert "mid_block.attentions.0.proj_in.lora_A.weight" in e.value.tensor

    kohya_bad = tmp_path / "kohya-bad.safetensors"
    st.save_file({"lora_unet_no_such_module.lora_down.weight": torch.zeros(4, 8),
                  "lora_unet_no_such_module.lora_up.weight": torch.zeros(8, 4)}, str(kohya_bad))
    with pytest.raises(pl.LoraKeyError) as e:
        fuser.switch([(kohya_bad, 1.0)])
    assert e.value.tensor == "lora_unet_no_such_module.lora_down.weight"

    after = _state(pipe)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert len(fuser.active) == 1
    fuser.unfuse()
    assert all(torch.equal(t, base[k]) for k, t in _state(pipe).items())


def test_base_that_aliases_the_weights_is_refused(tmp_path):
    unet = _unet()
    path = tmp_path / "u.safetensors"
    st.save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(path))
    cache = pinload.ModelCache("64M")
    weights = cache.get(path)  # the cached tensors themselves
    a = write_peft(make_adapter(unet, text=False), tmp_path / "a.safetensors")
    fuser = pl.LoraFuser(weights, cache.get(path), library=pl.LoraLibrary("8M"), component="unet")
    with pytest.raises(pinload.InvalidArgumentError, match="own memory"):
        fuser.switch([(a, 1.0)])
    assert all(torch.equal(weights[k], v) for k, v in unet.state_dict().items())


def test_library_lru_within_budget_and_file_identity(tmp_path):
    unet = _unet()
    paths = [write_peft(make_adapter(unet, seed=i, text=False), tmp_path / f"{i}.safetensors") for i in range(4)]
    size = paths[0].stat().st_size
    lib = pl.LoraLibrary(int(size * 2.5))
    gc.collect()
    in_use = pinload.pool_stats()["in_use"]
    adapters = lib.get_many(paths[:2])  # one batch
    assert lib.stats()["misses"] == 2 and lib.stats()["entries"] == 2
    # In pool blocks (not file mappings), and the library counts exactly those blocks.
    assert pinload.pool_stats()["in_use"] - in_use == lib.stats()["cached_bytes"]
    assert lib.get(paths[0]) is adapters[0]  # a hit: the same tensors
    lib.get(paths[2])  # evicts the least recently used: paths[1]
    s = lib.stats()
    assert s["entries"] == 2 and s["evictions"] == 1 and s["cached_bytes"] <= s["budget_bytes"]
    assert paths[1] not in lib and paths[0] in lib
    ref = st.load_file(str(paths[2]))
    got = lib.get(paths[2]).tensors
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    # A rewritten file is a new identity: read again, not served stale.
    write_peft(make_adapter(unet, seed=99, text=False), paths[2])
    fresh = lib.get(paths[2])
    assert not torch.equal(fresh.tensors[next(iter(ref))], ref[next(iter(ref))])
    assert lib.stats()["invalidations"] == 1
    big = pl.LoraLibrary(size // 2)
    assert big.get(paths[0]).tensors and big.stats()["too_large"] == 1 and big.stats()["entries"] == 0
    with pytest.raises(pinload.NotFoundError):
        lib.get(tmp_path / "missing.safetensors")
