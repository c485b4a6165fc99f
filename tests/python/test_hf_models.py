"""Real diffusers and transformers models, saved with save_pretrained(safe_serialization=True), loaded
(a) normally, (b) with pinload.skip_init, (c) through pinload's patched from_pretrained: the same
weights and bit-identical outputs, and the patch counters show that pinload did the loading.

About "bit-identical": pinload's tensors alias the file's layout, as safetensors' mmap does, so a
weight's address has the alignment of its file offset, and CPU kernels can take another path
(and round differently in the last bit) for another alignment. The outputs are therefore compared
after moving every weight to fresh memory (``fresh_memory``); the weights themselves are compared
byte for byte where they were loaded.
"""

import gc
import json
import logging
import warnings

import pytest
import torch

import pinload
from pinload import skip_init
from pl_helpers import assert_same, in_use, mapped_ranges

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from diffusers import AutoencoderKL, DiffusionPipeline, UNet2DConditionModel  # noqa: E402
from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

logging.getLogger("diffusers").setLevel(logging.ERROR)
transformers.logging.set_verbosity_error()
diffusers.utils.logging.set_verbosity_error()
try:
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
except AttributeError:
    pass


def tiny_unet():
    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=2, norm_num_groups=4)


def tiny_vae():
    return AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                         sample_size=16)


def tiny_clip_config():
    return CLIPTextConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, max_position_embeddings=16, projection_dim=16)


def tiny_llama_config():
    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)


def unet_inputs():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(1, 4, 8, 8, generator=g), torch.tensor([7]), torch.randn(1, 3, 16, generator=g))


IDS = torch.tensor([[1, 5, 9, 2, 7, 3]])

MODELS = {
    # name: (class, factory of a random model, how to build it empty, forward)
    "unet": (UNet2DConditionModel, tiny_unet,
             lambda cfg: skip_init.empty_model(UNet2DConditionModel.from_config, cfg),
             lambda m: m(*unet_inputs()).sample),
    "vae": (AutoencoderKL, tiny_vae,
            lambda cfg: skip_init.empty_model(AutoencoderKL.from_config, cfg),
            lambda m: m(torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(4))).sample),
    "clip": (CLIPTextModel, lambda: CLIPTextModel(tiny_clip_config()),
             lambda cfg: skip_init.empty_model(CLIPTextModel, cfg),
             lambda m: m(IDS).last_hidden_state),
    "llama": (LlamaForCausalLM, lambda: LlamaForCausalLM(tiny_llama_config()),
              lambda cfg: skip_init.empty_model(LlamaForCausalLM, cfg),
              lambda m: m(IDS).logits),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (name, (cls, make, _, _)) in enumerate(MODELS.items()):
            torch.manual_seed(100 + i)
            model = make().eval()
            model.save_pretrained(root / name, safe_serialization=True)
            out[name] = (root / name, model)
    return out


def fresh_memory(model):
    """Moves every parameter and buffer to freshly allocated memory (see the module docstring)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
        for mod in model.modules():
            for k, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[k] = b.clone()
    return model


def checkpoint_file(folder):
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1
    return files[0]


def forward(name, model):
    with torch.no_grad():
        return MODELS[name][3](fresh_memory(model.eval()))


def all_mapped_from(model, path) -> bool:
    """Whether every parameter's bytes lie in a mapping of `path` (/proc/self/maps)."""
    ranges = mapped_ranges(path)
    return bool(ranges) and all(any(lo <= p.data_ptr() < hi for lo, hi in ranges) for p in model.parameters())


@pytest.mark.parametrize("name", list(MODELS))
def test_normal_skip_init_and_patched_agree(saved, name):
    folder, original = saved[name]
    cls, _, build_empty, _ = MODELS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normal = cls.from_pretrained(folder).eval()

        config = normal.config
        if name in ("unet", "vae"):
            config = cls.load_config(folder)
        empty = build_empty(config)
        assert skip_init.meta_tensors(empty), "empty_model built real tensors"
        skipped = skip_init.load_into(empty, checkpoint_file(folder)).eval()

        base = in_use()
        with pinload.patch_diffusers() if name in ("unet", "vae") else pinload.patch_transformers() as patch:
            patched = cls.from_pretrained(folder).eval()
        counts = patch.counts()
    assert counts.get("files", 0) >= 1, counts
    assert counts.get("diffusers.load_state_dict", 0) + counts.get("transformers.safe_open", 0) >= 1, counts
    # No copy: the patched model's weights live in pinload's pool, or in a mapping of the file itself
    # (a dtype that changes nothing is no conversion: Note [A dtype that changes nothing]).
    assert in_use() > base or all_mapped_from(patched, checkpoint_file(folder))

    # The same weights, byte for byte, where they were loaded.
    want = normal.state_dict()
    for other in (skipped, patched):
        got = other.state_dict()
        assert sorted(got) == sorted(want)
        for k in want:
            assert_same(got[k], want[k], k)
    for k, b in normal.named_buffers():  # non-persistent buffers too (rotary tables, position_ids)
        assert_same(dict(skipped.named_buffers())[k], b, k)
        assert_same(dict(patched.named_buffers())[k], b, k)

    ref = forward(name, original)
    for model in (normal, skipped, patched):
        assert torch.equal(forward(name, model), ref)
    del patched
    gc.collect()


def test_pipeline_from_pretrained(tmp_path):
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = StableDiffusionPipeline(vae=tiny_vae(), text_encoder=CLIPTextModel(tiny_clip_config()), tokenizer=None,
                                       unet=tiny_unet(), scheduler=DDIMScheduler(), safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)
        pipe.save_pretrained(tmp_path / "pipe", safe_serialization=True)
        kwargs = dict(tokenizer=None, safety_checker=None, feature_extractor=None)
        normal = DiffusionPipeline.from_pretrained(tmp_path / "pipe", **kwargs)
        with pinload.patch_diffusers() as patch:
            patched = DiffusionPipeline.from_pretrained(tmp_path / "pipe", **kwargs)
    counts = patch.counts()
    assert counts["diffusers.load_state_dict"] == 2  # unet and vae
    assert counts["transformers.safe_open"] >= 1  # the text encoder
    assert counts["files"] == 3
    for component in ("unet", "vae", "text_encoder"):
        want = getattr(normal, component).state_dict()
        got = getattr(patched, component).state_dict()
        assert sorted(got) == sorted(want)
        for k in want:
            assert_same(got[k], want[k], f"{component}.{k}")
    ids = IDS
    with torch.no_grad():
        a = fresh_memory(normal.text_encoder)(ids).last_hidden_state
        b = fresh_memory(patched.text_encoder)(ids).last_hidden_state
        assert torch.equal(a, b)
        assert torch.equal(forward("unet", normal.unet), forward("unet", patched.unet))
    # The whole pipeline folder also loads in one call, components prefixed.
    sd = pinload.load_files(tmp_path / "pipe")
    assert {k.split("/")[0] for k in sd} == {"unet", "vae", "text_encoder"}


def test_patches_undo_and_plain_call(saved):
    import diffusers.models.model_loading_utils as mlu
    import diffusers.models.modeling_utils as dmu
    import transformers.modeling_utils as tmu
    from safetensors import safe_open

    originals = (mlu.load_state_dict, dmu.load_state_dict, tmu.safe_open, tmu.load_state_dict)
    assert tmu.safe_open is safe_open
    patch = pinload.patch_diffusers()
    assert mlu.load_state_dict is not originals[0] and dmu.load_state_dict is mlu.load_state_dict
    assert tmu.safe_open is not safe_open
    assert "diffusers.models.modeling_utils.load_state_dict" in patch.patched
    folder, _ = saved["clip"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        CLIPTextModel.from_pretrained(folder)
        assert patch.counts()["transformers.safe_open"] >= 1
        patch.undo()
        assert (mlu.load_state_dict, dmu.load_state_dict, tmu.safe_open, tmu.load_state_dict) == originals
        before = patch.counts()
        CLIPTextModel.from_pretrained(folder)  # not through pinload any more
        assert patch.counts() == before
        patch.undo()  # idempotent
        with pinload.patch_transformers() as t:
            with pinload.patch_transformers() as inner:  # nested patches undo in order
                CLIPTextModel.from_pretrained(folder)
            assert tmu.safe_open is not safe_open
        assert tmu.safe_open is safe_open
        assert inner.counts().get("transformers.safe_open", 0) >= 1 and not t.counts()


def test_patch_falls_back_for_what_pinload_does_not_serve(saved, tmp_path):
    import transformers.modeling_utils as tmu

    folder, _ = saved["clip"]
    with pinload.patch_transformers() as patch:
        with tmu.safe_open(str(checkpoint_file(folder)), framework="numpy") as f:  # the original handles it
            assert f.keys()
        assert "transformers.safe_open" not in patch.counts()
        torch.save({"x": torch.ones(2)}, tmp_path / "w.bin")
        assert torch.equal(tmu.load_state_dict(str(tmp_path / "w.bin"))["x"], torch.ones(2))
        sd = tmu.load_state_dict(str(checkpoint_file(folder)))
        assert patch.counts()["transformers.load_state_dict"] == 1
        assert json.loads(json.dumps(sorted(sd)))  # a plain dict of tensors
    with pytest.raises(ValueError):
        pinload.patch_transformers(threads=0)  # options are checked at patch time
