"""Checkpoints over S3 (SeaweedFS, SigV4 checked) and HTTP(S) (nginx).

Every load's digests (`pinload load --digest`) are compared with hashlib over
what the reference safetensors package reads from the same bytes on local
disk (stfiles.expected_digest); faults are injected for real by a proxy in
front of the servers (fault_proxy.py).
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

import stfiles
from conftest import BUCKET, PUBLIC_BUCKET
from fault_proxy import FaultProxy
import servers

FAST_RETRIES = {"PINLOAD_REMOTE_RETRIES": "3", "PINLOAD_REMOTE_RETRY_BASE_MS": "10"}


def run(pinload_bin, *args, env=None, timeout=120):
    full = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    full.update(env or {})
    return subprocess.run([pinload_bin, *map(str, args)], capture_output=True, text=True, env=full, timeout=timeout)


def digests(proc):
    assert proc.returncode == 0, proc
    return proc.stdout.splitlines()


def one_error(proc, url):
    assert proc.returncode == 1, proc
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pinload: error: " + url), proc
    return lines[0]


def upload_tree(weed, local_root, prefix, bucket=BUCKET):
    client = weed.client()
    for dirpath, _, files in os.walk(local_root):
        for name in files:
            path = os.path.join(dirpath, name)
            key = prefix + os.path.relpath(path, local_root)
            client.upload_file(path, bucket, key)


def big_file(path, mib, seed=7):
    rng = np.random.default_rng(seed)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": rng.integers(0, 255, size=(mib * 256, 1024), dtype=np.uint8)
               for i in range(4)}
    save_file(tensors, str(path))
    return path


# ---------------------------------------------------------------------------
# Every file shape, over S3 and over HTTP


@pytest.fixture(scope="module")
def shapes(tmp_path_factory, weed, served_root):
    """Seeded checkpoints (numpy writer and the hand-written one), uploaded to
    S3 under shapes/ and copied under nginx's root."""
    root = tmp_path_factory.mktemp("shapes")
    names = []
    for seed in range(4):
        rng = stfiles.seeded(1000 + seed)
        stfiles.write_random_numpy(root / f"np{seed}.safetensors", rng, count=rng.randrange(1, 24))
        names.append(f"np{seed}.safetensors")
        rng = stfiles.seeded(2000 + seed)
        stfiles.write_random_raw(root / f"raw{seed}.safetensors", rng, count=rng.randrange(1, 30))
        names.append(f"raw{seed}.safetensors")
    stfiles.write_raw(root / "empty.safetensors", [])
    names.append("empty.safetensors")
    upload_tree(weed, root, "shapes/")
    shutil.copytree(root, served_root / "shapes")
    return root, names


def test_every_shape_over_s3_equals_local(pinload_bin, shapes, weed):
    root, names = shapes
    for name in names:
        expected = stfiles.expected_digest(root / name)
        proc = run(pinload_bin, "load", "--digest", "--block-size", "4K", "--connections", "4",
                   f"s3://{BUCKET}/shapes/{name}", env=weed.env())
        assert digests(proc) == expected, name


def test_every_shape_over_http_equals_local(pinload_bin, shapes, nginx):
    root, names = shapes
    for name in names:
        expected = stfiles.expected_digest(root / name)
        proc = run(pinload_bin, "load", "--digest", "--block-size", "4K", f"{nginx.url}/shapes/{name}")
        assert digests(proc) == expected, name


def test_s3_folder_is_listed(pinload_bin, shapes, weed, tmp_path):
    root, _ = shapes
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(root / "np3.safetensors", folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    (folder / "sub").mkdir()
    shutil.copy(root / "np1.safetensors", folder / "sub" / "other.safetensors")  # not part of the folder
    upload_tree(weed, folder, "folder/")
    expected = digests(run(pinload_bin, "load", "--digest", folder))
    for path in (f"s3://{BUCKET}/folder/", f"s3://{BUCKET}/folder"):
        assert digests(run(pinload_bin, "load", "--digest", path, env=weed.env())) == expected, path


def test_big_file_many_chunks_over_s3_and_http(pinload_bin, tmp_path, weed, served_root, nginx):
    path = big_file(tmp_path / "big.safetensors", 2)
    weed.client().upload_file(str(path), BUCKET, "big/big.safetensors")
    shutil.copy(path, served_root / "big.safetensors")
    expected = stfiles.expected_digest(path)
    for url, env in ((f"s3://{BUCKET}/big/big.safetensors", weed.env()), (f"{nginx.url}/big.safetensors", {})):
        for connections in ("1", "16"):
            proc = run(pinload_bin, "load", "--digest", "--block-size", "256K", "--connections", connections, url,
                       env=env)
            assert digests(proc) == expected, (url, connections)


def test_dtype_conversion_over_s3_and_http(pinload_bin, tmp_path, weed, served_root, nginx):
    """A converting load over the network streams its chunks through a ring of
    staging blocks with a chunk per connection (Note [Conversion ring]): every
    tensor is the bf16 rounding (to nearest even) of the stored fp32, computed
    here with numpy, over 1 and 16 connections."""
    rng = np.random.default_rng(5)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((512, 1024), dtype=np.float32)
               for i in range(4)}
    path = tmp_path / "f32.safetensors"
    save_file(tensors, str(path))
    weed.client().upload_file(str(path), BUCKET, "f32/f32.safetensors")
    shutil.copy(path, served_root / "f32.safetensors")
    expected = []
    for name in sorted(tensors):
        bits = tensors[name].view(np.uint32)
        bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        shape = ",".join(map(str, tensors[name].shape))
        expected.append(f"{name}\tBF16\t[{shape}]\t{hashlib.sha256(bf16.tobytes()).hexdigest()}")
    assert sorted(digests(run(pinload_bin, "load", "--digest", "--dtype", "bf16", path))) == expected
    for url, env in ((f"s3://{BUCKET}/f32/f32.safetensors", weed.env()), (f"{nginx.url}/f32.safetensors", {})):
        for connections in ("1", "16"):
            proc = run(pinload_bin, "load", "--digest", "--dtype", "bf16", "--block-size", "256K",
                       "--connections", connections, url, env=env)
            assert sorted(digests(proc)) == expected, (url, connections)


# ---------------------------------------------------------------------------
# Sharded index and diffusers pipeline over S3


def test_sharded_index_over_s3_and_http(pinload_bin, tmp_path, weed, served_root, nginx):
    folder = tmp_path / "sharded"
    folder.mkdir()
    rng = np.random.default_rng(3)
    weight_map = {}
    for shard in (1, 2):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {f"model.layers.{shard}.self_attn.q_proj.weight": rng.standard_normal((64, 64)).astype(np.float16),
                   f"model.layers.{shard}.input_layernorm.weight": rng.standard_normal(64).astype(np.float32)}
        save_file(tensors, str(folder / name))
        weight_map.update({t: name for t in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text("{}")
    upload_tree(weed, folder, "sharded/")
    shutil.copytree(folder, served_root / "sharded")
    expected = digests(run(pinload_bin, "load", "--digest", folder))
    assert digests(run(pinload_bin, "load", "--digest", f"s3://{BUCKET}/sharded/", env=weed.env())) == expected
    assert digests(run(pinload_bin, "load", "--digest", f"s3://{BUCKET}/sharded/model.safetensors.index.json",
                       env=weed.env())) == expected
    assert digests(run(pinload_bin, "load", "--digest", f"{nginx.url}/sharded/model.safetensors.index.json")) == expected


def test_diffusers_pipeline_folder_over_s3(pinload_bin, tmp_path, weed):
    pipe = tmp_path / "pipe"
    rng = np.random.default_rng(5)
    (pipe / "unet").mkdir(parents=True)
    (pipe / "vae").mkdir()
    (pipe / "scheduler").mkdir()
    (pipe / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    (pipe / "scheduler" / "scheduler_config.json").write_text("{}")
    save_file({"conv_in.weight": rng.standard_normal((32, 4, 3, 3)).astype(np.float16)},
              str(pipe / "unet" / "diffusion_pytorch_model.safetensors"))
    save_file({"encoder.conv_in.weight": rng.standard_normal((16, 3, 3, 3)).astype(np.float32)},
              str(pipe / "vae" / "diffusion_pytorch_model.safetensors"))
    upload_tree(weed, pipe, "pipe/")
    expected = digests(run(pinload_bin, "load", "--digest", pipe))
    got = digests(run(pinload_bin, "load", "--digest", f"s3://{BUCKET}/pipe", env=weed.env()))
    assert got == expected
    assert any(line.startswith("unet/") for line in got)


# ---------------------------------------------------------------------------
# Credentials: wrong keys, profiles, anonymous access, TLS


def test_wrong_keys_fail_at_once_without_leaking_the_secret(pinload_bin, shapes, weed):
    secret = "wrong-secret-do-not-print-1234"
    env = weed.env(AWS_SECRET_ACCESS_KEY=secret, **FAST_RETRIES)
    start = time.monotonic()
    proc = run(pinload_bin, "load", "--digest", f"s3://{BUCKET}/shapes/np0.safetensors", env=env)
    line = one_error(proc, f"s3://{BUCKET}/shapes/np0.safetensors")
    assert "403" in line and "SignatureDoesNotMatch" in line, line
    assert secret not in proc.stderr + proc.stdout
    assert servers.SECRET_KEY not in proc.stderr
    assert time.monotonic() - start < 10


def test_profile_files_and_anonymous_bucket(pinload_bin, shapes, weed, tmp_path):
    root, _ = shapes
    expected = stfiles.expected_digest(root / "np1.safetensors")
    (tmp_path / "credentials").write_text(
        f"[default]\naws_access_key_id = nope\naws_secret_access_key = nope\n"
        f"[tests]\naws_access_key_id = {servers.ACCESS_KEY}\naws_secret_access_key = {servers.SECRET_KEY}\n")
    (tmp_path / "config").write_text(f"[profile tests]\nregion = {servers.REGION}\nendpoint_url = {weed.endpoint}\n")
    env = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_CONFIG_FILE": str(tmp_path / "config"),
           "AWS_PROFILE": "tests"}
    assert digests(run(pinload_bin, "load", "--digest", f"s3://{BUCKET}/shapes/np1.safetensors", env=env)) == expected
    # No credentials at all: anonymous, which the server allows on "public" only.
    weed.client().upload_file(str(root / "np1.safetensors"), PUBLIC_BUCKET, "np1.safetensors")
    anon = {"AWS_ENDPOINT_URL": weed.endpoint, "HOME": str(tmp_path), **FAST_RETRIES}
    assert digests(run(pinload_bin, "load", "--digest", f"s3://{PUBLIC_BUCKET}/np1.safetensors", env=anon)) == expected
    line = one_error(run(pinload_bin, "load", "--digest", f"s3://{BUCKET}/shapes/np1.safetensors", env=anon),
                     f"s3://{BUCKET}/shapes/np1.safetensors")
    assert "403" in line


def test_tls_verified_by_default(pinload_bin, shapes, tls_nginx):
    root, _ = shapes
    url = f"{tls_nginx.url}/shapes/np2.safetensors"
    expected = stfiles.expected_digest(root / "np2.safetensors")
    start = time.monotonic()
    line = one_error(run(pinload_bin, "load", "--digest", url), url)
    assert "SSL" in line or "certificate" in line, line
    assert time.monotonic() - start < 10  # not retried
    assert digests(run(pinload_bin, "load", "--digest", url, env={"AWS_CA_BUNDLE": tls_nginx.cert})) == expected
    proc = run(pinload_bin, "load", "--digest", url, env={"PINLOAD_TLS_VERIFY": "0"})
    assert digests(proc) == expected
    assert "TLS verification is OFF" in proc.stderr


def test_missing_object_and_bucket_are_not_found(pinload_bin, weed, nginx):
    # The server's own reason, as in Python (test_remote_python.py): NoSuchKey and NoSuchBucket
    # are different mistakes, and neither is "No such file or directory".
    for url, env, reason in ((f"s3://{BUCKET}/no/such.safetensors", weed.env(), "NoSuchKey"),
                             (f"s3://no-such-bucket-x/m.safetensors", weed.env(), "NoSuchBucket"),
                             (f"{nginx.url}/no/such.safetensors", {}, "HTTP 404")):
        line = one_error(run(pinload_bin, "load", "--digest", url, env={**env, **FAST_RETRIES}), url)
        assert reason in line and "No such file or directory" not in line, line


def test_weed_listens_only_on_ports_the_tests_chose(weed):
    """No SeaweedFS port is left at its default (iceberg 8181, lance 9101, ...): a second SeaweedFS
    on the machine could otherwise make the test server exit."""
    listening = servers.listening_ports(weed.proc.pid)
    assert weed.port in listening
    assert listening <= set(weed.ports.values()), sorted(listening - set(weed.ports.values()))
