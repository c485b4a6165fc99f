"""pinload.ModelCache: hits return the cached tensors without reading, LRU eviction under a budget,
a rewritten file is a miss, and the "sim" device gets the same bytes. Files are written by
safetensors (an independent writer) and compared with the tensors that were saved."""

import os

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

import pinload  # noqa: E402


def _write(path, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "embed.weight": torch.randn(37, 129, generator=g).to(torch.bfloat16),
        "blocks.0.weight": torch.randn(61, 67, generator=g),
        "blocks.0.bias": torch.randint(0, 255, (5001,), generator=g, dtype=torch.uint8),
        "empty": torch.empty(0, dtype=torch.float16),
    }
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


def _expect_equal(got, want):
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].cpu(), tensor), name


@pytest.fixture
def models(tmp_path):
    out = []
    for i in range(3):
        path = tmp_path / f"m{i}.safetensors"
        out.append((path, _write(path, i)))
    return out


def _entry_bytes(path):
    probe = pinload.ModelCache("64M")
    probe.get(path)
    return probe.stats()["cached_bytes"]


def test_a_hit_returns_the_cached_tensors(models):
    cache = pinload.ModelCache("64M", block_size="4K", direct="off")
    (path, want), _, _ = models
    first = cache.get(path)
    _expect_equal(first, want)
    reserved = pinload.pool_stats()["os_reservations"]
    second = cache.get(str(path))
    _expect_equal(second, want)
    assert second["embed.weight"].data_ptr() == first["embed.weight"].data_ptr(), "a hit is zero-copy"
    assert pinload.pool_stats()["os_reservations"] == reserved
    s = cache.stats()
    assert (s["hits"], s["misses"], s["entries"]) == (1, 1, 1)
    assert path in cache and cache.contains([path])


def test_least_recently_used_is_evicted(models):
    each = _entry_bytes(models[0][0])
    cache = pinload.ModelCache(2 * each)
    (a, _), (b, _), (c, want_c) = models
    cache.get(a)
    cache.get(b)
    cache.get(a)
    _expect_equal(cache.get(c), want_c)
    assert cache.contains(a) and cache.contains(c) and not cache.contains(b)
    s = cache.stats()
    assert s["evictions"] == 1 and s["cached_bytes"] == 2 * each <= s["budget_bytes"]
    cache.budget_bytes = each
    assert cache.stats()["entries"] == 1 and cache.contains(c)
    assert cache.evict(c) and not cache.evict(c)
    cache.clear()
    assert cache.stats()["entries"] == 0


def test_many_switches_keep_the_bytes(models):
    cache = pinload.ModelCache(2 * _entry_bytes(models[0][0]))
    for i in range(20):
        path, want = models[(i * 7) % 3]
        _expect_equal(cache.get(path), want)
    s = cache.stats()
    assert s["hits"] + s["misses"] == 20


def test_a_rewritten_file_is_a_miss(tmp_path):
    path = tmp_path / "m.safetensors"
    _write(path, 1)
    cache = pinload.ModelCache("64M")
    old = cache.get(path)
    st_old = os.stat(path)
    want = _write(path, 2)
    os.utime(path, ns=(st_old.st_atime_ns, st_old.st_mtime_ns + 5_000_000_000))
    assert not cache.contains(path)
    _expect_equal(cache.get(path), want)
    assert cache.stats()["invalidations"] == 1
    assert not torch.equal(old["blocks.0.weight"], want["blocks.0.weight"]), "the old tensors keep the old bytes"


def test_sim_device_gets_the_same_bytes(models):
    cache = pinload.ModelCache("64M")
    (path, want), _, _ = models
    _expect_equal(cache.get(path, device="sim"), want)  # miss: read and copied
    _expect_equal(cache.get(path, device="sim"), want)  # hit: copied only
    _expect_equal(cache.get(path), want)
    assert cache.stats()["hits"] == 2


def test_a_model_larger_than_the_budget_is_not_cached(models):
    cache = pinload.ModelCache(1024)
    path, want = models[0]
    _expect_equal(cache.get(path), want)
    s = cache.stats()
    assert s["too_large"] == 1 and s["entries"] == 0


def test_errors(tmp_path):
    cache = pinload.ModelCache("1M")
    with pytest.raises(pinload.NotFoundError):
        cache.get(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError):
        pinload.ModelCache("lots")
    assert "ModelCache" in repr(cache)


def test_switch_pipelines_example():
    """examples/switch_pipelines.py: FLUX -> SDXL -> FLUX, the second FLUX a hit (exit status 0)."""
    import subprocess
    import sys

    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    models = os.environ.get("PINLOAD_MODELS", os.path.expanduser("~/.cache/pinload/models"))
    if not os.path.exists(os.path.join(models, "flux-dev-small", "model_index.json")):
        pytest.skip("no flux-dev-small: scripts/gen_checkpoints.py --scale small")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "examples", "switch_pipelines.py"), "--device", "sim"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "switch to FLUX  HIT" in done.stdout
