"""A tiny FluxPipeline whose T5 embeddings come from the server gives the latents of the local
pipeline, with the same seed; T5's weights are never loaded in the pipeline's process."""

import pytest
import torch

from pinload.encoder import EncoderClient
from pinload.encoder.diffusers import attach, load_pipeline

diffusers = pytest.importorskip("diffusers")

KW = dict(height=32, width=32, num_inference_steps=2, output_type="latent", max_sequence_length=32,
          guidance_scale=3.5)


def latents(pipe, prompt, seed=0, **kw):
    return pipe(prompt, generator=torch.Generator().manual_seed(seed), **KW, **kw).images


@pytest.fixture(scope="module")
def local_pipe(models):
    return diffusers.FluxPipeline.from_pretrained(str(models["flux"]))


def test_remote_t5_gives_the_local_latents(servers, models, local_pipe):
    client = EncoderClient(servers["main"].url)
    pipe = load_pipeline(str(models["flux"]), client)
    assert pipe.text_encoder_2 is None and pipe.tokenizer_2 is None  # never loaded here
    assert pipe.text_encoder is not None  # CLIP (pooled embeddings) stays local
    for prompt, extra in [("a cat on a chair", {}), (["a red boat", "a dragon over a castle"], {}),
                          ("a lighthouse", {"num_images_per_prompt": 2})]:
        a = latents(local_pipe, prompt, **extra)
        b = latents(pipe, prompt, **extra)
        assert a.shape == b.shape
        scale = float(a.abs().max())
        assert float((a - b).abs().max()) <= 1e-5 * scale, float((a - b).abs().max())


def test_local_fallback_when_the_server_is_down(models, local_pipe):
    from conftest import free_port

    client = EncoderClient(f"http://127.0.0.1:{free_port()}", retries=1, backoff=0.01)
    pipe = load_pipeline(str(models["flux"]), client, fallback=True)
    a, b = latents(local_pipe, "a cat on a chair"), latents(pipe, "a cat on a chair")
    assert client.fallback_used == 1
    assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())


def test_attach_refuses_other_pipelines():
    class NotFlux:
        pass

    with pytest.raises(TypeError, match="_get_t5_prompt_embeds"):
        attach(NotFlux(), EncoderClient("http://127.0.0.1:1"))
