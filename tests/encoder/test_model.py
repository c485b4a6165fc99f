"""The encoder as the server loads it (in process): CLIP through the T5 path, batch against single
in both padding modes, the identity that keys the cache, and the cache's byte bound."""

import shutil

import pytest
import torch

from pinload.encoder.cache import EmbeddingCache, cache_key
from pinload.encoder.model import EncodeSpec, Encoder, encoder_identity

PROMPTS = ["a cat", "a photo of a cat sitting on a red chair in the sun", "dog",
           "an oil painting of a lighthouse on a cliff at night with stars"]


def close(a, b, tol=1e-5):
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
    return float((a - b).abs().max()) <= tol * scale


@pytest.mark.parametrize("name", ["t5", "clip"])
@pytest.mark.parametrize("padding", ["max_length", "longest"])
def test_batch_equals_single(models, name, padding):
    enc = Encoder.load(str(models[name]))
    spec = EncodeSpec(max_length=24, padding=padding)
    batch = enc.encode(PROMPTS, spec)
    for p, b in zip(PROMPTS, batch):
        single = enc.encode([p], spec)[0]
        assert b["embeddings"].shape == single["embeddings"].shape
        assert torch.equal(b["attention_mask"], single["attention_mask"])
        assert close(b["embeddings"], single["embeddings"])
        if "pooled" in b:
            assert close(b["pooled"], single["pooled"])


def test_clip_through_the_same_path(models):
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

    for name, cls, pooled_name in [("clip", CLIPTextModel, "pooler_output"),
                                   ("clip_proj", CLIPTextModelWithProjection, "text_embeds")]:
        enc = Encoder.load(str(models[name]))
        assert enc.info["class"] == cls.__name__ and enc.model_max_length == 77 and enc.has_pooled
        ref = cls.from_pretrained(str(models[name])).eval()
        tok = AutoTokenizer.from_pretrained(str(models[name]))
        ids = tok(PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = ref(ids, output_hidden_states=True)
        got = enc.encode(PROMPTS, EncodeSpec(max_length=77))
        assert close(torch.stack([g["embeddings"] for g in got]), out.last_hidden_state)
        assert close(torch.stack([g["pooled"] for g in got]), getattr(out, pooled_name))
        got = enc.encode(PROMPTS, EncodeSpec(max_length=77, hidden_layer=-2))  # SDXL's penultimate layer
        assert close(torch.stack([g["embeddings"] for g in got]), out.hidden_states[-2])


def test_identity_tells_encoders_apart(models, tmp_path):
    t5 = Encoder.load(str(models["t5"]))
    other = Encoder.load(str(models["t5_other"]))  # same config, headers and tokenizer; other weights
    assert other.tokenizer_identity == Encoder.load(str(models["t5"])).tokenizer_identity
    copy = tmp_path / "copy"
    shutil.copytree(models["t5"], copy)
    same = Encoder.load(str(copy))
    bf16 = Encoder.load(str(models["t5"]), dtype="bf16")
    assert same.identity == t5.identity  # content, not path
    assert other.model_identity != t5.model_identity
    assert bf16.identity != t5.identity and bf16.encode(["a"], EncodeSpec(8))[0]["embeddings"].dtype == torch.bfloat16
    # another tokenizer: same model identity, another identity
    tok = copy / "tokenizer_config.json"
    tok.write_text(tok.read_text().replace('"model_max_length": 512', '"model_max_length": 256'))
    retok = Encoder.load(str(copy))
    assert retok.model_identity == t5.model_identity and retok.identity != t5.identity
    # without the tensor samples, the headers alone cannot tell t5 from t5_other
    assert encoder_identity(models["t5"], "float32") == encoder_identity(models["t5_other"], "float32")
    spec = EncodeSpec(max_length=16)
    keys = {cache_key(e.identity, spec, "a cat") for e in (t5, other, bf16, retok)}
    assert len(keys) == 4


def test_a_changed_encoder_never_hits_the_old_entries(models):
    """One cache, two encoders of the same layout: the second never gets the first's answers."""
    cache = EmbeddingCache(1 << 20)
    spec = EncodeSpec(max_length=8)
    for name in ("t5", "t5_other"):
        enc = Encoder.load(str(models[name]))
        key = cache_key(enc.identity, spec, "a cat")
        hit = cache.get(key)
        assert hit is None
        cache.put(key, enc.encode(["a cat"], spec)[0])
    assert cache.stats()["entries"] == 2 and cache.stats()["hits"] == 0


def test_cache_is_lru_bounded_in_bytes():
    item = lambda v: {"embeddings": torch.full((4, 8), float(v)), "attention_mask": torch.ones(4, dtype=torch.int64)}
    size = 4 * 8 * 4 + 4 * 8 + 256
    cache = EmbeddingCache(3 * size)
    for k in "abc":
        cache.put(k, item(ord(k)))
    assert cache.bytes == 3 * size
    assert cache.get("a") is not None  # a is now the most recent: b goes first
    cache.put("d", item(0))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("d") is not None
    assert cache.bytes <= cache.capacity and cache.stats()["evictions"] == 1
    cache.put("big", {"embeddings": torch.zeros(1000)})  # larger than the whole cache: not kept
    assert cache.get("big") is None and len(cache) == 3
    with pytest.raises(ValueError):
        EmbeddingCache(-1)
