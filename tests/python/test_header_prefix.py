"""One header-prefix parser: the 8-byte length of a safetensors header is checked by the C++
parse_header_prefix everywhere, the loader, ``_core.header_length`` and the encoder's identity
(pinload.encoder.model._header) alike: one cap (100,000,000 bytes), one wording."""

import struct

import pytest

import pinload
from pinload import _core
from pinload.encoder import model as encoder_model


def _file(path, length, size):
    """A file whose prefix says `length`, `size` bytes long (sparse: nothing is written past it)."""
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", length))
        f.truncate(size)
    return path


def _load_error(path):
    with pytest.raises(pinload.InvalidFileError) as e:
        _core.read_header(str(path))  # the loader's header read
    return e.value


CASES = {
    # above the cap, below 100 MiB (the encoder's and the store's former cap): a bounded file
    "over_the_cap": (100_000_001, 8 + 100_000_001, "exceeds the limit of 100000000 bytes"),
    "zero": (0, 64, "header length is 0"),
    "past_the_end": (1000, 100, "runs past the end of the 100-byte file"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_cap_and_one_wording(tmp_path, case):
    length, size, words = CASES[case]
    path = _file(tmp_path / f"{case}.safetensors", length, size)
    loader = _load_error(path)
    assert words in str(loader)
    with open(path, "rb") as f:
        prefix = f.read(8)
    with pytest.raises(pinload.InvalidFileError) as core:
        _core.header_length(prefix, size, str(path))
    with pytest.raises(pinload.InvalidFileError) as encoder:
        encoder_model._header(path)
    assert str(core.value) == str(encoder.value) == str(loader)
    assert encoder.value.file == str(path)


def test_short_file_and_a_good_prefix(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x00")
    with pytest.raises(pinload.InvalidFileError, match="too short for the 8-byte header length"):
        encoder_model._header(short)
    good = tmp_path / "good.safetensors"
    header = b'{"__metadata__":{"a":"b"}}'
    good.write_bytes(struct.pack("<Q", len(header)) + header)
    assert _core.header_length(good.read_bytes()[:8], good.stat().st_size, str(good)) == len(header)
    assert encoder_model._header(good) == header
