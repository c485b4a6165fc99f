"""Typed errors: every failure is a pinload.Error subclass carrying the file (and tensor, offsets)."""

import json
import struct

import pytest
import torch
import safetensors.torch as st

import pinload
import pinload.torch as pt
from pl_helpers import write_raw


def loaders(path):
    """Every entry point that reads a file, as thunks."""
    return {
        "load_file": lambda: pt.load_file(path),
        "load_files": lambda: pinload.load_files([path]),
        "iter_tensors": lambda: list(pinload.iter_tensors(path)),
        "safe_open": lambda: pinload.safe_open(path).get_tensors(),
    }


def test_hierarchy():
    assert issubclass(pinload.Error, Exception)
    subclasses = {
        pinload.InvalidFileError: ("invalid_file", ValueError),
        pinload.NotFoundError: ("not_found", FileNotFoundError),
        pinload.IoError: ("io", OSError),
        pinload.OutOfMemoryError: ("out_of_memory", MemoryError),
        pinload.DeviceError: ("device", None),
        pinload.CancelledError: ("cancelled", None),
        pinload.InvalidArgumentError: ("invalid_argument", ValueError),
        pinload.IntegrityError: ("integrity", None),
        pinload.UnavailableError: ("unavailable", ConnectionError),
    }
    for cls, (code, extra) in subclasses.items():
        assert issubclass(cls, pinload.Error)
        assert cls.__module__ == "pinload"
        assert cls.code == code
        if extra is not None:
            assert issubclass(cls, extra)
    e = pinload.InvalidFileError("plain")
    assert (e.file, e.tensor, e.begin, e.end) == (None, None, None, None)


def test_missing_file_is_not_found_with_file_set(tmp_path):
    path = tmp_path / "absent.safetensors"
    for name, call in loaders(path).items():
        with pytest.raises(pinload.NotFoundError) as info:
            call()
        e = info.value
        assert isinstance(e, pinload.Error) and isinstance(e, FileNotFoundError), name
        assert e.file == str(path), name
        assert str(path) in str(e) and e.code == "not_found"


def test_folder_without_checkpoint_is_not_found(tmp_path):
    with pytest.raises(pinload.NotFoundError) as info:
        pinload.load_files(tmp_path)
    assert info.value.file is not None


def good_file(tmp_path):
    path = tmp_path / "good.safetensors"
    st.save_file({"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, 8)}, str(path))
    return path


def test_truncated_file(tmp_path):
    path = good_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    for name, call in loaders(path).items():
        with pytest.raises(pinload.InvalidFileError) as info:
            call()
        assert info.value.file == str(path), name
        assert isinstance(info.value, pinload.Error)


@pytest.mark.parametrize("content,what", [
    (b"", "empty"),
    (b"\x05\x00\x00", "short prefix"),
    (struct.pack("<Q", 1 << 40) + b"{}", "header length past the end"),
    (struct.pack("<Q", 8) + b"not json", "not JSON"),
    (struct.pack("<Q", 2) + b"[]", "not an object"),
])
def test_bad_header(tmp_path, content, what):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    for name, call in loaders(path).items():
        with pytest.raises(pinload.InvalidFileError) as info:
            call()
        assert info.value.file == str(path), (name, what)
        assert isinstance(info.value, ValueError)


def test_bad_tensor_entry_names_tensor_and_offsets(tmp_path):
    # "b" claims 12 bytes for a [2] F32 tensor.
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 20]}}
    text = json.dumps(header).encode()
    path = tmp_path / "bad_entry.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 20)
    with pytest.raises(pinload.InvalidFileError) as info:
        pt.load_file(path)
    e = info.value
    assert e.file == str(path) and e.tensor == "b"
    assert e.begin is not None and e.end is not None and e.begin < e.end
    assert e.message and e.message in str(e)


def test_unknown_dtype(tmp_path):
    path = write_raw(tmp_path / "unknown.safetensors", [("x", "F12", [1], b"\0\0")])
    with pytest.raises(pinload.InvalidFileError) as info:
        pinload.safe_open(path)
    assert info.value.file == str(path)


def test_bad_index(tmp_path):
    st.save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors",
                                                "ghost": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(pinload.Error) as info:
        pinload.load_files(index)
    assert info.value.file is not None
    index.write_text("{ not json")
    with pytest.raises(pinload.InvalidFileError):
        pinload.load_files(index)
    index.write_text(json.dumps({"weight_map": {"a": "missing-shard.safetensors"}}))
    with pytest.raises(pinload.NotFoundError):
        pinload.load_files(index)


def test_unknown_device(tmp_path):
    path = good_file(tmp_path)
    with pytest.raises(pinload.InvalidArgumentError):
        pinload._core.load_async([str(path).encode()], "tpu:3")
    with pytest.raises(pinload.InvalidArgumentError):  # neither pinload's device nor torch's
        pt.load_file(path, device="nonsense")


# A caller's mistake is an InvalidArgumentError (a ValueError, not an InvalidFileError) naming the
# argument, from every entry point.
@pytest.mark.parametrize("bad,named", [
    (dict(threads=0), "threads"),
    (dict(threads=2000), "threads"),
    (dict(block_size="x"), "block_size"),
    (dict(block_size=100), "block_size"),
    (dict(chunk_bytes="-1"), "chunk_bytes"),
    (dict(streams=65), "streams"),
    (dict(files_in_flight=0), "files_in_flight"),
    (dict(direct="maybe"), "direct"),
    (dict(device="cuda:abc"), "device"),
    (dict(device="cuda:-1"), "device"),
    (dict(dtype="int8"), "dtype"),
    (dict(keep_dtype="F64", dtype="bf16"), "keep_dtype"),
    (dict(keep=["w"]), "keep"),
    (dict(pool_bytes=0), "pool_bytes"),
    (dict(pool_bytes="lots"), "pool_bytes"),
])
def test_bad_arguments_are_invalid_argument_errors_naming_the_argument(tmp_path, bad, named):
    path = good_file(tmp_path)
    calls = {
        "load_file": lambda: pt.load_file(path, **bad),
        "load_files": lambda: pinload.load_files([path], **bad),
        "iter_tensors": lambda: list(pinload.iter_tensors(path, **bad)),
        "safe_open": lambda: pinload.safe_open(path, **bad).get_tensors(),
        "prefetch": lambda: pinload.prefetch(path, **bad),
    }
    if "device" not in bad:
        calls["LoadOptions"] = lambda: pinload.LoadOptions(**bad)
        calls["ModelCache"] = lambda: pinload.ModelCache("1M", **bad)
    for name, call in calls.items():
        with pytest.raises(pinload.InvalidArgumentError) as info:
            call()
        e = info.value
        assert isinstance(e, ValueError) and isinstance(e, pinload.Error), name
        assert not isinstance(e, pinload.InvalidFileError), name
        assert e.code == "invalid_argument", name
        assert named in str(e), (name, str(e))


def test_wrong_types_are_type_errors(tmp_path):
    path = good_file(tmp_path)
    for bad in (dict(threads="8"), dict(block_size=True), dict(block_size=1.5), dict(variant=3), dict(device=1.5),
                dict(unknown_option=1), dict(options="threads=8")):
        with pytest.raises(TypeError):
            pt.load_file(path, **bad)
    with pytest.raises(TypeError):  # an options object and keyword options at once
        pt.load_file(path, options=pinload.LoadOptions(threads=2), threads=3)


def test_load_options_object(tmp_path):
    path = good_file(tmp_path)
    o = pinload.LoadOptions(threads=3, block_size="64K", direct="off", chunk_bytes="1M", variant=None)
    assert (o.threads, o.block_size, o.direct, o.chunk_bytes, o.staging_bytes, o.variant) == (3, 65536, "off",
                                                                                                1 << 20, None, "")
    d = pinload.LoadOptions()  # the C++ defaults, the same for every entry point
    core = pinload._core
    assert (d.threads, d.block_size, d.files_in_flight, d.streams, d.chunk_bytes) == (
        core.DEFAULT_THREADS, core.DEFAULT_BLOCK_SIZE, core.DEFAULT_FILES_IN_FLIGHT, core.DEFAULT_STREAMS,
        core.DEFAULT_CHUNK_BYTES)
    assert pinload.LoadOptions(direct=True).direct == "on"
    expected = st.load_file(str(path))
    got = pt.load_file(path, options=o)
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert "LoadOptions(threads=3" in repr(o)
    c = pinload.LoadOptions(dtype=torch.bfloat16, keep="norm", keep_dtype="float32", pool_bytes="64M")
    assert (c.dtype, c.keep, c.keep_dtype, c.pool_bytes) == ("BF16", ["norm"], "F32", 64 << 20)
    assert (d.dtype, d.keep, d.keep_dtype, d.pool_bytes) == (None, [], None, None)


def test_one_size_parser():
    parse = pinload._core.parse_size
    assert parse("4096") == 4096 and parse("64K") == parse("64k") == parse("64KiB") == 65536
    assert parse("2M") == 2 << 20 and parse("1GiB") == 1 << 30 and parse(7) == 7
    for bad in ("", "x", "2Q", "-1", " 4K", "4 K", "1.5M", "4kib", "99999999999999999999", "17179869184G"):
        with pytest.raises(pinload.InvalidArgumentError, match="budget"):
            parse(bad, "budget")
    with pytest.raises(TypeError):
        parse(True)


def test_one_device_parser():
    for text, kind, ordinal, name in (("cpu", "cpu", None, "cpu"), ("sim", "sim", None, "sim"),
                                      ("cuda", "cuda", None, "cuda:0"), ("cuda:3", "cuda", 3, "cuda:3")):
        spec = pinload._core.parse_device_spec(text)
        assert (spec.kind, spec.ordinal, spec.name) == (kind, ordinal, name)
    for bad in ("gpu", "cuda:abc", "CPU", "cpu:0", ""):
        with pytest.raises(pinload.InvalidArgumentError, match="device"):
            pinload._core.parse_device_spec(bad)
    assert pinload.pool_stats(torch.device("cpu"))["backend"] == pinload.pool_stats("cpu")["backend"]
    with pytest.raises(pinload.InvalidArgumentError):
        pinload.pool_stats("cuda:abc")
