"""Streaming within a budget: iter_tensors streams a checkpoint larger than the process's memory cgroup,
within a pool budget (Note [Streaming within a budget] in src/io/stream_budget.h). Before, the
load reserved every block at its start and was refused (or, without a check, OOM-killed)."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open as reference_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import pl_helpers

MiB = 1 << 20
LIMIT = 512 * MiB
SHARDS, SHARD_BYTES = 8, 96 * MiB  # 768 MiB, more than the cgroup allows


def memory_cgroup_v1():
    return pl_helpers.memory_cgroup_v1(LIMIT, "pinload-stream")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream-budget")
    rng = np.random.default_rng(13)
    weight_map = {}
    for s in range(SHARDS):
        name = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {f"model.layers.{s}.mlp.{p}_proj.weight": rng.integers(0, 256, SHARD_BYTES // 4, dtype=np.uint8)
                   for p in ("gate", "up", "down", "o")}
        save_file(tensors, str(folder / name))
        weight_map.update({t: name for t in tensors})
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    want = {}
    for name in sorted(set(weight_map.values())):
        with reference_open(str(folder / name), framework="np") as f:  # the reference reader
            for key in f.keys():
                want[key] = hashlib.sha256(f.get_tensor(key).tobytes()).hexdigest()
    return index, want


# The consumer, in the cgroup: digests each tensor and drops it before asking for the next.
CHILD = r"""
import hashlib, json, sys
import pinload
budget = int(sys.argv[2]) or None
digests = {}
for name, tensor in pinload.iter_tensors(sys.argv[1], pool_bytes=budget, threads=4):
    digests[name] = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
    del tensor
stats = pinload.pool_stats("cpu", pool_bytes=budget)
print(json.dumps({"digests": digests, "peak": stats["peak"], "peak_reserved": stats["peak_reserved"]}))
"""


def stream_in_cgroup(cg, index, budget):
    env = dict(os.environ)
    return subprocess.run(["sh", "-c", f'echo $$ > "{cg}/cgroup.procs" && exec "$0" -c "$1" "$2" "$3"',
                           sys.executable, CHILD, str(index), str(budget)],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("budget", [224 * MiB, 0], ids=["pool_bytes", "from_the_limit"])
def test_iter_tensors_streams_a_model_larger_than_the_memory_cgroup(sharded, budget):
    index, want = sharded
    assert SHARDS * SHARD_BYTES > LIMIT
    cg = memory_cgroup_v1()
    try:
        run = stream_in_cgroup(cg, index, budget)
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # -9: OOM-killed
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["digests"] == want  # every tensor, bytes equal to the reference's
        assert result["peak"] < LIMIT
        if budget:
            assert result["peak"] <= budget and result["peak_reserved"] <= budget, result
        failcnt = int((cg / "memory.failcnt").read_text())
        print(f"peak in_use {result['peak'] / MiB:.0f} MiB; cgroup max usage "
              f"{int((cg / 'memory.max_usage_in_bytes').read_text()) / MiB:.0f} MiB; failcnt {failcnt}")
    finally:
        try:
            cg.rmdir()
        except OSError:
            pass


def test_a_consumer_that_keeps_every_tensor_gets_an_error(sharded):
    """Keeping everything within a budget smaller than the model: OutOfMemoryError, not a hang."""
    import pinload

    index, want = sharded
    kept = []
    with pytest.raises(pinload.OutOfMemoryError, match="stalled"):
        for name, tensor in pinload.iter_tensors(index, pool_bytes=224 * MiB + 4096, threads=2):
            kept.append(tensor)
    assert 0 < len(kept) < len(want)
    del kept
