#!/usr/bin/env python3
"""Generate safetensors checkpoints of real architectures, filled with weight-like values.

No model weights can be downloaded where pinload is developed and tested. For the
FLUX components this script hand-codes the published architectures (tensor names,
shapes, dtypes, module order; numpy only, and `--check` compares them with the real
classes where those are installed) and writes them in the diffusers/transformers
folder layout, sharded the way `save_pretrained` shards them:

  <out>/flux-dev/model_index.json
  <out>/flux-dev/text_encoder/model.safetensors                 CLIP-L   (CLIPTextModel)
  <out>/flux-dev/text_encoder_2/model-0000{1,2}-of-00002.safetensors + model.safetensors.index.json
                                                                T5-XXL   (T5EncoderModel)
  <out>/flux-dev/transformer/diffusion_pytorch_model-0000{1,2,3}-of-00003.safetensors
                       + diffusion_pytorch_model.safetensors.index.json
                                                                FLUX.1-dev (FluxTransformer2DModel)
  <out>/flux-dev/vae/diffusion_pytorch_model.safetensors        AutoencoderKL (16 latent channels)

and the SDXL base pipeline, fp16 variant files as the published repository has them:

  <out>/sdxl-base/model_index.json
  <out>/sdxl-base/unet/diffusion_pytorch_model.fp16.safetensors   UNet2DConditionModel (SDXL base)
  <out>/sdxl-base/text_encoder/model.fp16.safetensors             CLIP-L   (CLIPTextModel)
  <out>/sdxl-base/text_encoder_2/model.fp16.safetensors           CLIP-G   (CLIPTextModelWithProjection)
  <out>/sdxl-base/vae/diffusion_pytorch_model.fp16.safetensors    AutoencoderKL (4 latent channels)

The SDXL components are not hand-coded: they are the real diffusers and transformers
classes, built from the published configs (written below: nothing can be downloaded)
on the meta device, and their state_dict gives the names, shapes and order. That needs
torch, diffusers and transformers; the FLUX components need only numpy.

Each pipeline folder also has what model_index.json names besides weights: the published
scheduler config and tokenizers (the published kinds, trained here with the `tokenizers` package
on this docstring, a small vocabulary), so that DiffusionPipeline.from_pretrained loads it whole.
Every config.json is complete: diffusers and transformers load each component from it with no
missing, unexpected or mismatched key (tests/python/test_gen_checkpoints.py).

`--scale small` writes the same names and structure with fewer layers and narrower
widths (about 0.2 GB for FLUX, 0.1 GB for SDXL) to <out>/flux-dev-small/ and
<out>/sdxl-base-small/, for CI and quick runs.

Totals are checked against the published models' figures (FLUX 1160 tensors / 23,802,816,640 B,
T5 219 / 9,524,621,312 B, CLIP-L 196 / ~246 MB, VAE 244 / ~168 MB, SDXL UNet ~1680 /
~5.1 GB, CLIP-G ~517 / ~1.39 GB, SDXL VAE 248 / ~168 MB): run `--check`. Where diffusers
and transformers are installed, --check also compares the hand-coded FLUX components with
the real classes built on the meta device (names and shapes).

Tensors hold finite values of each kind's usual scale (weights and embeddings about N(0, 0.02),
norms' weights near 1, biases near 0), seeded and written at about disk speed (Note [Weight-like
values]); `--fill random` writes random bytes instead (fp16/bf16 tensors then hold NaN and inf).

The full FLUX transformer (24 GB) is never written unless asked for by name
(`--only flux-dev`). Writing is idempotent: a file that exists with the expected
header (the fill's version included) and size is kept (`--force` rewrites). Files are written to a temporary name and
renamed, so an interrupted run leaves no file of the right name and wrong content.

Examples:
  scripts/gen_checkpoints.py --check
  scripts/gen_checkpoints.py --scale small
  scripts/gen_checkpoints.py --only clip-l,vae,t5-xxl --shards 2    # ~5 GB bench set
  scripts/gen_checkpoints.py --only sdxl                             # the SDXL pipeline, 6.9 GB
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
import zlib
from dataclasses import dataclass, field

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}


@dataclass
class T:
    name: str
    shape: tuple
    dtype: str = "BF16"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass
class Component:
    key: str            # --only name
    folder: str         # subfolder of the pipeline
    stem: str           # "model" or "diffusion_pytorch_model"
    library: str        # model_index.json entries
    cls: str
    tensors: list       # module (state_dict) order
    shards: int = 1
    max_shard_size: int | None = None  # bytes, as save_pretrained; None: searched to give `shards`
    config: dict = field(default_factory=dict)
    expect_tensors: int | None = None
    expect_bytes: int | None = None    # exact where published
    approx_bytes: int | None = None    # "about"

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


# ---------------------------------------------------------------- architectures


def linear(prefix, out_f, in_f, bias=True, dtype="BF16"):
    r = [T(f"{prefix}.weight", (out_f, in_f), dtype)]
    if bias:
        r.append(T(f"{prefix}.bias", (out_f,), dtype))
    return r


def layer_norm(prefix, dim, bias=True, dtype="BF16"):
    r = [T(f"{prefix}.weight", (dim,), dtype)]
    if bias:
        r.append(T(f"{prefix}.bias", (dim,), dtype))
    return r


def conv(prefix, out_c, in_c, k, dtype="BF16"):
    return [T(f"{prefix}.weight", (out_c, in_c, k, k), dtype), T(f"{prefix}.bias", (out_c,), dtype)]


def clip_text(layers=12, width=768, mlp=3072, vocab=49408, positions=77, dtype="BF16"):
    """transformers CLIPTextModel (openai/clip-vit-large-patch14 text tower)."""
    p = "text_model"
    ts = [T(f"{p}.embeddings.token_embedding.weight", (vocab, width), dtype),
          T(f"{p}.embeddings.position_embedding.weight", (positions, width), dtype)]
    for i in range(layers):
        q = f"{p}.encoder.layers.{i}"
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):  # CLIPAttention order
            ts += linear(f"{q}.self_attn.{proj}", width, width, dtype=dtype)
        ts += layer_norm(f"{q}.layer_norm1", width, dtype=dtype)
        ts += linear(f"{q}.mlp.fc1", mlp, width, dtype=dtype)
        ts += linear(f"{q}.mlp.fc2", width, mlp, dtype=dtype)
        ts += layer_norm(f"{q}.layer_norm2", width, dtype=dtype)
    ts += layer_norm(f"{p}.final_layer_norm", width, dtype=dtype)
    return ts


def t5_encoder(layers=24, d_model=4096, d_ff=10240, heads=64, d_kv=64, vocab=32128, buckets=32, dtype="BF16"):
    """transformers T5EncoderModel, gated-gelu (T5 v1.1 / google/t5-v1_1-xxl).
    encoder.embed_tokens.weight is tied to shared.weight and not saved."""
    inner = heads * d_kv
    ts = [T("shared.weight", (vocab, d_model), dtype)]
    for i in range(layers):
        b = f"encoder.block.{i}"
        for proj in ("q", "k", "v"):
            ts.append(T(f"{b}.layer.0.SelfAttention.{proj}.weight", (inner, d_model), dtype))
        ts.append(T(f"{b}.layer.0.SelfAttention.o.weight", (d_model, inner), dtype))
        if i == 0:
            ts.append(T(f"{b}.layer.0.SelfAttention.relative_attention_bias.weight", (buckets, heads), dtype))
        ts.append(T(f"{b}.layer.0.layer_norm.weight", (d_model,), dtype))
        ts.append(T(f"{b}.layer.1.DenseReluDense.wi_0.weight", (d_ff, d_model), dtype))
        ts.append(T(f"{b}.layer.1.DenseReluDense.wi_1.weight", (d_ff, d_model), dtype))
        ts.append(T(f"{b}.layer.1.DenseReluDense.wo.weight", (d_model, d_ff), dtype))
        ts.append(T(f"{b}.layer.1.layer_norm.weight", (d_model,), dtype))
    ts.append(T("encoder.final_layer_norm.weight", (d_model,), dtype))
    return ts


def flux_transformer(double=19, single=38, width=3072, head_dim=128, mlp_ratio=4, in_channels=64,
                     joint_dim=4096, pooled_dim=768, guidance=True, dtype="BF16"):
    """diffusers FluxTransformer2DModel (black-forest-labs/FLUX.1-dev)."""
    mlp = width * mlp_ratio
    ts = []
    tte = "time_text_embed"
    ts += linear(f"{tte}.timestep_embedder.linear_1", width, 256, dtype=dtype)
    ts += linear(f"{tte}.timestep_embedder.linear_2", width, width, dtype=dtype)
    if guidance:
        ts += linear(f"{tte}.guidance_embedder.linear_1", width, 256, dtype=dtype)
        ts += linear(f"{tte}.guidance_embedder.linear_2", width, width, dtype=dtype)
    ts += linear(f"{tte}.text_embedder.linear_1", width, pooled_dim, dtype=dtype)
    ts += linear(f"{tte}.text_embedder.linear_2", width, width, dtype=dtype)
    ts += linear("context_embedder", width, joint_dim, dtype=dtype)
    ts += linear("x_embedder", width, in_channels, dtype=dtype)

    def rms(prefix):
        return [T(f"{prefix}.weight", (head_dim,), dtype)]

    for i in range(double):
        b = f"transformer_blocks.{i}"
        ts += linear(f"{b}.norm1.linear", 6 * width, width, dtype=dtype)
        ts += linear(f"{b}.norm1_context.linear", 6 * width, width, dtype=dtype)
        a = f"{b}.attn"
        ts += rms(f"{a}.norm_q") + rms(f"{a}.norm_k")
        for proj in ("to_q", "to_k", "to_v"):
            ts += linear(f"{a}.{proj}", width, width, dtype=dtype)
        ts += linear(f"{a}.to_out.0", width, width, dtype=dtype)
        ts += rms(f"{a}.norm_added_q") + rms(f"{a}.norm_added_k")
        for proj in ("add_q_proj", "add_k_proj", "add_v_proj"):
            ts += linear(f"{a}.{proj}", width, width, dtype=dtype)
        ts += linear(f"{a}.to_add_out", width, width, dtype=dtype)
        ts += linear(f"{b}.ff.net.0.proj", mlp, width, dtype=dtype)
        ts += linear(f"{b}.ff.net.2", width, mlp, dtype=dtype)
        ts += linear(f"{b}.ff_context.net.0.proj", mlp, width, dtype=dtype)
        ts += linear(f"{b}.ff_context.net.2", width, mlp, dtype=dtype)
    for i in range(single):
        b = f"single_transformer_blocks.{i}"
        ts += linear(f"{b}.norm.linear", 3 * width, width, dtype=dtype)
        ts += linear(f"{b}.proj_mlp", mlp, width, dtype=dtype)
        ts += linear(f"{b}.proj_out", width, width + mlp, dtype=dtype)
        a = f"{b}.attn"
        ts += rms(f"{a}.norm_q") + rms(f"{a}.norm_k")
        for proj in ("to_q", "to_k", "to_v"):
            ts += linear(f"{a}.{proj}", width, width, dtype=dtype)
    ts += linear("norm_out.linear", 2 * width, width, dtype=dtype)
    ts += linear("proj_out", in_channels, width, dtype=dtype)
    return ts


def autoencoder_kl(channels=(128, 256, 512, 512), layers_per_block=2, latent=16, in_ch=3,
                   quant_conv=False, dtype="BF16"):
    """diffusers AutoencoderKL (FLUX/SD3 VAE: 16 latent channels, no quant convs)."""
    ts = []

    def resnet(prefix, cin, cout):
        r = layer_norm(f"{prefix}.norm1", cin, dtype=dtype) + conv(f"{prefix}.conv1", cout, cin, 3, dtype)
        r += layer_norm(f"{prefix}.norm2", cout, dtype=dtype) + conv(f"{prefix}.conv2", cout, cout, 3, dtype)
        if cin != cout:
            r += conv(f"{prefix}.conv_shortcut", cout, cin, 1, dtype)
        return r

    def mid(prefix, c):
        r = resnet(f"{prefix}.resnets.0", c, c)
        r += layer_norm(f"{prefix}.attentions.0.group_norm", c, dtype=dtype)
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            r += linear(f"{prefix}.attentions.0.{proj}", c, c, dtype=dtype)
        r += resnet(f"{prefix}.resnets.1", c, c)
        return r

    # encoder
    ts += conv("encoder.conv_in", channels[0], in_ch, 3, dtype)
    cout = channels[0]
    for i, c in enumerate(channels):
        cin, cout = cout, c
        for j in range(layers_per_block):
            ts += resnet(f"encoder.down_blocks.{i}.resnets.{j}", cin if j == 0 else cout, cout)
        if i != len(channels) - 1:
            ts += conv(f"encoder.down_blocks.{i}.downsamplers.0.conv", cout, cout, 3, dtype)
    ts += mid("encoder.mid_block", channels[-1])
    ts += layer_norm("encoder.conv_norm_out", channels[-1], dtype=dtype)
    ts += conv("encoder.conv_out", 2 * latent, channels[-1], 3, dtype)
    # decoder
    ts += conv("decoder.conv_in", channels[-1], latent, 3, dtype)
    ts += mid("decoder.mid_block", channels[-1])
    rev = list(reversed(channels))
    cout = rev[0]
    for i, c in enumerate(rev):
        cin, cout = cout, c
        for j in range(layers_per_block + 1):
            ts += resnet(f"decoder.up_blocks.{i}.resnets.{j}", cin if j == 0 else cout, cout)
        if i != len(rev) - 1:
            ts += conv(f"decoder.up_blocks.{i}.upsamplers.0.conv", cout, cout, 3, dtype)
    ts += layer_norm("decoder.conv_norm_out", channels[0], dtype=dtype)
    ts += conv("decoder.conv_out", in_ch, channels[0], 3, dtype)
    if quant_conv:
        ts += conv("quant_conv", 2 * latent, 2 * latent, 1, dtype)
        ts += conv("post_quant_conv", latent, latent, 1, dtype)
    return ts


def _clip_config(layers, width, mlp, heads):
    return {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "hidden_size": width,
            "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads, "vocab_size": 49408,
            "max_position_embeddings": 77, "projection_dim": 768, "hidden_act": "quick_gelu",
            "torch_dtype": "bfloat16"}


def _t5_config(layers, d_model, d_ff, heads, d_kv):
    return {"architectures": ["T5EncoderModel"], "model_type": "t5", "d_model": d_model, "d_ff": d_ff,
            "d_kv": d_kv, "num_heads": heads, "num_layers": layers, "vocab_size": 32128,
            "relative_attention_num_buckets": 32, "feed_forward_proj": "gated-gelu", "is_gated_act": True,
            "dense_act_fn": "gelu_new", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _flux_config(double, single, heads, joint_dim):
    return {"_class_name": "FluxTransformer2DModel", "num_layers": double, "num_single_layers": single,
            "attention_head_dim": 128, "num_attention_heads": heads, "in_channels": 64, "patch_size": 1,
            "joint_attention_dim": joint_dim, "pooled_projection_dim": 768, "guidance_embeds": True}


def _flux_vae_config(channels):
    n = len(channels)
    return {"_class_name": "AutoencoderKL", "latent_channels": 16, "block_out_channels": list(channels),
            "down_block_types": ["DownEncoderBlock2D"] * n, "up_block_types": ["UpDecoderBlock2D"] * n,
            "layers_per_block": 2, "in_channels": 3, "out_channels": 3, "norm_num_groups": 32, "act_fn": "silu",
            "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
            "use_post_quant_conv": False}


# Each component's config.json is complete: the class built from it (diffusers' from_config,
# transformers' config class) has exactly the tensors written, names and shapes (real_shapes;
# tests/python/test_gen_checkpoints.py checks every component at every scale).
def components(scale: str) -> list[Component]:
    if scale == "full":
        return [
            Component("clip-l", "text_encoder", "model", "transformers", "CLIPTextModel", clip_text(),
                      config=_clip_config(12, 768, 3072, 12), expect_tensors=196, approx_bytes=246_000_000),
            Component("t5-xxl", "text_encoder_2", "model", "transformers", "T5EncoderModel", t5_encoder(),
                      shards=2, max_shard_size=5_000_000_000, config=_t5_config(24, 4096, 10240, 64, 64),
                      expect_tensors=219, expect_bytes=9_524_621_312),
            Component("flux-dev", "transformer", "diffusion_pytorch_model", "diffusers", "FluxTransformer2DModel",
                      flux_transformer(), shards=3, max_shard_size=10_000_000_000,
                      config=_flux_config(19, 38, 24, 4096), expect_tensors=1160, expect_bytes=23_802_816_640),
            Component("vae", "vae", "diffusion_pytorch_model", "diffusers", "AutoencoderKL", autoencoder_kl(),
                      config=_flux_vae_config((128, 256, 512, 512)), expect_tensors=244, approx_bytes=168_000_000),
        ]
    # small: same names and structure, fewer layers, narrower; ~0.2 GB in all
    return [
        Component("clip-l", "text_encoder", "model", "transformers", "CLIPTextModel",
                  clip_text(layers=2, width=768, mlp=3072), config=_clip_config(2, 768, 3072, 12)),
        Component("t5-xxl", "text_encoder_2", "model", "transformers", "T5EncoderModel",
                  t5_encoder(layers=4, d_model=512, d_ff=1280, heads=8, d_kv=64), shards=2,
                  config=_t5_config(4, 512, 1280, 8, 64)),
        Component("flux-dev", "transformer", "diffusion_pytorch_model", "diffusers", "FluxTransformer2DModel",
                  flux_transformer(double=2, single=4, width=512, joint_dim=512), shards=3,
                  config=_flux_config(2, 4, 4, 512)),
        Component("vae", "vae", "diffusion_pytorch_model", "diffusers", "AutoencoderKL",
                  autoencoder_kl(channels=(64, 128, 256, 256)), config=_flux_vae_config((64, 128, 256, 256))),
    ]


MODEL_INDEX = {
    "_class_name": "FluxPipeline",
    "_diffusers_version": "0.30.0.dev0",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}

# ---------------------------------------------------------------- SDXL (real classes, meta device)

# Published configs of stabilityai/stable-diffusion-xl-base-1.0 (unet/, vae/,
# text_encoder/, text_encoder_2/ config.json), reduced to the keys the classes take.
SDXL_UNET = {
    "_class_name": "UNet2DConditionModel", "act_fn": "silu", "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64, "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280], "center_input_sample": False, "class_embed_type": None,
    "class_embeddings_concat": False, "conv_in_kernel": 3, "conv_out_kernel": 3, "cross_attention_dim": 2048,
    "cross_attention_norm": None, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1, "dual_cross_attention": False, "encoder_hid_dim": None, "encoder_hid_dim_type": None,
    "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_only_cross_attention": None, "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05, "norm_num_groups": 32, "num_attention_heads": None, "num_class_embeds": None,
    "only_cross_attention": False, "out_channels": 4, "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0, "resnet_skip_time_act": False, "resnet_time_scale_shift": "default",
    "sample_size": 128, "time_cond_proj_dim": None, "time_embedding_act_fn": None, "time_embedding_dim": None,
    "time_embedding_type": "positional", "timestep_post_act": None, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "upcast_attention": None,
    "use_linear_projection": True,
}
SDXL_VAE = {
    "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4, "force_upcast": True, "in_channels": 3, "latent_channels": 4,
    "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 3, "sample_size": 1024, "scaling_factor": 0.13025,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
SDXL_CLIP_L = {
    "architectures": ["CLIPTextModel"], "hidden_act": "quick_gelu", "hidden_size": 768, "intermediate_size": 3072,
    "max_position_embeddings": 77, "num_attention_heads": 12, "num_hidden_layers": 12, "projection_dim": 768,
    "vocab_size": 49408, "torch_dtype": "float16",
}
SDXL_CLIP_G = {
    "architectures": ["CLIPTextModelWithProjection"], "hidden_act": "gelu", "hidden_size": 1280,
    "intermediate_size": 5120, "max_position_embeddings": 77, "num_attention_heads": 20, "num_hidden_layers": 32,
    "projection_dim": 1280, "vocab_size": 49408, "torch_dtype": "float16",
}


def _small_sdxl():
    """Same classes and block structure, narrower and shallower (about 0.1 GB)."""
    unet = dict(SDXL_UNET, block_out_channels=[64, 128, 256], attention_head_dim=[2, 4, 8],
                transformer_layers_per_block=[1, 1, 2], cross_attention_dim=768, addition_time_embed_dim=32,
                projection_class_embeddings_input_dim=6 * 32 + 512, addition_embed_type_num_heads=8)
    vae = dict(SDXL_VAE, block_out_channels=[64, 128, 256, 256])
    clip_l = dict(SDXL_CLIP_L, hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_hidden_layers=2,
                  projection_dim=256)
    clip_g = dict(SDXL_CLIP_G, hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_hidden_layers=2,
                  projection_dim=512)
    return unet, vae, clip_l, clip_g


TORCH_DTYPE_NAMES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "int64": "I64"}


def meta_tensors(cls_name: str, config: dict, dtype: str) -> list:
    """The state_dict of the real class built from `config` on the meta device:
    names, shapes and module order, every floating tensor stored as `dtype` (the
    fp16 variant files are saved with torch_dtype=float16)."""
    try:
        import torch
        if cls_name in ("CLIPTextModel", "CLIPTextModelWithProjection"):
            import transformers
            cfg = transformers.CLIPTextConfig(**{k: v for k, v in config.items()
                                                 if k not in ("architectures", "torch_dtype")})
            make = lambda: getattr(transformers, cls_name)(cfg)  # noqa: E731
        else:
            import diffusers
            make = lambda: getattr(diffusers, cls_name).from_config(  # noqa: E731
                {k: v for k, v in config.items() if k != "_class_name"})
    except ImportError as e:
        raise SystemExit(f"{cls_name}: the SDXL components are built from the real classes and need torch, "
                         f"diffusers and transformers ({e})")
    with torch.device("meta"):
        model = make()
    out = []
    for name, v in model.state_dict().items():
        if cls_name == "CLIPTextModel" and not name.startswith("text_model."):
            # Published CLIPTextModel files name the tower `text_model.`; transformers
            # >= 5 drops that prefix in the module and adds it back on save/load.
            name = "text_model." + name
        d = dtype if v.dtype.is_floating_point else TORCH_DTYPE_NAMES[str(v.dtype).removeprefix("torch.")]
        out.append(T(name, tuple(v.shape), d))
    return out


def sdxl_components(scale: str) -> list[Component]:
    if scale == "full":
        unet, vae, clip_l, clip_g = SDXL_UNET, SDXL_VAE, SDXL_CLIP_L, SDXL_CLIP_G
    else:
        unet, vae, clip_l, clip_g = _small_sdxl()
    full = scale == "full"
    v = ".fp16"  # variant, as the published repository names its half-precision files
    return [
        Component("sdxl-unet", "unet", "diffusion_pytorch_model" + v, "diffusers", "UNet2DConditionModel",
                  meta_tensors("UNet2DConditionModel", unet, "F16"), config=unet,
                  expect_tensors=1680 if full else None, approx_bytes=5_135_000_000 if full else None),
        Component("sdxl-clip-l", "text_encoder", "model" + v, "transformers", "CLIPTextModel",
                  meta_tensors("CLIPTextModel", clip_l, "F16"), config=clip_l,
                  expect_tensors=196 if full else None, approx_bytes=246_000_000 if full else None),
        Component("sdxl-clip-g", "text_encoder_2", "model" + v, "transformers", "CLIPTextModelWithProjection",
                  meta_tensors("CLIPTextModelWithProjection", clip_g, "F16"), config=clip_g,
                  expect_tensors=517 if full else None, approx_bytes=1_390_000_000 if full else None),
        Component("sdxl-vae", "vae", "diffusion_pytorch_model" + v, "diffusers", "AutoencoderKL",
                  meta_tensors("AutoencoderKL", vae, "F16"), config=vae,
                  expect_tensors=248 if full else None, approx_bytes=168_000_000 if full else None),
    ]


SDXL_MODEL_INDEX = {
    "_class_name": "StableDiffusionXLPipeline",
    "_diffusers_version": "0.19.0.dev0",
    "force_zeros_for_empty_prompt": True,
    "add_watermarker": None,
    "scheduler": ["diffusers", "EulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def real_shapes(c: Component) -> dict:
    """name -> shape of the tensors that the real class, built on the meta device from the config
    this script writes for `c`, loads: what diffusers and transformers expect to find in the files.
    Needs torch, diffusers and transformers."""
    import diffusers
    import torch
    import transformers

    cfg = {k: v for k, v in c.config.items() if k not in ("_class_name", "architectures", "torch_dtype", "model_type")}
    with torch.device("meta"):
        if c.library == "diffusers":
            m = getattr(diffusers, c.cls).from_config(cfg)
        else:
            conf = {"CLIPTextModel": transformers.CLIPTextConfig,
                    "CLIPTextModelWithProjection": transformers.CLIPTextConfig,
                    "T5EncoderModel": transformers.T5Config}[c.cls](**cfg)
            m = getattr(transformers, c.cls)(conf)
    real = {}
    for k, v in m.state_dict().items():
        if c.cls == "CLIPTextModel" and not k.startswith("text_model."):
            k = "text_model." + k  # saved and loaded under text_model. (meta_tensors)
        real[k] = tuple(v.shape)
    if c.cls == "T5EncoderModel":
        real.pop("encoder.embed_tokens.weight", None)  # tied to shared.weight, not saved
    return real


def compare_with_real_class(c: Component) -> tuple[list, list, list]:
    """(missing, unexpected, mismatched shapes) of the written tensors against real_shapes(c)."""
    real = real_shapes(c)
    mine = {t.name: tuple(t.shape) for t in c.tensors}
    return (sorted(set(real) - set(mine)), sorted(set(mine) - set(real)),
            sorted(k for k in set(real) & set(mine) if real[k] != mine[k]))


def flux_against_real_classes() -> list[str]:
    """Compare the hand-coded FLUX components (full scale) with the real classes built from the
    written configs on the meta device: names and shapes. Returns one line per component."""
    try:
        import diffusers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return [f"  (no comparison with the real classes: {e})"]
    lines = []
    for c in components("full"):
        missing, extra, shape = compare_with_real_class(c)
        if not (missing or extra or shape):
            lines.append(f"  {c.key:9s} same {len(c.tensors)} names and shapes as {c.library} {c.cls}  OK")
        else:
            lines.append(f"  {c.key:9s} differs from {c.library} {c.cls}: {len(missing)} missing "
                         f"{missing[:3]}, {len(extra)} extra {extra[:3]}, {len(shape)} shapes {shape[:3]}")
    return lines


# ---------------------------------------------------------------- scheduler and tokenizers

# Published scheduler configs (black-forest-labs/FLUX.1-dev, stabilityai/stable-diffusion-xl-base-1.0).
FLUX_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
                  "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
                  "use_dynamic_shifting": True}
SDXL_SCHEDULER = {"_class_name": "EulerDiscreteScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
                  "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear",
                  "num_train_timesteps": 1000, "prediction_type": "epsilon", "sample_max_value": 1.0,
                  "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
                  "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False}

TOKENIZER_VOCAB = 1000  # tokens learned (at most); below every text encoder's vocab_size


def _corpus() -> list[str]:
    """Text to train the tokenizers on: this script's own docstring (nothing can be downloaded)."""
    return [line for line in (__doc__ or "").splitlines() if line.strip()] * 4


def tokenizer_files(kind: str) -> dict:
    """file name -> text of a tokenizer folder that transformers loads (CLIPTokenizer for "clip",
    T5TokenizerFast for "t5"), trained here with the `tokenizers` library on _corpus(): the
    published tokenizers' model types (byte-pair with "</w>" for CLIP, unigram for T5), special
    tokens and templates, a small vocabulary."""
    try:
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    except ImportError as e:
        raise SystemExit(f"the pipelines' tokenizers are trained with the tokenizers package ({e})")
    if kind == "clip":
        tok = Tokenizer(models.BPE(unk_token="<|endoftext|>", end_of_word_suffix="</w>"))
        tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.decoder = decoders.BPEDecoder(suffix="</w>")
        tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
            vocab_size=TOKENIZER_VOCAB, special_tokens=["<|startoftext|>", "<|endoftext|>"],
            end_of_word_suffix="</w>", show_progress=False))
        bos, eos = "<|startoftext|>", "<|endoftext|>"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B {eos}",
            special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))])
        config = {"tokenizer_class": "CLIPTokenizer", "bos_token": bos, "eos_token": eos, "unk_token": eos,
                  "pad_token": eos, "model_max_length": 77}
    else:
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        tok.train_from_iterator(_corpus(), trainers.UnigramTrainer(
            vocab_size=TOKENIZER_VOCAB, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
            show_progress=False))
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))])
        config = {"tokenizer_class": "T5Tokenizer", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
                  "model_max_length": 512, "extra_ids": 0}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def write_pipeline_files(root: str, model_index: dict) -> None:
    """model_index.json and what it names besides the weights: the scheduler's config and the
    tokenizers, so that DiffusionPipeline.from_pretrained loads the folder whole."""
    write_text(os.path.join(root, "model_index.json"), model_index)
    for name, entry in model_index.items():
        if name.startswith("_") or not isinstance(entry, list):
            continue
        cls = entry[1]
        if name == "scheduler":
            scheduler = FLUX_SCHEDULER if cls == FLUX_SCHEDULER["_class_name"] else SDXL_SCHEDULER
            os.makedirs(os.path.join(root, name), exist_ok=True)
            write_text(os.path.join(root, name, "scheduler_config.json"), scheduler)
        elif name.startswith("tokenizer"):
            folder = os.path.join(root, name)
            os.makedirs(folder, exist_ok=True)
            for file, text in tokenizer_files("t5" if cls.startswith("T5") else "clip").items():
                path = os.path.join(folder, file)
                if not (os.path.isfile(path) and open(path).read() == text):
                    with open(path, "w") as f:
                        f.write(text)


# ---------------------------------------------------------------- sharding


def greedy_shards(tensors, max_size):
    """huggingface_hub.split_state_dict_into_shards_factory: state_dict order, a new
    shard when the next tensor would tip the current one over max_size."""
    shards, cur, cur_size = [], [], 0
    for t in tensors:
        if t.nbytes > max_size:
            shards.append([t])
            continue
        if cur and cur_size + t.nbytes > max_size:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(t)
        cur_size += t.nbytes
    if cur:
        shards.append(cur)
    return shards


def split(comp: Component):
    if comp.shards == 1:
        return [comp.tensors]
    if comp.max_shard_size is not None:
        out = greedy_shards(comp.tensors, comp.max_shard_size)
    else:  # smallest max size that gives at most `shards` shards
        lo, hi = max(t.nbytes for t in comp.tensors), comp.total_bytes
        while lo < hi:
            mid = (lo + hi) // 2
            if len(greedy_shards(comp.tensors, mid)) <= comp.shards:
                hi = mid
            else:
                lo = mid + 1
        out = greedy_shards(comp.tensors, lo)
    if len(out) != comp.shards:
        raise SystemExit(f"{comp.key}: sharding gave {len(out)} shards, expected {comp.shards}")
    return out


def shard_name(comp: Component, i: int, n: int) -> str:
    if n == 1:
        return f"{comp.stem}.safetensors"
    return f"{comp.stem}-{i + 1:05d}-of-{n:05d}.safetensors"


# ---------------------------------------------------------------- writing


def header_bytes(tensors, metadata=None) -> bytes:
    """safetensors header: tensors sorted by name, contiguous; JSON padded with
    spaces to a multiple of 8 (as the reference writer). `metadata` adds keys to
    {"format": "pt"}."""
    hdr = {"__metadata__": {"format": "pt", **(metadata or {})}}
    off = 0
    for t in sorted(tensors, key=lambda t: t.name):
        hdr[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    js = json.dumps(hdr, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js


class RandomBytes:
    """Incompressible, non-repeating bytes at memory speed: one 64 MiB random base,
    XOR-ed with a fresh 64-bit key per chunk. Floating tensors filled so hold NaN and
    inf; `--fill random` and the benchmarks (bench/fresh_bench.py) use it."""

    CHUNK = 64 << 20
    metadata: dict = {}  # the files' header is as it always was: caches of random files stay valid

    def __init__(self, seed=0):
        import numpy as np
        self.np = np
        self.rng = np.random.default_rng(seed)
        self.base = self.rng.integers(0, 2**63, size=self.CHUNK // 8, dtype=np.uint64)
        self.buf = np.empty_like(self.base)

    def chunk(self) -> memoryview:
        key = self.np.uint64(int(self.rng.integers(1, 2**63)))
        self.np.bitwise_xor(self.base, key, out=self.buf)
        return memoryview(self.buf).cast("B")

    def data(self, tensors):
        """The data section of a file holding `tensors`, in chunks."""
        left = sum(t.nbytes for t in tensors)
        while left:
            c = self.chunk()
            n = min(left, len(c))
            yield c[:n]
            left -= n


# Note [Weight-like values]
# A checkpoint of random bytes is not a model: its fp16 and bf16 tensors hold NaN and inf, which
# `pinload convert` refuses and `torch.equal` never equates. The default fill gives each tensor
# its kind's usual values instead (trained checkpoints' scales, GPT-2/T5-style initialisation):
# weights, embeddings and convolutions N(0, 0.02), norms' weights 1 + N(0, 0.02), biases
# N(0, 0.01), integer buffers 0..n-1 along their last axis. Drawing every element would run far
# below disk speed, so one block of N(0, 1) float32 is drawn once and encoded once per (kind,
# dtype); a tensor is made of windows of it at random offsets (the encoded block is stored twice
# over, so that any window is contiguous). Each tensor's offsets come from a generator seeded
# with (seed, its name), so a file's bytes depend neither on which files were written before nor
# on the order of writing. FILL_VERSION goes into every file's metadata: a change here bumps it,
# and files written before (kept while their header matches: write_file) are then rewritten.
FILL_VERSION = "weights-1"


def tensor_kind(t: T) -> str:
    """"bias", "norm" (a norm's scale: a 1-D weight of a module named *norm*, ln_*), "int" or "weight"."""
    if t.dtype == "I64":
        return "int"
    module, _, leaf = t.name.rpartition(".")
    if leaf == "bias":
        return "bias"
    last = module.rpartition(".")[2].lower()
    if leaf == "weight" and len(t.shape) == 1 and ("norm" in last or last == "ln" or last.startswith("ln_")):
        return "norm"
    return "weight"


class WeightValues:
    """Finite, weight-like values at about memory speed (Note [Weight-like values])."""

    BLOCK = 1 << 22  # elements: 16 MiB of float32
    KINDS = {"weight": (0.0, 0.02), "norm": (1.0, 0.02), "bias": (0.0, 0.01)}  # (mean, std)

    def __init__(self, seed=0):
        import numpy as np
        self.np = np
        self.seed = seed
        self.z = np.random.default_rng([seed, 0x9E3779B9]).standard_normal(self.BLOCK, dtype=np.float32)
        self.encoded = {}
        self.metadata = {"pinload_fill": FILL_VERSION}

    def _block(self, kind: str, dtype: str) -> memoryview:
        key = (kind, dtype)
        if key not in self.encoded:
            np = self.np
            mean, std = self.KINDS[kind]
            f = self.z * np.float32(std) + np.float32(mean)
            if dtype == "F32":
                e = f
            elif dtype == "F16":
                e = f.astype(np.float16)
            elif dtype == "BF16":  # round to nearest even (as torch's .to(bfloat16))
                u = f.view(np.uint32)
                e = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
            else:
                raise ValueError(f"no weight-like values for dtype {dtype}")
            self.encoded[key] = memoryview(np.concatenate([e, e])).cast("B")
        return self.encoded[key]

    def tensor(self, t: T):
        """The bytes of tensor `t`, in chunks."""
        np = self.np
        kind = tensor_kind(t)
        n = math.prod(t.shape)
        if kind == "int":
            last = t.shape[-1] if t.shape else 1
            yield memoryview(np.resize(np.arange(last, dtype="<i8"), n)).cast("B")
            return
        block = self._block(kind, t.dtype)
        size = DTYPE_BYTES[t.dtype]
        rng = np.random.default_rng([self.seed, zlib.crc32(t.name.encode())])
        while n:
            k = min(n, self.BLOCK)
            off = int(rng.integers(self.BLOCK))
            yield block[off * size:(off + k) * size]
            n -= k

    def data(self, tensors):
        """The data section of a file holding `tensors` (the header's order: sorted by name)."""
        for t in sorted(tensors, key=lambda t: t.name):
            yield from self.tensor(t)


FILLS = {"weights": WeightValues, "random": RandomBytes}


def write_file(path, tensors, fill, force: bool) -> tuple[bool, int]:
    """Writes `tensors` filled by `fill` (WeightValues or RandomBytes) unless a file of the same
    header and size is there. Returns (written, size)."""
    head = header_bytes(tensors, fill.metadata)
    data = sum(t.nbytes for t in tensors)
    size = len(head) + data
    if not force and os.path.isfile(path) and os.path.getsize(path) == size:
        with open(path, "rb") as f:
            if f.read(len(head)) == head:
                return False, size
    tmp = path + ".tmp"
    with open(tmp, "wb", buffering=0) as f:
        f.write(head)
        for c in fill.data(tensors):
            f.write(c)
    if os.path.getsize(tmp) != size:
        raise SystemExit(f"{tmp}: wrote {os.path.getsize(tmp)} bytes, expected {size}")
    os.replace(tmp, path)
    return True, size


def write_text(path, obj):
    text = json.dumps(obj, indent=2, sort_keys=False) + "\n"
    if os.path.isfile(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


def default_out() -> str:
    return os.environ.get("PINLOAD_MODELS") or os.path.join(os.path.expanduser("~"), ".cache", "pinload", "models")


def fmt_bytes(n):
    return f"{n:,} B ({n / 1e9:.3f} GB)"


PIPELINES = {
    # name: (folder at full scale, components(scale), model_index.json, seed offset)
    "flux-dev": ("flux-dev", components, MODEL_INDEX, 0),
    "sdxl-base": ("sdxl-base", sdxl_components, SDXL_MODEL_INDEX, 1),
}
# --only aliases for a whole pipeline
ALIASES = {"flux": ["clip-l", "t5-xxl", "flux-dev", "vae"],
           "sdxl": ["sdxl-unet", "sdxl-clip-l", "sdxl-clip-g", "sdxl-vae"]}


def pipeline_root(out: str, pipeline: str, scale: str) -> str:
    folder = PIPELINES[pipeline][0]
    return os.path.join(out, folder if scale == "full" else folder + "-small")


def check(scale, pipelines=("flux-dev", "sdxl-base")):
    ok = True
    print(f"scale={scale}")
    for pipe in pipelines:
        for c in PIPELINES[pipe][1](scale):
            ok = check_component(c, scale) and ok
    return ok


def check_component(c: Component, scale: str) -> bool:
    shards = split(c)
    line = f"  {c.key:11s} {c.cls:28s} {len(c.tensors):5d} tensors  {fmt_bytes(c.total_bytes)}  {len(shards)} file(s)"
    problems = []
    if scale == "full":
        if c.expect_tensors is not None and len(c.tensors) != c.expect_tensors:
            problems.append(f"tensors {len(c.tensors)} != {c.expect_tensors}")
        if c.expect_bytes is not None and c.total_bytes != c.expect_bytes:
            problems.append(f"bytes {c.total_bytes} != {c.expect_bytes}")
        if c.approx_bytes is not None and abs(c.total_bytes - c.approx_bytes) > 0.02 * c.approx_bytes:
            problems.append(f"bytes {c.total_bytes} not within 2% of ~{c.approx_bytes}")
    names = [t.name for t in c.tensors]
    if len(set(names)) != len(names):
        problems.append("duplicate tensor names")
    print(line + ("  OK" if not problems else "  MISMATCH: " + "; ".join(problems)))
    for i, s in enumerate(shards):
        if len(shards) > 1:
            print(f"      {shard_name(c, i, len(shards))}: {len(s)} tensors, {fmt_bytes(sum(t.nbytes for t in s))}")
    return not problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=default_out(), help="output root (default $PINLOAD_MODELS or ~/.cache/pinload/models)")
    ap.add_argument("--scale", choices=("full", "small"), default="full")
    ap.add_argument("--only", default=None,
                    help="comma list of clip-l,t5-xxl,flux-dev,vae (FLUX) and sdxl-unet,sdxl-clip-l,sdxl-clip-g,"
                         "sdxl-vae (SDXL); 'flux' and 'sdxl' name a whole pipeline (default: all but flux-dev at "
                         "full scale, all at small)")
    ap.add_argument("--shards", default=None,
                    help="comma list of 1-based shard numbers to write for sharded components (the index is always "
                         "complete; a folder with missing shards does not open as a whole, but each shard file does)")
    ap.add_argument("--check", action="store_true", help="print computed totals against the published models' figures and exit")
    ap.add_argument("--force", action="store_true", help="rewrite files that already exist")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fill", choices=tuple(FILLS), default="weights",
                    help="weights: finite, weight-like values of each tensor kind's usual scale (Note [Weight-like "
                         "values]); random: random bytes (fp16/bf16 tensors then hold NaN and inf)")
    a = ap.parse_args(argv)

    if a.check:
        ok = check("full")
        print("hand-coded FLUX components against the real classes:")
        lines = flux_against_real_classes()
        print("\n".join(lines))
        ok = ok and not any("differs" in x for x in lines)
        check("small")
        return 0 if ok else 1

    keys = {"flux-dev": ALIASES["flux"], "sdxl-base": ALIASES["sdxl"]}
    every = [k for ks in keys.values() for k in ks]
    if a.only:
        want = []
        for k in (k.strip() for k in a.only.split(",")):
            want += ALIASES.get(k, [k] if k else [])
        bad = [k for k in want if k not in every]
        if bad:
            ap.error(f"unknown component(s) {bad}; choose from {every} or {list(ALIASES)}")
    else:
        want = [k for k in every if a.scale == "small" or k != "flux-dev"]
    shard_sel = None
    if a.shards:
        shard_sel = {int(s) for s in a.shards.split(",")}

    grand = 0
    for pipe, (_, make, model_index, seed_offset) in PIPELINES.items():
        if not any(k in want for k in keys[pipe]):
            continue
        root = pipeline_root(a.out, pipe, a.scale)
        os.makedirs(root, exist_ok=True)
        write_pipeline_files(root, model_index)
        # One fill per pipeline, so that adding a pipeline leaves the bytes of the others as they were.
        fill = FILLS[a.fill](a.seed + seed_offset)
        for c in make(a.scale):
            if c.key not in want:
                continue
            grand += write_component(c, root, fill, shard_sel, a.force)
        print(f"{root}: done")
    print(f"{fmt_bytes(grand)} in the selected files")
    return 0


def write_component(c: Component, root: str, fill, shard_sel, force: bool) -> int:
    d = os.path.join(root, c.folder)
    os.makedirs(d, exist_ok=True)
    write_text(os.path.join(d, "config.json"), dict(c.config))
    shards = split(c)
    n = len(shards)
    if n > 1:
        weight_map = {}
        for i, s in enumerate(shards):
            for t in s:
                weight_map[t.name] = shard_name(c, i, n)
        index = {"metadata": {"total_size": c.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        write_text(os.path.join(d, f"{c.stem}.safetensors.index.json"), index)
    total = 0
    for i, s in enumerate(shards):
        if n > 1 and shard_sel is not None and (i + 1) not in shard_sel:
            continue
        path = os.path.join(d, shard_name(c, i, n))
        t0 = time.monotonic()
        wrote, size = write_file(path, s, fill, force)
        dt = time.monotonic() - t0
        total += size
        what = f"wrote in {dt:.1f}s ({size / dt / 1e9:.2f} GB/s)" if wrote else "exists, kept"
        print(f"{path}: {len(s)} tensors, {fmt_bytes(size)}: {what}", flush=True)
    return total


if __name__ == "__main__":
    sys.exit(main())
