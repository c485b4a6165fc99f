"""The vLLM model-loader plugin (pinload.vllm) against vLLM's own plugin loading and iterator.

Needs vLLM importable (scripts/setup-vllm.sh: vllm --no-deps in a venv over the system torch);
skips with the reason otherwise. vLLM's CUDA wheel builds no model on a CPU-only machine, so the
model-level comparison (every parameter against the default loader's) is in scripts/gpu-check.sh.
"""

from __future__ import annotations

import logging
import os
import sys
import tomllib

import pytest
import torch

try:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
except Exception as e:  # noqa: BLE001 - any import failure means: no vLLM here
    pytest.skip(f"vLLM cannot be imported here ({type(e).__name__}: {e}); run scripts/setup-vllm.sh and use "
                f"its venv", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _files(folder):
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


@pytest.fixture(scope="module")
def plugin_on_path(tmp_path_factory):
    """pinload's entry points as an installed distribution would declare them (from pyproject.toml),
    on sys.path, so that vLLM's plugin loading finds them through importlib.metadata."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"]
    site = tmp_path_factory.mktemp("site")
    info = site / "pinload-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pinload\nVersion: 0.0.0\n")
    lines = []
    for group, entries in eps.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    sys.path.insert(0, str(site))
    yield
    sys.path.remove(str(site))


def test_entry_point_is_found_by_vllms_plugin_loading(plugin_on_path):
    from vllm.plugins import load_general_plugins, load_plugins_by_group

    assert "pinload" in load_plugins_by_group("vllm.general_plugins")
    load_general_plugins()
    loader = get_model_loader(LoadConfig(load_format="pinload"))
    import pinload.vllm

    assert type(loader) is pinload.vllm.PinloadModelLoader
    pinload.vllm.register()  # vLLM may call it again, in every process: harmless
    assert type(get_model_loader(LoadConfig(load_format="pinload"))) is pinload.vllm.PinloadModelLoader


def _same(a, b):
    assert set(a) == set(b)
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), name


def test_iterator_yields_what_vllms_safetensors_iterator_yields(llama_dir):
    from pinload.vllm import pinload_weights_iterator

    files = _files(llama_dir)
    theirs = {n: t.clone() for n, t in safetensors_weights_iterator(files, False)}
    ours = {}
    for name, tensor in pinload_weights_iterator(files, False, threads=2):
        assert name not in ours
        ours[name] = tensor
    _same(ours, theirs)


def test_loader_feeds_load_weights_through_the_default_loaders_plumbing(llama_dir):
    import pinload.vllm  # noqa: F401 - registers the format

    loader = get_model_loader(LoadConfig(load_format="pinload",
                                         model_loader_extra_config={"threads": 2, "block_size": "1M"}))
    assert loader.pinload_options == {"threads": 2, "block_size": "1M"}
    source = DefaultModelLoader.Source(llama_dir, None, prefix="p.")
    ours = dict(loader._get_weights_iterator(source))
    theirs = {"p." + n: t for n, t in safetensors_weights_iterator(_files(llama_dir), False)}
    _same(ours, theirs)


def test_extra_config(llama_dir, caplog):
    import pinload.vllm

    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        get_model_loader(LoadConfig(load_format="pinload", model_loader_extra_config={"bogus": 1}))
    with pytest.raises(ValueError, match="threads"):
        get_model_loader(LoadConfig(load_format="pinload", model_loader_extra_config={"threads": 0}))
    with pytest.raises(ValueError, match="connections must be 1..1024"):
        get_model_loader(LoadConfig(load_format="pinload", model_loader_extra_config={"connections": 0}))
    with caplog.at_level(logging.WARNING, logger="pinload.vllm"):
        loader = get_model_loader(LoadConfig(load_format="pinload",
                                             model_loader_extra_config={"connections": 8, "dtype": "float32",
                                                                        "enable_weights_track": False}))
    assert caplog.text == ""  # connections is honoured now, not ignored
    assert loader.pinload_options == {"connections": 8, "dtype": torch.float32}
    files = _files(llama_dir)
    for _name, tensor in pinload.vllm.pinload_weights_iterator(files, False, **loader.pinload_options):
        assert tensor.dtype == torch.float32
    cached = dict(pinload.vllm.pinload_weights_iterator(files, False, cache="256M"))
    _same(cached, dict(safetensors_weights_iterator(files, False)))


def test_non_safetensors_checkpoint_falls_back_with_a_warning(tmp_path, caplog):
    import pinload.vllm  # noqa: F401

    torch.save({"w": torch.ones(3)}, tmp_path / "pytorch_model.bin")
    loader = get_model_loader(LoadConfig(load_format="pinload"))
    with caplog.at_level(logging.WARNING, logger="pinload.vllm"):
        got = dict(loader._get_weights_iterator(DefaultModelLoader.Source(str(tmp_path), None)))
    assert "falling back" in caplog.text
    assert torch.equal(got["w"], torch.ones(3))


@pytest.fixture(scope="module")
def served_llama(llama_dir):
    """The Llama checkpoint behind nginx on loopback (tests/remote/servers.py), and a fault proxy in
    front of it that counts the connections in flight (HeldRequests: each request held 20 ms)."""
    from urllib.parse import urlparse

    sys.path.insert(0, os.path.join(ROOT, "tests", "remote"))
    import servers
    from fault_proxy import FaultProxy, HeldRequests

    try:
        nginx = servers.Nginx(os.path.dirname(llama_dir))
    except servers.ServerUnavailable as e:
        pytest.skip(f"nginx cannot start: {e}")
    held = HeldRequests(0.02)
    proxy = FaultProxy(urlparse(nginx.url).port, held)
    yield held, f"{proxy.url}/{os.path.basename(llama_dir)}"
    proxy.stop()
    nginx.cleanup()


def test_loader_reads_a_model_over_http_with_its_connections(llama_dir, served_llama, monkeypatch):
    # The model path is the index's URL: vLLM's own resolution (a Hugging Face download) is skipped
    # and pinload reads the shards over HTTP, through `connections` connections.
    import pinload.vllm  # noqa: F401

    monkeypatch.delenv("PINLOAD_CONNECTIONS", raising=False)
    held, base = served_llama
    url = base + "/model.safetensors.index.json"
    loader = get_model_loader(LoadConfig(load_format="pinload",
                                         model_loader_extra_config={"connections": 3, "block_size": "1M"}))
    assert loader._prepare_weights(url, None, None, True, None) == (url, [url], True, None)
    held.max_active = 0
    ours = dict(loader._get_weights_iterator(DefaultModelLoader.Source(url, None, prefix="m.")))
    theirs = {"m." + n: t for n, t in safetensors_weights_iterator(_files(llama_dir), False)}
    _same(ours, theirs)
    assert held.max_active == 3
    # vLLM's download_model goes through _prepare_weights too: nothing to download.
    loader.download_model(type("ModelConfig", (), {"model": url, "revision": None})())


def test_budget_streams_host_and_device_loads(llama_dir, served_llama, caplog):
    import pinload
    import pinload.vllm

    files = _files(llama_dir)
    theirs = dict(safetensors_weights_iterator(files, False))
    with pytest.raises(ValueError, match="budget and cache"):
        get_model_loader(LoadConfig(load_format="pinload", model_loader_extra_config={"budget": "4M", "cache": "1G"}))
    with pytest.raises(ValueError, match="not a size"):
        get_model_loader(LoadConfig(load_format="pinload", model_loader_extra_config={"budget": "lots"}))
    loader = get_model_loader(LoadConfig(load_format="pinload", model_loader_extra_config={"budget": "16M"}))
    assert loader.pinload_options == {"budget": 16 << 20}
    # Host, local: batches of budget / 4 (iter_sharded with one rank), so the whole model (31 MB)
    # is never in pinload memory at once; each tensor yielded is dropped at once, as vLLM does.
    base = pinload.pool_stats("cpu")["in_use"]
    peak = 0
    ours = {}
    for name, tensor in pinload.vllm.pinload_weights_iterator(files, False, budget=16 << 20):
        ours[name] = tensor.clone()
        del tensor
        peak = max(peak, pinload.pool_stats("cpu")["in_use"] - base)
    _same(ours, theirs)
    total = sum(t.numel() * t.element_size() for t in theirs.values())
    largest = max(t.numel() * t.element_size() for t in theirs.values())
    # About two batches of budget / 4 (the largest tensor, 4 MiB, is one batch), pool rounding included.
    assert 2 * largest < 16 << 20
    assert 0 < peak <= 16 << 20 < total, (peak, largest, total)
    # A device load: the budget is the staging budget of a streaming load ("sim": the CPU stand-in).
    ours = dict(pinload.vllm.pinload_weights_iterator(files, False, device="sim", budget=4 << 20))
    _same({n: t.cpu() for n, t in ours.items()}, theirs)
    # Host, remote: shard by shard within the pool budget when it holds the largest shard (15 MiB)...
    _proxy, base = served_llama
    index = base + "/model.safetensors.index.json"
    ours = {}
    for name, tensor in pinload.vllm.pinload_weights_iterator([index], False, budget=24 << 20, connections=2):
        ours[name] = tensor.clone()
        del tensor
    _same(ours, theirs)
    peak = pinload.pool_stats("cpu", pool_bytes=24 << 20)["peak"]
    assert 0 < peak <= 24 << 20 < total, (peak, total)
    # ... and where it holds none, it says so and loads without it.
    with caplog.at_level(logging.WARNING, logger="pinload.vllm"):
        ours = dict(pinload.vllm.pinload_weights_iterator([index], False, budget=8 << 20, connections=2))
    assert "holds no whole shard" in caplog.text
    _same(ours, theirs)
