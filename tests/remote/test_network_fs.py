"""A checkpoint on a FUSE mount (bindfs over a local folder) is detected as a
network filesystem (Note [Network filesystems]) and read buffered by one
reader per connection; its digests equal the reference reader's."""

import shutil
import subprocess

import pytest

import stfiles
from test_remote_load import digests, run


@pytest.fixture
def fuse_mount(tmp_path):
    if shutil.which("bindfs") is None:
        pytest.skip("bindfs not installed (apt-get install bindfs)")
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    proc = subprocess.run(["bindfs", str(src), str(mnt)], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"bindfs cannot mount here: {proc.stderr.strip()}")
    yield src, mnt
    if subprocess.run(["fusermount", "-u", str(mnt)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_fuse_mount_is_read_buffered_with_many_readers(pinload_bin, fuse_mount):
    src, mnt = fuse_mount
    rng = stfiles.seeded(77)
    stfiles.write_random_numpy(src / "m.safetensors", rng, count=12)
    expected = stfiles.expected_digest(src / "m.safetensors")
    proc = run(pinload_bin, "load", "--digest", "--block-size", "4K", "--connections", "6", mnt / "m.safetensors",
               env={"PINLOAD_LOG_LEVEL": "debug"})
    assert digests(proc) == expected
    assert "on a network filesystem (f_type 0x65735546)" in proc.stderr, proc.stderr
