"""Tiny text encoders and a tiny FLUX pipeline with random weights, written as a real model
folder would be (config.json, model.safetensors, tokenizer files), and tokenizers trained here
with the `tokenizers` library: nothing comes from the hub.

    python3 tests/encoder/tiny_models.py OUT [--t5-size tiny|base]   # also used by bench/encoder_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TEXT = """a photo of a cat sitting on a red chair in the sun
an oil painting of a lighthouse on a cliff at night with stars
a watercolor of mountains and a lake, soft light, morning fog
portrait of an old man with a beard, studio lighting, black and white
a futuristic city street with neon signs in the rain
a bowl of fruit on a wooden table: apples, pears, grapes and a lemon
the quick brown fox jumps over the lazy dog
a small boat on the sea under a cloudy sky, seagulls flying
close-up of a flower with dew drops, macro photography
a dragon flying over a castle, fantasy art, highly detailed
""" * 4


def _train(model: str, special: list, vocab_size: int = 400):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    if model == "unigram":
        tok = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=special, unk_token="<unk>")
    else:
        tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special)
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace() if model == "unigram" else pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    return tok


def t5_tokenizer(out: Path, model_max_length: int = 512):
    """A T5-style tokenizer: <pad>=0, </s>=1, <unk>=2, </s> appended, padded with <pad>."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _train("unigram", ["<pad>", "</s>", "<unk>"])
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=model_max_length)
    fast.save_pretrained(str(out))
    return fast


def clip_tokenizer(out: Path, model_max_length: int = 77):
    """A CLIP-style tokenizer: <|startoftext|> $A <|endoftext|>, padded with <|endoftext|>."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _train("bpe", ["<|startoftext|>", "<|endoftext|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 0), ("<|endoftext|>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   model_max_length=model_max_length)
    fast.save_pretrained(str(out))
    return fast


T5_SIZES = {
    # d_model, d_ff, layers, heads, d_kv
    "tiny": dict(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8),
    # about 300 MB in fp32: the benchmarks' encoder (fits 4 workers on a 24 GB machine)
    "base": dict(d_model=768, d_ff=2048, num_layers=12, num_heads=12, d_kv=64),
}


def t5_config(size: str = "tiny"):
    from transformers import T5Config

    return T5Config(vocab_size=400, **T5_SIZES[size], relative_attention_num_buckets=8,
                    relative_attention_max_distance=32, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
                    use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                    tie_word_embeddings=False)


def clip_config():
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
                          bos_token_id=0, eos_token_id=1, pad_token_id=1)


def _save(model, out: Path):
    import torch

    torch.manual_seed(0)
    model.save_pretrained(str(out), safe_serialization=True)


def make_t5(out: Path, size: str = "tiny", seed: int = 0, dtype=None) -> Path:
    """A T5EncoderModel folder with its tokenizer in the same folder."""
    import torch
    from transformers import T5EncoderModel

    torch.manual_seed(seed)
    model = T5EncoderModel(t5_config(size)).eval()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(out))
    t5_tokenizer(out)
    return out


def flux_t5_config():
    """T5 v1.1 XXL as FLUX.1 and SD3 ship it (google/t5-v1_1-xxl: gated-gelu, 32 buckets up to 128
    positions, untied embeddings, d_kv 64), narrower and shallower."""
    from transformers import T5Config

    return T5Config(vocab_size=400, d_model=128, d_ff=320, num_layers=2, num_heads=4, d_kv=64,
                    relative_attention_num_buckets=32, relative_attention_max_distance=128,
                    feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False, pad_token_id=0,
                    eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=False,
                    architectures=["T5EncoderModel"])


def realistic_(model, seed: int = 0):
    """Weight-like values in place: every weight and embedding N(0, 0.02), norms 1 + N(0, 0.02),
    biases N(0, 0.002): finite in every dtype, as a trained checkpoint's (random init is not: T5's
    factor-scaled init, for one, is far wider)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                value = 1 + 0.02 * noise
            elif name.endswith("bias"):
                value = 0.002 * noise
            else:
                value = 0.02 * noise
            p.copy_(value.to(p.dtype))
    return model


def make_flux_t5(out: Path, dtype=None, seed: int = 0) -> Path:
    """A FLUX-shaped T5EncoderModel folder (flux_t5_config) with realistic weights (realistic_),
    stored in ``dtype`` (FLUX's T5 ships in bfloat16), tokenizer in the same folder."""
    from transformers import T5EncoderModel

    model = realistic_(T5EncoderModel(flux_t5_config()).eval(), seed)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(out))
    t5_tokenizer(out)
    return out


def make_clip(out: Path, seed: int = 0, projection: bool = False, dtype=None, realistic: bool = False) -> Path:
    import torch
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    model = cls(clip_config()).eval()
    if realistic:
        realistic_(model, seed)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(out))
    clip_tokenizer(out)
    return out


def make_flux(out: Path, seed: int = 0) -> Path:
    """A FLUX-style diffusers pipeline folder: one double and one single block, 8-channel VAE."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=[4, 6, 6])
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    tmp = out / "_tok"
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                        text_encoder=CLIPTextModel(clip_config()).eval(), tokenizer=clip_tokenizer(tmp / "1"),
                        text_encoder_2=T5EncoderModel(t5_config("tiny")).eval(),
                        tokenizer_2=t5_tokenizer(tmp / "2"), transformer=transformer)
    pipe.save_pretrained(str(out))
    import shutil

    shutil.rmtree(tmp)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--t5-size", choices=sorted(T5_SIZES), default="tiny")
    ap.add_argument("--flux", action="store_true", help="also a tiny FLUX pipeline in OUT/flux")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    make_t5(args.out / "t5", args.t5_size)
    if args.flux:
        make_flux(args.out / "flux")
    print(json.dumps({"t5": str(args.out / "t5")}))


if __name__ == "__main__":
    main()
