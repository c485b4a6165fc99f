"""verify= on the Python loads (Note [Verified loads] in include/pinload/manifest.h): a manifest
written by pinload.write_manifest, or published whole-file sha256 digests (hashlib here)."""

import gc
import hashlib
import json

import pytest

import pinload
import pinload.torch as pt
from pl_helpers import in_use, write_sharded

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(300_000, generator=g),  # 1.2 MB: two pieces
            "w": torch.randn(64, 64, generator=g).to(torch.bfloat16),
            "b": torch.randn(17, generator=g)}


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = _tensors()
    st.save_file(tensors, str(path))
    manifest = tmp_path / "m.json"
    assert pinload.write_manifest(path, manifest) is None
    return path, tensors, manifest


def test_write_manifest_text_and_file(model):
    path, _, manifest = model
    text = pinload.write_manifest(str(path))
    assert json.loads(text) == json.loads(manifest.read_text())
    f = json.loads(text)["files"]["model.safetensors"]
    assert f["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kwargs", [{}, {"dtype": torch.float16}, {"block_size": "64K", "direct": "off"}])
@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_verified_loads(model, kwargs, device):
    path, tensors, manifest = model
    got = pt.load_file(path, device=device, verify=manifest, **kwargs)
    for name, t in tensors.items():
        want = t.to(kwargs["dtype"]) if "dtype" in kwargs else t
        assert torch.equal(got[name].cpu(), want), name
    assert pinload.LoadOptions(verify=manifest).verify == "manifest"


def test_corrupted_tensor_raises_and_returns_nothing(model):
    path, _, manifest = model
    begin = json.loads(manifest.read_text())["files"]["model.safetensors"]["tensors"]["big"]["range"][0]
    _flip(path, begin + 1_100_000)
    gc.collect()
    before = in_use()
    for load in (lambda: pt.load_file(path, verify=manifest),
                 lambda: pt.load_files([path], verify=manifest),
                 lambda: pt.safe_open(path, verify=manifest).get_tensor("w"),
                 lambda: dict(pt.iter_tensors([path], verify=manifest))):
        with pytest.raises(pinload.IntegrityError) as info:
            load()
        assert info.value.tensor == "big"
        assert info.value.file == str(path)
        assert info.value.begin == begin + 2**20 and info.value.end == begin + 300_000 * 4
    del info
    assert in_use() == before  # no block kept by the failed loads


def test_published_sha256(tmp_path):
    folder = tmp_path / "m"
    index = write_sharded(folder, _tensors(1), shards=2)
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.safetensors")}
    assert set(pt.load_files(index, verify=digests)) == set(_tensors(1))
    name = sorted(digests)[1]
    bad = dict(digests, **{name: "0" * 64})
    with pytest.raises(pinload.IntegrityError) as info:
        pt.load_files(index, verify=bad)
    assert info.value.file == str(folder / name) and info.value.tensor is None
    with pytest.raises(pinload.InvalidArgumentError, match="64 hex digits"):
        pt.load_files(index, verify={name: "xyz"})
    with pytest.raises(TypeError):
        pt.load_files(index, verify=42)
    # iter_tensors hands tensors out before a whole file could be hashed: refused, not skipped.
    with pytest.raises(pinload.InvalidArgumentError, match="whole-file sha256"):
        list(pt.iter_tensors([index], verify=digests))
