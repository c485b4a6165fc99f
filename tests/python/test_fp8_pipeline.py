"""A tiny real diffusers pipeline (DiT: transformer, VAE, scheduler; random weights, built here),
converted to FP8 by pinload and loaded back with torch_dtype=bf16 through patch_diffusers: the
images' PSNR against the bf16 original is above PSNR_FLOOR_DB (docs/fp8.md states it)."""

from __future__ import annotations

import math

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import pinload  # noqa: E402

#: The images of the FP8 pipeline against those of the bf16 one it came from. Measured 30-33 dB
#: for this pipeline (docs/fp8.md); the floor leaves room for other seeds and library versions.
PSNR_FLOOR_DB = 24.0


def _tiny_dit(seed: int = 0) -> "diffusers.DiTPipeline":
    torch.manual_seed(seed)
    transformer = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=8, num_layers=2,
        sample_size=8, patch_size=2, num_embeds_ada_norm=1000, norm_type="ada_norm_zero")
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(32, 32),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4, norm_num_groups=8, sample_size=16)
    scheduler = diffusers.DDIMScheduler()
    return diffusers.DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler)


def _images(pipe) -> torch.Tensor:
    out = pipe(class_labels=[1, 3], num_inference_steps=3, generator=torch.Generator().manual_seed(0),
               output_type="np")
    return torch.from_numpy(out.images).float()


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = torch.mean((a - b) ** 2).item()
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def test_fp8_dit_pipeline_psnr_against_bf16(tmp_path):
    original = tmp_path / "dit-bf16"
    _tiny_dit().to(torch.bfloat16).save_pretrained(original, safe_serialization=True)
    converted = tmp_path / "dit-fp8"
    stats = pinload.convert(original, converted)
    assert stats["tensors_quantized"] > 0

    reference = diffusers.DiTPipeline.from_pretrained(original, torch_dtype=torch.bfloat16)
    with pinload.patch_diffusers() as patch:
        fp8 = diffusers.DiTPipeline.from_pretrained(converted, torch_dtype=torch.bfloat16)
    assert patch.counts().get("files", 0) >= 2, "the components were loaded through pinload"
    q = fp8.transformer.transformer_blocks[0].attn1.to_q.weight
    assert q.dtype == torch.bfloat16
    assert not torch.equal(q, reference.transformer.transformer_blocks[0].attn1.to_q.weight), "really FP8"

    psnr = _psnr(_images(fp8), _images(reference))
    print(f"FP8 DiT pipeline PSNR against bf16: {psnr:.1f} dB (floor {PSNR_FLOOR_DB} dB)")
    assert psnr > PSNR_FLOOR_DB


def test_patch_diffusers_loads_in_torch_dtype_without_a_second_cast(tmp_path):
    """torch_dtype and _keep_in_fp32_modules reach the load (Note [dtype through the conversion])."""
    original = tmp_path / "dit-fp32"
    _tiny_dit().save_pretrained(original, safe_serialization=True)
    seen = []
    import pinload.torch as pt

    real = pt.load_file

    def spy(*args, **kwargs):
        seen.append(kwargs.get("dtype"))
        return real(*args, **kwargs)

    pt.load_file = spy
    try:
        with pinload.patch_diffusers():
            pipe = diffusers.DiTPipeline.from_pretrained(original, torch_dtype=torch.bfloat16)
    finally:
        pt.load_file = real
    assert seen and all(d == torch.bfloat16 for d in seen)
    assert pipe.transformer.transformer_blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    # Restored on exit: a subclass's from_pretrained is the plain classmethod again.
    assert "pinload" not in repr(diffusers.ModelMixin.__dict__["from_pretrained"].__func__.__module__)
