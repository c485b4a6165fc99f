"""pinload.torch.load_file / load_files / iter_tensors against safetensors.torch.load_file."""

import json
import sys

import pytest
import torch
import safetensors.torch as st

import pinload
import pinload.torch as pt
from pl_helpers import (DEVICES, DTYPES, assert_same, assert_same_dict, every_dtype_tensors, in_use,
                        torch_device_of, write_raw, write_sharded)


@pytest.fixture(scope="module")
def every_dtype_file(tmp_path_factory):
    tensors = every_dtype_tensors(seed=1)
    path = tmp_path_factory.mktemp("dtypes") / "every_dtype.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt", "what": "every dtype"})
    return path, tensors


@pytest.mark.parametrize("device", DEVICES)
def test_every_dtype_matches_safetensors(every_dtype_file, device):
    path, tensors = every_dtype_file
    want = st.load_file(str(path))
    got = pt.load_file(path, device=device)
    assert_same_dict(got, want)
    assert_same_dict(got, tensors)
    for name, t in got.items():
        assert t.device == torch_device_of(device), name
        assert t.is_contiguous(), name


def test_dtype_table_covers_the_format():
    # Every dtype the C++ parser knows has an entry; those torch has map to the right torch type.
    assert set(pt.DTYPES) == set(pinload._core.dtype_names())
    expected = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                "C64": torch.complex64, "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
                "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
    for name, dtype in expected.items():
        assert pt.DTYPES[name] == dtype
    for name, attr in {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
                       "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
                       "U16": "uint16", "U32": "uint32", "U64": "uint64"}.items():
        assert pt.DTYPES[name] == getattr(torch, attr, None)
    assert pt.DTYPES["F4"] == getattr(torch, "float4_e2m1fn_x2", None)
    assert pt.DTYPES["F6_E2M3"] is None and pt.DTYPES["F6_E3M2"] is None


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch without float4_e2m1fn_x2")
def test_f4_is_torch_packed_fp4_as_the_reference(tmp_path):
    data = bytes(range(8))
    path = write_raw(tmp_path / "f4.safetensors", [("packed", "F4", [2, 8], data)])
    t = pt.load_file(path)["packed"]
    ref = st.load_file(str(path))["packed"]
    assert t.dtype == ref.dtype == torch.float4_e2m1fn_x2
    assert t.shape == ref.shape == (2, 4)  # two values a byte
    assert t.view(torch.uint8).reshape(-1).tolist() == list(data) == ref.view(torch.uint8).reshape(-1).tolist()


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch without float8_e8m0fnu")
def test_f8_e8m0_hand_written(tmp_path):
    data = bytes(range(0, 256, 17))  # 16 exponents
    path = write_raw(tmp_path / "e8m0.safetensors", [("scale", "F8_E8M0", [4, 4], data)])
    t = pt.load_file(path)["scale"]
    assert t.dtype == torch.float8_e8m0fnu and t.shape == (4, 4)
    assert t.view(torch.uint8).reshape(-1).tolist() == list(data)


@pytest.mark.parametrize("dtype,shape,nbytes", [("F6_E2M3", [4], 3), ("F6_E3M2", [4], 3)] +
                         ([("F4", [4, 2], 4)] if not hasattr(torch, "float4_e2m1fn_x2") else []))
def test_dtype_torch_lacks_raises_naming_the_tensor(tmp_path, dtype, shape, nbytes):
    path = write_raw(tmp_path / "sub_byte.safetensors",
                     [("ok", "F32", [1], b"\0\0\x80\x3f"), ("packed", dtype, shape, b"\x11" * nbytes)])
    for call in (lambda: pt.load_file(path), lambda: pinload.safe_open(path).get_tensor("packed"),
                 lambda: list(pt.iter_tensors(path))):
        with pytest.raises(pinload.InvalidFileError) as info:
            call()
        assert info.value.tensor == "packed"
        assert info.value.file == str(path)
        assert dtype in str(info.value) and "packed" in str(info.value)
    # The other tensor of the file still loads through safe_open.
    with pinload.safe_open(path) as f:
        assert f.get_tensor("ok").item() == 1.0
        assert f.get_dtype("packed") == dtype


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    tensors = every_dtype_tensors(seed=2)
    gen = torch.Generator().manual_seed(3)
    for i in range(6):  # some bigger ones, so that files span many read blocks
        tensors[f"big.{i}"] = torch.randn(257, 129, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
    folder = tmp_path_factory.mktemp("sharded") / "model"
    index = write_sharded(folder, tensors, shards=3)
    return index, tensors


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_index_folder_and_file_list(sharded, device):
    index, tensors = sharded
    want = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        want.update(st.load_file(str(index.parent / shard)))
    assert_same_dict(want, tensors)
    shards = sorted(index.parent.glob("*.safetensors"))
    for source in (index, index.parent, shards, [str(p) for p in shards]):
        got = pinload.load_files(source, device=device)
        assert_same_dict(got, want)


@pytest.mark.parametrize("options", [
    dict(threads=1, block_size=4096),
    dict(threads=3, block_size="64K", direct="off", files_in_flight=1),
    dict(threads=8, block_size="1M", direct="auto", files_in_flight=3),
])
def test_options_do_not_change_the_bytes(sharded, options):
    index, tensors = sharded
    assert_same_dict(pinload.load_files(index, **options), tensors)


@pytest.mark.skipif("sim" not in DEVICES, reason="no sim device")
@pytest.mark.parametrize("streams,chunk", [(1, "4K"), (3, 65536)])
def test_sim_streaming_mode(sharded, streams, chunk):
    index, tensors = sharded
    got = pinload.load_files(index, device="sim", block_size="64K", staging_bytes="1M", streams=streams,
                             chunk_bytes=chunk)
    assert_same_dict(got, tensors)


def test_streaming_needs_a_device(small_file):
    path, _ = small_file
    with pytest.raises(pinload.InvalidArgumentError, match="staging_bytes"):
        pt.load_file(path, staging_bytes="1M")


def test_iter_tensors_yields_every_tensor_once_as_it_arrives(sharded):
    index, tensors = sharded
    pairs = list(pinload.iter_tensors(index, block_size="4K"))
    names = [n for n, _ in pairs]
    assert sorted(names) == sorted(tensors) and len(names) == len(set(names))
    assert_same_dict(dict(pairs), tensors)
    # One reader, one file at a time: arrival order is the files' order. Direct reads would run
    # on more readers than `threads` (Note [Direct reads in flight]), so they are off here.
    serial = [n for n, _ in pinload.iter_tensors(index, threads=1, files_in_flight=1, direct="off")]
    assert serial == list(pinload.load_files(index))


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_iter_tensors_closed_early_cancels_and_frees(sharded, device):
    index, tensors = sharded
    base = pinload._core.pool_stats(device)["in_use"]
    gen = pinload.iter_tensors(index, device=device, block_size="4K")
    name, first = next(gen)
    assert torch.equal(first.cpu(), tensors[name])
    del first
    gen.close()
    del gen
    assert pinload._core.pool_stats(device)["in_use"] == base


def test_iter_tensors_starts_on_first_next(tmp_path):
    gen = pinload.iter_tensors(tmp_path / "missing.safetensors")  # nothing happens yet
    with pytest.raises(pinload.NotFoundError):
        next(gen)


def test_diffusers_pipeline_folder_prefixes_component_names(tmp_path):
    pipe = tmp_path / "pipe"
    (pipe / "unet").mkdir(parents=True)
    (pipe / "text_encoder").mkdir()
    (pipe / "model_index.json").write_text(json.dumps(
        {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
         "text_encoder": ["transformers", "CLIPTextModel"]}))
    unet = {"conv.weight": torch.randn(4, 4), "conv.bias": torch.randn(4)}
    te = {"embed.weight": torch.randn(8, 2).half()}
    st.save_file(unet, str(pipe / "unet" / "diffusion_pytorch_model.safetensors"))
    st.save_file(te, str(pipe / "text_encoder" / "model.safetensors"))
    got = pinload.load_files(pipe)
    want = {f"unet/{k}": v for k, v in unet.items()} | {f"text_encoder/{k}": v for k, v in te.items()}
    assert_same_dict(got, want)


def test_variant(tmp_path):
    st.save_file({"w": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    st.save_file({"w": torch.ones(3).half()}, str(tmp_path / "model.fp16.safetensors"))
    assert pinload.load_files(tmp_path)["w"].dtype == torch.float32
    assert pinload.load_files(tmp_path, variant="fp16")["w"].dtype == torch.float16


def test_loaded_tensors_are_writable_views_of_pool_memory(small_file):
    path, tensors = small_file
    before = in_use()
    got = pt.load_file(path)
    assert in_use() > before  # the tensors live in a pool block: no copy was made
    got["w"][0, 0] = 42.0
    assert got["w"][0, 0].item() == 42.0
    assert st.load_file(str(path))["w"][0, 0].item() == 0.0  # the file is untouched
    del got
    assert in_use() == before


def test_cuda_request_without_cuda_raises_device_error(small_file):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    path, _ = small_file
    with pytest.raises(pinload.DeviceError) as info:
        pt.load_file(path, device="cuda")
    assert isinstance(info.value, pinload.Error)
    with pytest.raises(pinload.DeviceError):
        pinload.safe_open(path, device="cuda:0")  # at open, not at the first get_tensor


def test_other_torch_devices_load_on_cpu_then_move(small_file):
    path, tensors = small_file
    got = pt.load_file(path, device="meta")
    assert all(t.device.type == "meta" for t in got.values())
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in tensors.items()}


@pytest.mark.parametrize("bad", [dict(threads=0), dict(threads=2000), dict(block_size=100),
                                 dict(block_size="2Q"), dict(direct="maybe"), dict(streams=0),
                                 dict(chunk_bytes=0), dict(files_in_flight=0)])
def test_bad_options_raise_value_error(small_file, bad):
    path, _ = small_file
    with pytest.raises(ValueError):
        pt.load_file(path, **bad)


def test_unknown_option_is_a_type_error(small_file):
    path, _ = small_file
    with pytest.raises(TypeError):
        pt.load_file(path, thread=4)


def test_progress_is_silent_off_a_terminal(small_file, capsys):
    path, tensors = small_file
    assert_same_dict(pt.load_file(path, progress=True), tensors)
    assert capsys.readouterr().err == ""


class _SlowHandle:
    """Stands in for a LoadHandle whose load takes about 1.3 s."""

    def __init__(self):
        import time
        self.start = time.monotonic()
        self.cancelled = False

    def wait(self, timeout):
        import time
        if timeout is None:
            return True
        left = self.start + 1.3 - time.monotonic()
        time.sleep(max(0.0, min(timeout, left)))
        return time.monotonic() >= self.start + 1.3

    def progress(self):
        import time
        frac = min(1.0, (time.monotonic() - self.start) / 1.3)
        return {"bytes_done": int(2e9 * frac), "bytes_total": 2_000_000_000}

    def cancel(self):
        self.cancelled = True

    def result(self):
        return "state dict"


def test_progress_bar_on_a_terminal_after_one_second(monkeypatch):
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    assert pt._wait(_SlowHandle(), progress=True) == "state dict"
    text = err.getvalue()
    # tqdm's bar, with the CLI's fields (tests/python/test_progress.py), left on screen.
    assert "pinload 100%|##############################| 2.00/2.00 GB " in text, text
    assert " GB/s [" in text and text.endswith("\n"), text
    err2 = Tty()
    monkeypatch.setattr(sys, "stderr", err2)
    pt._wait(_SlowHandle(), progress=False)
    assert err2.getvalue() == ""


def test_interrupt_cancels_the_load(monkeypatch):
    handle = _SlowHandle()
    calls = {"n": 0}
    real_wait = handle.wait

    def wait(timeout):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_wait(timeout)

    handle.wait = wait
    with pytest.raises(KeyboardInterrupt):
        pt._wait(handle, progress=False)
    assert handle.cancelled


def test_cancelled_load_raises_cancelled_error(sharded):
    index, _ = sharded
    handle = pinload._core.load_async([str(index).encode()], "cpu")
    handle.cancel()
    handle.wait(None)
    try:
        handle.result()
    except pinload.CancelledError as e:
        assert e.code == "cancelled"
    # (a load that finished before cancel() took effect returns normally)
    with pytest.raises(pinload.InvalidArgumentError, match="already taken"):
        handle.result()  # a second result() is refused
