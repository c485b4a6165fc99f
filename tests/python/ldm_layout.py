"""Writes diffusers-format SDXL components as one original (SGM / "ldm") single-file checkpoint, the
layout of Civitai models and of ``sd_xl_base_1.0.safetensors``, for tests of ``from_single_file``.

The mapping is the inverse of diffusers' own conversion (``diffusers.loaders.single_file_utils``:
``convert_ldm_unet_checkpoint``, ``convert_ldm_vae_checkpoint``, ``convert_open_clip_checkpoint``),
using its ``DIFFUSERS_TO_LDM_MAPPING`` tables for the fixed names; the tests check the round trip
(from_single_file gives back the very tensors written).
"""

import re

import torch

UNET = "model.diffusion_model."
VAE = "first_stage_model."
CLIP_L = "conditioner.embedders.0.transformer."
CLIP_G = "conditioner.embedders.1.model."

_UNET_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"),
                ("conv2", "out_layers.3"), ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection"))
_VAE_ATTENTION = (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out"))
_CLIP_G_LAYER = (("layer_norm1", "ln_1"), ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj"),
                 ("self_attn.out_proj", "attn.out_proj"))


def _rename(rest, pairs):
    for new, old in pairs:
        if rest.startswith(new + "."):
            return old + rest[len(new):]
    return rest


def unet(sd, config):
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    fixed = dict(DIFFUSERS_TO_LDM_MAPPING["unet"]["layers"])
    fixed.update(DIFFUSERS_TO_LDM_MAPPING["unet"]["addition_embed_type"])
    per = config["layers_per_block"] + 1
    up_attn = {i for i, t in enumerate(config["up_block_types"]) if "CrossAttn" in t}
    out = {}
    for k, v in sd.items():
        if k in fixed:
            name = fixed[k]
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", k):
            name = f"input_blocks.{int(m[1]) * per + int(m[2]) + 1}.0.{_rename(m[3], _UNET_RESNET)}"
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", k):
            name = f"input_blocks.{int(m[1]) * per + int(m[2]) + 1}.1.{m[3]}"
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", k):
            name = f"input_blocks.{(int(m[1]) + 1) * per}.0.op.{m[2]}"
        elif m := re.fullmatch(r"mid_block\.resnets\.(\d)\.(.*)", k):
            name = f"middle_block.{2 * int(m[1])}.{_rename(m[2], _UNET_RESNET)}"
        elif m := re.fullmatch(r"mid_block\.attentions\.0\.(.*)", k):
            name = f"middle_block.1.{m[1]}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", k):
            name = f"output_blocks.{int(m[1]) * per + int(m[2])}.0.{_rename(m[3], _UNET_RESNET)}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", k):
            name = f"output_blocks.{int(m[1]) * per + int(m[2])}.1.{m[3]}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", k):
            b = int(m[1])
            name = f"output_blocks.{b * per + per - 1}.{2 if b in up_attn else 1}.conv.{m[2]}"
        else:
            raise KeyError(f"no original name for unet key {k}")
        out[UNET + name] = v
    return out


def vae(sd, config):
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    fixed = DIFFUSERS_TO_LDM_MAPPING["vae"]
    n = len(config["up_block_types"])
    out = {}
    for k, v in sd.items():
        if k in fixed:
            name = fixed[k]
        elif m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", k):
            name = f"encoder.down.{m[1]}.block.{m[2]}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
        elif m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", k):
            name = f"encoder.down.{m[1]}.downsample.conv.{m[2]}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", k):
            name = f"decoder.up.{n - 1 - int(m[1])}.block.{m[2]}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", k):
            name = f"decoder.up.{n - 1 - int(m[1])}.upsample.conv.{m[2]}"
        elif m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.*)", k):
            name = f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3]}"
        elif m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)", k):
            name = f"{m[1]}.mid.attn_1.{_rename(m[2], _VAE_ATTENTION)}"
            if v.dim() == 2:  # the original's 1x1 convolutions
                v = v[:, :, None, None]
        else:
            raise KeyError(f"no original name for vae key {k}")
        out[VAE + name] = v
    return out


def clip_l(sd):
    """CLIPTextModel (saved names; transformers >= 5.6 saves them without ``text_model.``) -> the
    original's, which keep transformers' own names under ``text_model.``."""
    return {CLIP_L + ("" if k.startswith("text_model.") else "text_model.") + k: v for k, v in sd.items()}


def clip_g(sd):
    """CLIPTextModelWithProjection (saved names) -> OpenCLIP's."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    fixed = DIFFUSERS_TO_LDM_MAPPING["openclip"]["layers"]
    out = {}
    qkv = {}
    for k, v in sd.items():
        if k in fixed:
            out[CLIP_G + fixed[k]] = v.T.contiguous() if k == "text_projection.weight" else v
        elif m := re.fullmatch(r"text_model\.encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", k):
            qkv.setdefault((m[1], m[3]), {})[m[2]] = v
        elif m := re.fullmatch(r"text_model\.encoder\.layers\.(\d+)\.(.*)", k):
            out[f"{CLIP_G}transformer.resblocks.{m[1]}.{_rename(m[2], _CLIP_G_LAYER)}"] = v
        else:
            raise KeyError(f"no original name for text_encoder_2 key {k}")
    for (layer, kind), parts in qkv.items():
        out[f"{CLIP_G}transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat([parts[c] for c in "qkv"])
    return out
