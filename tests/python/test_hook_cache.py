"""patch_diffusers(cache=...) and patch_transformers(cache=...) (Note [Hooks over a model cache]):
a worker that builds the same models again with from_pretrained reads nothing the second time.

Checked by what was read and what the models hold, not by timing: the cache's hits and misses,
the weights' bytes against safetensors' (an independent reader), and the second build's weights
being the very memory of the first's (no host copy)."""

import warnings

import pytest
import torch
import safetensors.torch as st

import pinload

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cachehooks")
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vae = diffusers.AutoencoderKL(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                                      up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4,
                                      norm_num_groups=8, sample_size=16).half()
        vae.save_pretrained(root / "vae", safe_serialization=True)
        clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=16)).half()
        clip.save_pretrained(root / "clip", safe_serialization=True)
    return root


def same_bytes(model, path):
    ref = st.load_file(str(path))
    sd = model.state_dict()
    checked = 0
    for name, want in ref.items():
        got = sd.get(name, sd.get(name.split(".", 1)[1]) if "." in name else None)
        if got is None:
            continue
        assert got.dtype == want.dtype, name
        assert got.contiguous().view(torch.uint8).equal(want.contiguous().view(torch.uint8)), name
        checked += 1
    assert checked >= len(ref) - 2, (checked, len(ref))


def pointers(model):
    return {n: p.data_ptr() for n, p in model.state_dict().items()}


def test_second_build_reads_nothing_and_shares_the_cached_memory(models):
    cache = pinload.ModelCache("1G")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pinload.patch_diffusers(cache=cache) as patch:
            first = diffusers.AutoencoderKL.from_pretrained(models / "vae", torch_dtype=torch.float16)
            after_first = cache.stats()
            second = diffusers.AutoencoderKL.from_pretrained(models / "vae", torch_dtype=torch.float16)
            clip1 = transformers.CLIPTextModel.from_pretrained(models / "clip", dtype=torch.float16)
            clip2 = transformers.CLIPTextModel.from_pretrained(models / "clip", dtype=torch.float16)
    stats = cache.stats()
    assert after_first["misses"] == 1 and after_first["hits"] == 0, after_first
    assert stats["misses"] == 2 and stats["hits"] == 2, stats
    assert patch.counts()["cache.get"] == 4, patch.counts()
    same_bytes(second, models / "vae" / "diffusion_pytorch_model.safetensors")
    same_bytes(clip2, models / "clip" / "model.safetensors")
    # The second build holds the first's memory: nothing copied on the host.
    assert pointers(first) == pointers(second)
    assert pointers(clip1) == pointers(clip2)


def test_a_model_in_another_dtype_is_cast_by_from_pretrained(models):
    cache = pinload.ModelCache("1G")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pinload.patch_diffusers(cache=cache):
            vae = diffusers.AutoencoderKL.from_pretrained(models / "vae", torch_dtype=torch.float32)
    ref = st.load_file(str(models / "vae" / "diffusion_pytorch_model.safetensors"))
    for name, want in ref.items():
        got = vae.state_dict()[name]
        assert got.dtype == torch.float32 and torch.equal(got, want.float()), name


def test_without_a_cache_nothing_is_kept(models):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pinload.patch_diffusers() as patch:
            diffusers.AutoencoderKL.from_pretrained(models / "vae", torch_dtype=torch.float16)
    assert "cache.get" not in patch.counts()
