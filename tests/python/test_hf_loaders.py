"""patch_diffusers / patch_transformers route the loads a diffusion service makes besides
from_pretrained: a single-file (original SDXL layout) checkpoint through ``from_single_file``, a LoRA,
a textual inversion, an IP-adapter, and transformers' ``disable_mmap`` path. Each gives the very
tensors the unpatched library gives, and ``counts()`` names it.
"""

import copy
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads; local_files_only too

import pinload  # noqa: E402
from pl_helpers import assert_same  # noqa: E402

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ldm_layout  # noqa: E402
from diffusers import (AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline,  # noqa: E402
                       UNet2DConditionModel)
from safetensors.torch import load_file as st_load_file  # noqa: E402
from safetensors.torch import save_file as st_save_file  # noqa: E402
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM)

transformers.logging.set_verbosity_error()
diffusers.utils.logging.set_verbosity_error()
try:
    diffusers.utils.logging.disable_progress_bar()
except AttributeError:
    pass

COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")


def tiny_sdxl():
    """StableDiffusionXLPipeline's classes and block structure (text_time embedding, two text
    encoders whose widths add up to the cross-attention width), a few kB of weights."""
    torch.manual_seed(11)
    # Two widths, as CLIP-L's 768 and CLIP-G's 1280: from_single_file tells the encoders apart by them.
    clip_l = CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=16, projection_dim=16)
    clip_g = CLIPTextConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=16, projection_dim=24, hidden_act="gelu")
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=2, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16 + 24, attention_head_dim=2, norm_num_groups=4, transformer_layers_per_block=(1, 2),
        addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 24,
        use_linear_projection=True)
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4, sample_size=16)
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=CLIPTextModel(clip_l), text_encoder_2=CLIPTextModelWithProjection(clip_g),
        tokenizer=None, tokenizer_2=None, unet=unet, scheduler=EulerDiscreteScheduler())


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """(pipeline, config folder without weights, single-file checkpoint in the original layout)."""
    root = tmp_path_factory.mktemp("sdxl")
    pipe = tiny_sdxl()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.save_pretrained(root / "config", safe_serialization=True)
    single = {}
    for component in COMPONENTS:
        (weights,) = (root / "config" / component).glob("*.safetensors")
        sd = st_load_file(weights)
        weights.unlink()  # from_single_file takes the configs alone from this folder
        model = getattr(pipe, component)
        if component == "unet":
            single.update(ldm_layout.unet(sd, model.config))
        elif component == "vae":
            single.update(ldm_layout.vae(sd, model.config))
        elif component == "text_encoder":
            single.update(ldm_layout.clip_l(sd))
        else:
            single.update(ldm_layout.clip_g(sd))
    st_save_file(single, root / "sdxl.safetensors")
    return pipe, root / "config", root / "sdxl.safetensors"


def from_single_file(path, config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return StableDiffusionXLPipeline.from_single_file(str(path), config=str(config), local_files_only=True,
                                                          tokenizer=None, tokenizer_2=None)


def assert_same_models(got, want, what):
    g, w = got.state_dict(), want.state_dict()
    assert sorted(g) == sorted(w), what
    for k in w:
        assert_same(g[k], w[k], f"{what}.{k}")


def test_from_single_file(sdxl):
    pipe, config, path = sdxl
    normal = from_single_file(path, config)
    for component in COMPONENTS:  # the layout round-trips: the file is what it claims to be
        assert_same_models(getattr(normal, component), getattr(pipe, component), component)
    with pinload.patch_diffusers() as patch:
        patched = from_single_file(path, config)
        unet = UNet2DConditionModel.from_single_file(str(path), config=str(config), subfolder="unet",
                                                     local_files_only=True)
    counts = patch.counts()
    assert counts["diffusers.from_single_file"] == 2, counts  # the pipeline and the model, one file each
    assert counts["files"] == 2
    assert "diffusers.load_state_dict" not in counts
    for component in COMPONENTS:
        assert_same_models(getattr(patched, component), getattr(normal, component), component)
    assert_same_models(unet, normal.unet, "unet")


def test_lora(sdxl, tmp_path):
    peft = pytest.importorskip("peft")
    from peft.utils import get_peft_model_state_dict

    pipe, _, _ = sdxl
    unet = copy.deepcopy(pipe.unet)
    torch.manual_seed(12)
    unet.add_adapter(peft.LoraConfig(r=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                     init_lora_weights=False))
    StableDiffusionXLPipeline.save_lora_weights(tmp_path, unet_lora_layers=get_peft_model_state_dict(unet),
                                                safe_serialization=True)
    (lora,) = tmp_path.glob("*.safetensors")

    def with_lora():
        p = copy.deepcopy(pipe)
        p.load_lora_weights(str(lora))
        return p

    normal = with_lora()
    assert any("lora" in k for k in normal.unet.state_dict())
    with pinload.patch_diffusers() as patch:
        patched = with_lora()
    counts = patch.counts()
    assert counts["diffusers.lora"] == 1 and counts["files"] == 1, counts
    assert_same_models(patched.unet, normal.unet, "unet")
    # Outside the patch the module is safetensors' own again.
    import diffusers.loaders.lora_base as lora_base
    import safetensors

    assert lora_base.safetensors is safetensors


def test_textual_inversion(tmp_path):
    from diffusers.loaders.textual_inversion import load_textual_inversion_state_dicts

    st_save_file({"emb_params": torch.randn(2, 16)}, tmp_path / "learned_embeds.safetensors")
    normal = load_textual_inversion_state_dicts([str(tmp_path)], local_files_only=True)
    with pinload.patch_diffusers() as patch:
        patched = load_textual_inversion_state_dicts([str(tmp_path)], local_files_only=True)
    assert patch.counts()["diffusers.textual_inversion"] == 1
    assert len(patched) == 1 and sorted(patched[0]) == ["emb_params"]
    assert_same(patched[0]["emb_params"], normal[0]["emb_params"], "emb_params")


def test_ip_adapter(sdxl, tmp_path):
    """An IP-adapter file (image projection and one to_k_ip/to_v_ip pair per cross-attention
    processor, as the published ones) through pipe.load_ip_adapter, the image encoder left out."""
    pipe, _, _ = sdxl
    torch.manual_seed(13)
    cross = pipe.unet.config.cross_attention_dim
    weights = {"image_proj.proj.weight": torch.randn(4 * cross, 8), "image_proj.proj.bias": torch.randn(4 * cross),
               "image_proj.norm.weight": torch.randn(cross), "image_proj.norm.bias": torch.randn(cross)}
    key_id = 1
    for name, module in pipe.unet.named_modules():
        if name.endswith("attn2"):
            for kind in ("k", "v"):
                weights[f"ip_adapter.{key_id}.to_{kind}_ip.weight"] = torch.randn(module.to_k.weight.shape)
            key_id += 2
    st_save_file(weights, tmp_path / "ip.safetensors")

    def with_adapter():
        p = copy.deepcopy(pipe)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p.load_ip_adapter(str(tmp_path), subfolder="", weight_name="ip.safetensors", image_encoder_folder=None)
        return p

    normal = with_adapter()
    assert any("to_k_ip" in k for k in normal.unet.state_dict())
    with pinload.patch_diffusers() as patch:
        patched = with_adapter()
    counts = patch.counts()
    assert counts["diffusers.ip_adapter"] == 1 and counts["files"] == 1, counts
    assert_same_models(patched.unet, normal.unet, "unet")


def test_transformers_disable_mmap(tmp_path):
    torch.manual_seed(14)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True, max_shard_size="10KB")
        assert len(list(tmp_path.glob("*.safetensors"))) > 1  # shards: every file goes through pinload
        normal = LlamaForCausalLM.from_pretrained(tmp_path, disable_mmap=True)
        with pinload.patch_transformers() as patch:
            patched = LlamaForCausalLM.from_pretrained(tmp_path, disable_mmap=True)
            mapped = LlamaForCausalLM.from_pretrained(tmp_path)  # the safe_open path, as before
    counts = patch.counts()
    shards = len(list(tmp_path.glob("*.safetensors")))
    assert counts["transformers.disable_mmap"] == 1, counts
    assert counts["files"] == 2 * shards
    assert_same_models(patched, normal, "llama")
    assert_same_models(mapped, normal, "llama")
