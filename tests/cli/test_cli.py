"""The pinload CLI against independent writers and readers.

Files come from Python's safetensors package (numpy dtypes) and from the
hand-written writer in stfiles.py (every dtype); expected digests come from
hashlib over what safetensors.safe_open reads, or over raw file slices.
"""

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import stfiles
from stfiles import raw_bytes


def assert_ok(run):
    assert run.returncode == 0, run
    return run


def assert_one_error_line(run, path):
    """Exit code 1 and exactly one stderr line: 'pinload: error: <path>: ...'."""
    assert run.returncode == 1, run
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run
    assert run.stderr.endswith("\n"), run
    assert re.fullmatch(r"pinload: error: " + re.escape(str(path)) + r": .+", lines[0]), run
    return lines[0]


def digest_lines(run):
    assert_ok(run)
    return run.stdout.splitlines()


# ---------------------------------------------------------------------------
# load --digest on seeded random checkpoints


@pytest.mark.parametrize("seed", range(12))
def test_digest_of_numpy_checkpoint(tmp_path, run_pinload, seed):
    rng = stfiles.seeded(1000 + seed)
    path = tmp_path / f"np{seed}.safetensors"
    stfiles.write_random_numpy(path, rng, count=rng.randrange(1, 24))
    expected = stfiles.expected_digest(path)
    assert digest_lines(run_pinload("load", "--digest", path)) == expected


@pytest.mark.parametrize("seed", range(12))
def test_digest_of_hand_written_checkpoint(tmp_path, run_pinload, seed):
    rng = stfiles.seeded(2000 + seed)
    path = tmp_path / f"raw{seed}.safetensors"
    stfiles.write_random_raw(path, rng, count=rng.randrange(1, 30))
    expected = stfiles.expected_digest(path)
    assert digest_lines(run_pinload("load", "--digest", path)) == expected


def test_digest_with_small_blocks_and_one_thread(tmp_path, run_pinload):
    rng = stfiles.seeded(7)
    path = tmp_path / "big.safetensors"
    tensors = [(f"t{i}", "F32", [257, 33], rng.randbytes(257 * 33 * 4)) for i in range(6)]
    tensors.insert(3, ("odd", "U8", [3], b"xyz"))  # every later tensor is unaligned
    stfiles.write_raw(path, tensors)
    expected = stfiles.expected_digest(path)
    for args in (["--threads", "1", "--block-size", "4K"], ["--threads", "7", "--block-size", "8K", "--direct", "off"]):
        assert digest_lines(run_pinload("load", "--digest", *args, path)) == expected, args


def test_digest_of_every_dtype(tmp_path, run_pinload):
    path = tmp_path / "dtypes.safetensors"
    tensors = []
    for i, dtype in enumerate(stfiles.ALL_DTYPES):
        shape = [2, 4]
        payload = bytes((i * 31 + k) % 256 for k in range(stfiles.nbytes(dtype, shape)))
        tensors.append((dtype.lower(), dtype, shape, payload))
    tensors.append(("scalar", "F64", [], b"\x00" * 7 + b"\x40"))
    tensors.append(("empty", "BF16", [0, 4], b""))
    stfiles.write_raw(path, tensors, metadata={"k": "v"})
    lines = digest_lines(run_pinload("load", "--digest", path))
    assert lines == stfiles.expected_digest(path)
    by_name = {line.split("\t")[0]: line.split("\t") for line in lines}
    assert by_name["scalar"][2] == "[]"
    assert by_name["empty"][3] == hashlib.sha256(b"").hexdigest()
    assert by_name["f4"][1:3] == ["F4", "[2,4]"]


def test_digest_of_reference_file_with_shared_zero_size_offsets(tmp_path, run_pinload):
    path = tmp_path / "zeros.safetensors"
    save_file({"a": np.zeros((0,), np.float32), "b": np.arange(3, dtype=np.int16), "c": np.zeros((2, 0), np.uint8),
               "d": np.array(True)}, str(path))
    assert digest_lines(run_pinload("load", "--digest", path)) == stfiles.expected_digest(path)


# ---------------------------------------------------------------------------
# inspect --json against the Python-parsed header


def expected_inspect_file(path, header, n, prefix=""):
    tensors = []
    for name in stfiles.file_order(header):
        info = header[name]
        begin, end = info["data_offsets"]
        tensors.append({"name": prefix + name, "dtype": info["dtype"], "shape": info["shape"], "bytes": end - begin,
                        "data_offsets": [begin, end], "file_offsets": [8 + n + begin, 8 + n + end]})
    return {"path": str(path), "file_bytes": path.stat().st_size, "header_bytes": n,
            "metadata": header.get("__metadata__") or {}, "tensors": tensors}


@pytest.mark.parametrize("seed", range(8))
def test_inspect_json_agrees_with_python(tmp_path, run_pinload, seed):
    rng = stfiles.seeded(3000 + seed)
    path = tmp_path / f"m{seed}.safetensors"
    if seed % 2:
        stfiles.write_random_numpy(path, rng, count=rng.randrange(0, 20))
    else:
        stfiles.write_random_raw(path, rng, count=rng.randrange(0, 20))
    header, n = stfiles.read_header(path)
    out = json.loads(assert_ok(run_pinload("inspect", "--json", path)).stdout)
    want = expected_inspect_file(path, header, n)
    assert out["files"] == [want]
    assert out["index_files"] == []
    assert out["total_tensors"] == len(want["tensors"])
    assert out["total_bytes"] == path.stat().st_size - 8 - n
    # And against the reference reader's view of the same file.
    with safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(t["name"] for t in want["tensors"])
        for t in out["files"][0]["tensors"]:
            sl = f.get_slice(t["name"])
            assert sl.get_shape() == t["shape"]
            assert sl.get_dtype() == t["dtype"]
        assert (f.metadata() or {}) == out["files"][0]["metadata"]


def test_inspect_text_output(tmp_path, run_pinload):
    path = tmp_path / "t.safetensors"
    stfiles.write_raw(path, [("w", "F32", [2, 3], bytes(24)), ("s", "BF16", [], b"\x80\x3f")],
                      metadata={"format": "pt"})
    _, n = stfiles.read_header(path)
    out = assert_ok(run_pinload("inspect", path)).stdout
    assert f"{path}: 2 tensors, 0.000 GB of data, header {n} bytes" in out
    assert f"  w\tF32\t[2,3]\t24 B\t[{8 + n}, {8 + n + 24})" in out
    assert f"  s\tBF16\t[]\t2 B\t[{8 + n + 24}, {8 + n + 26})" in out
    assert "  metadata format = pt" in out
    assert out.rstrip().endswith("total: 2 tensors, 0.000 GB in 1 file(s)")


# ---------------------------------------------------------------------------
# Bad files: exit code 1 and one stderr line naming the file


def entry(dtype="U8", shape="[2]", offsets="[0,2]", extra=""):
    return f'{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}{extra}}}'


def hdr(members):
    return ("{" + ",".join(f'"{k}":{v}' for k, v in members) + "}").encode()


U8X2 = ("a", entry())

# (name, file bytes, whether the reference rejects it too)
BAD_FILES = [
    ("short", b"\x01\x00\x00", True),
    ("empty", b"", True),
    ("length_zero", raw_bytes(b"", b"abcd"), True),
    ("length_over_limit", raw_bytes(b"{}", length=100_000_001), True),
    ("length_past_end", raw_bytes(b"{}", length=64), True),
    ("bom", raw_bytes(b"\xef\xbb\xbf{}"), True),
    ("invalid_utf8", raw_bytes(b'{"\xff":{}}'), True),
    ("not_json", raw_bytes(b"hello"), True),
    ("top_level_array", raw_bytes(b"[]"), True),
    ("nul_after_object", raw_bytes(b"{}\x00junk"), True),
    ("control_char", raw_bytes(b'{"a\x01":{}}'), True),
    ("number_overflow", raw_bytes(hdr([("a", entry(shape="[0]", offsets="[0,0]", extra=',"x":1e999'))])), True),
    ("unknown_dtype", raw_bytes(hdr([("a", entry(dtype="Q4"))]), b"ab"), True),
    ("shape_negative", raw_bytes(hdr([("a", entry(shape="[-2]"))]), b"ab"), True),
    ("shape_float", raw_bytes(hdr([("a", entry(shape="[2.0]"))]), b"ab"), True),
    ("shape_string", raw_bytes(hdr([("a", entry(shape='["2"]'))]), b"ab"), True),
    ("shape_nested", raw_bytes(hdr([("a", entry(shape="[[2]]"))]), b"ab"), True),
    ("offsets_one", raw_bytes(hdr([("a", entry(offsets="[2]"))]), b"ab"), True),
    ("offsets_three", raw_bytes(hdr([("a", entry(offsets="[0,2,2]"))]), b"ab"), True),
    ("offsets_negative", raw_bytes(hdr([("a", entry(offsets="[-1,1]"))]), b"ab"), True),
    ("missing_dtype", raw_bytes(b'{"a":{"shape":[2],"data_offsets":[0,2]}}', b"ab"), True),
    ("missing_shape", raw_bytes(b'{"a":{"dtype":"U8","data_offsets":[0,2]}}', b"ab"), True),
    ("missing_offsets", raw_bytes(b'{"a":{"dtype":"U8","shape":[2]}}', b"ab"), True),
    ("size_overflow", raw_bytes(hdr([("a", entry(shape="[4294967296,4294967296]", offsets="[0,0]"))])), True),
    ("size_mismatch", raw_bytes(hdr([("a", entry(offsets="[0,3]"))]), b"abc"), True),
    ("f4_odd", raw_bytes(hdr([("a", entry(dtype="F4", shape="[3]"))]), b"ab"), True),
    ("f6_two", raw_bytes(hdr([("a", entry(dtype="F6_E2M3", shape="[2]"))]), b"ab"), True),
    ("end_before_begin", raw_bytes(hdr([("a", entry(shape="[0]", offsets="[2,0]"))]), b"ab"), True),
    ("hole_at_start", raw_bytes(hdr([("a", entry(offsets="[1,3]"))]), b"abc"), True),
    ("hole_between", raw_bytes(hdr([U8X2, ("b", entry(offsets="[3,5]"))]), b"abcde"), True),
    ("overlap", raw_bytes(hdr([U8X2, ("b", entry(offsets="[1,3]"))]), b"abc"), True),
    ("alias", raw_bytes(hdr([U8X2, ("b", entry())]), b"ab"), True),
    ("trailing_bytes", raw_bytes(hdr([U8X2]), b"abc"), True),
    ("short_data", raw_bytes(hdr([U8X2]), b"a"), True),
    ("metadata_string", raw_bytes(hdr([("__metadata__", '"x"'), U8X2]), b"ab"), True),
    ("metadata_value_number", raw_bytes(hdr([("__metadata__", '{"k":1}'), U8X2]), b"ab"), True),
    ("duplicate_field", raw_bytes(hdr([("a", entry().replace('"dtype"', '"dtype":"U8","dtype"'))]), b"ab"), True),
    ("deep_nesting", raw_bytes(b"[" * 100_000 + b"]" * 100_000), True),
    # pinload is deliberately stricter than the reference here (docs/fuzzing.md):
    # duplicate keys (the reference keeps the last one), serde's map form of a
    # dtype, and nesting deeper than 16 levels.
    ("duplicate_tensor", raw_bytes(hdr([U8X2, U8X2]), b"ab"), False),
    ("duplicate_metadata_key", raw_bytes(hdr([("__metadata__", '{"k":"v","k":"w"}'), U8X2]), b"ab"), False),
    ("dtype_map_form", raw_bytes(hdr([("a", entry().replace('"U8"', '{"U8":null}'))]), b"ab"), False),
    ("nesting_20_in_extra_field", raw_bytes(hdr([("a", entry(extra=',"x":' + "[" * 20 + "]" * 20))]), b"ab"), False),
]


@pytest.mark.parametrize("name,data,reference_rejects", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_file_is_one_error_line(tmp_path, run_pinload, name, data, reference_rejects):
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(data)
    assert stfiles.reference_accepts(path)[0] != reference_rejects
    for command in (["inspect"], ["inspect", "--json"], ["load", "--digest"]):
        run = run_pinload(*command, path)
        assert run.stdout == "", run
        assert_one_error_line(run, path)


def test_error_line_escapes_control_bytes(tmp_path, run_pinload):
    path = tmp_path / "ctl.safetensors"
    path.write_bytes(raw_bytes(hdr([("a\\u001b[31m\\n", entry(dtype="Q4"))]), b"ab"))
    line = assert_one_error_line(run_pinload("inspect", path), path)
    assert "\x1b" not in line and "\\x1b" in line


def test_missing_file_is_one_error_line(tmp_path, run_pinload):
    path = tmp_path / "nope.safetensors"
    assert_one_error_line(run_pinload("inspect", path), path)
    assert_one_error_line(run_pinload("load", path), path)


def assert_usage_error(run, message, command="load"):
    """Exit code 2: 'pinload: error: <message>', then the command's usage line."""
    assert run.returncode == 2, run
    assert run.stdout == "", run
    lines = run.stderr.splitlines()
    assert lines[0] == f"pinload: error: {message}", run
    usage = "pinload" + (f" {command}" if command else "")
    assert lines[1].startswith(f"Usage: {usage} [OPTIONS]"), run
    assert lines[2] == f"Run '{usage} --help' for more.", run


def test_usage_error_exits_2(run_pinload):
    assert_usage_error(run_pinload("frobnicate"), "unknown command 'frobnicate'", command="")
    assert_usage_error(run_pinload(), "A subcommand is required", command="")


def test_numa_node_option(tmp_path, run_pinload):
    rng = stfiles.seeded(11)
    path = tmp_path / "numa.safetensors"
    stfiles.write_random_raw(path, rng, count=12)
    expected = stfiles.expected_digest(path)
    for args in (["--numa-node", "auto"], ["--numa-node", "none"], ["--numa-node", "0"], ["--numa-node=0"],
                 ["--numa-node", "auto", "--device", "sim"]):
        assert digest_lines(run_pinload("load", "--digest", *args, path)) == expected, args
    for bad in ("x", "-1", "1.5", "", "4096"):
        assert_usage_error(run_pinload("load", "--numa-node", bad, path),
                           f"--numa-node: takes auto, none or a node number 0..4095, not '{bad}'")
    run = run_pinload("load", "--numa-node", "4095", path)  # no machine has it
    assert run.returncode == 1, run
    assert run.stderr.startswith("pinload: error: NUMA node 4095 does not exist; this machine has node(s) "), run


# ---------------------------------------------------------------------------
# The command line itself: help, version, --opt=value, values out of range


@pytest.mark.parametrize("args", [["--help"], ["-h"]])
def test_help(run_pinload, args):
    run = assert_ok(run_pinload(*args))
    assert run.stdout.startswith("pinload: inspect, load and convert safetensors checkpoints"), run
    assert "Usage: pinload [OPTIONS] SUBCOMMAND" in run.stdout
    for command in ("inspect", "load"):
        assert re.search(rf"^  {command} +\S", run.stdout, re.M), run
    assert run.stderr == ""


@pytest.mark.parametrize("command", ["inspect", "load"])
def test_subcommand_help(run_pinload, command):
    for flag in ("--help", "-h"):
        run = assert_ok(run_pinload(command, flag))
        assert f"Usage: pinload {command} [OPTIONS] PATH..." in run.stdout, run
        assert "--variant V" in run.stdout
    run = assert_ok(run_pinload("load", "--help"))
    for option in ("--threads 1..1024=8", "--block-size SIZE 4K..1G=8M", "--direct auto|on|off=auto", "--digest",
                   "-v,--verbose", "--device DEVICE=cpu", "--staging-bytes SIZE"):
        assert option in run.stdout, (option, run)


def test_version_matches_cmake(run_pinload):
    cmake = (Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    version = re.search(r"project\(pinload VERSION ([0-9.]+)", cmake).group(1)
    run = assert_ok(run_pinload("--version"))
    assert run.stdout == f"pinload {version}\n", run


def test_options_take_equals_form(tmp_path, run_pinload):
    rng = stfiles.seeded(12)
    path = tmp_path / "eq.safetensors"
    stfiles.write_random_raw(path, rng, count=9)
    expected = stfiles.expected_digest(path)
    for args in (["--threads=3", "--block-size=8K", "--direct=off", "--cached-read=pread"],
                 ["--threads", "3", "--block-size", "8K", "--direct", "off", "--cached-read", "map"],
                 ["--page-cache=keep"], ["--page-cache", "bypass"],
                 ["--block-size=1M", "--device=sim", "--streams=3", "--chunk-size=4K"]):
        assert digest_lines(run_pinload("load", "--digest", *args, path)) == expected, args


# (arguments, the error message after "pinload: error: ")
BAD_VALUES = [
    (["--threads", "1K"], "--threads: takes an integer 1..1024, not '1K'"),
    (["--threads=0"], "--threads: takes an integer 1..1024, not '0'"),
    (["--threads=1025"], "--threads: takes an integer 1..1024, not '1025'"),
    (["--threads=-1"], "--threads: takes an integer 1..1024, not '-1'"),
    (["--threads=2.0"], "--threads: takes an integer 1..1024, not '2.0'"),
    (["--block-size=3K"], "--block-size: '3K' is 3072 bytes; it must be 4K..1G"),
    (["--block-size=2G"], "--block-size: '2G' is 2147483648 bytes; it must be 4K..1G"),
    (["--block-size=lots"], "--block-size: not a size: 'lots' (bytes, or a number with K, M or G)"),
    (["--streams=65"], "--streams: takes an integer 1..64, not '65'"),
    (["--chunk-size=0"], "--chunk-size: '0' is 0 bytes; it must be 1..1T"),
    (["--direct=maybe"], "--direct: takes auto|on|off, not 'maybe'"),
    (["--cached-read=mmap"], "--cached-read: takes auto|map|pread, not 'mmap'"),
    (["--page-cache=on"], "--page-cache: takes auto|keep|bypass, not 'on'"),
    (["--staging-bytes=64M"], "--staging-bytes needs --device"),
    (["--threads"], "--threads: 1 required 1..1024 missing"),
    (["--frobnicate"], "The following argument was not expected: --frobnicate"),
]


@pytest.mark.parametrize("args,message", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_option_value_is_a_usage_error(tmp_path, run_pinload, args, message):
    path = tmp_path / "ok.safetensors"
    stfiles.write_raw(path, [("a", "U8", [2], b"ab")])
    if args == ["--threads"]:
        run = run_pinload("load", path, *args)  # a trailing option with its value missing
    else:
        run = run_pinload("load", *args, path)
    assert_usage_error(run, message)


def test_missing_path_is_a_usage_error(run_pinload):
    assert_usage_error(run_pinload("load"), "PATH is required")
    assert_usage_error(run_pinload("inspect", "--json"), "PATH is required", command="inspect")


def test_load_prints_one_summary_line(tmp_path, run_pinload):
    path = tmp_path / "s.safetensors"
    stfiles.write_raw(path, [("a", "F32", [256], bytes(1024)), ("b", "U8", [3], b"xyz")])
    run = assert_ok(run_pinload("load", path))
    assert run.stdout == ""
    assert re.fullmatch(re.escape(str(path)) + r": 2 tensors, 0\.000 GB in \d+\.\d{3} s = \d+\.\d{2} GB/s\n",
                        run.stderr), run
    run = assert_ok(run_pinload("load", "-q", path))
    assert run.stdout == "" and run.stderr == "", run
    run = assert_ok(run_pinload("load", "-v", path))
    lines = run.stderr.splitlines()
    assert lines[0].startswith(f"{path}: 2 tensors, "), run
    # The file is in the page cache after its writing: read (mapped or not), or handed out as a
    # zero-copy mapping (Note [Zero-copy loads]).
    assert re.fullmatch(r"  files: (0 direct, 1 buffered \(\d of them mapped\), 0 zero-copy|"
                        r"1 direct, 0 buffered \(0 of them mapped\), 0 zero-copy|"
                        r"0 direct, 0 buffered \(0 of them mapped\), 1 zero-copy), 0 from the store",
                        lines[1]), run
    assert re.match(r"  pool\[host\]: reserved \d+\.\d{3} GB, in use ", lines[2]), run


def write_cold_file(path):
    stfiles.write_raw(path, [("w", "U8", [1 << 20], bytes(1 << 20))])
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("value", ["debug", "DEBUG", "Debug", "pinload=debug", " debug "])
def test_log_level_debug_in_any_case(tmp_path, run_pinload, value):
    path = tmp_path / "cold.safetensors"
    write_cold_file(path)
    run = assert_ok(run_pinload("load", "--direct=on", path, env={"PINLOAD_LOG_LEVEL": value}))
    assert f"[pinload debug] {path}: direct on, reading with O_DIRECT\n" in run.stderr, run
    # The decision of a default (auto) load, cold or already cached, is shown too.
    run = assert_ok(run_pinload("load", path, env={"PINLOAD_LOG_LEVEL": value}))
    assert re.search(rf"\[pinload debug\] {re.escape(str(path))}: \d+% in page cache(, "
                     r"(under 50%, reading with O_DIRECT|reading buffered)|: mapped, read in to stay cached)",
                     run.stderr), run


@pytest.mark.parametrize("value", ["warn", "WARN", "Warning", "error", "off", "OFF", "info"])
def test_log_level_known_without_debug(tmp_path, run_pinload, value):
    path = tmp_path / "cold.safetensors"
    write_cold_file(path)
    run = assert_ok(run_pinload("load", "-q", path, env={"PINLOAD_LOG_LEVEL": value}))
    assert run.stderr == "", run


@pytest.mark.parametrize("value", ["bogus", "verbose", "pinload=loud"])
def test_log_level_unknown_is_reported(tmp_path, run_pinload, value):
    path = tmp_path / "t.safetensors"
    stfiles.write_raw(path, [("a", "U8", [2], b"ab")])
    run = assert_ok(run_pinload("load", "-q", path, env={"PINLOAD_LOG_LEVEL": value}))
    bad = value.split("=")[-1]
    assert run.stderr == (f"[pinload warning] PINLOAD_LOG_LEVEL={value}: '{bad}' is not a log level "
                          "(trace, debug, info, warn, error, critical, off); logging at warning\n"), run


# ---------------------------------------------------------------------------
# Sharded checkpoints and diffusers folders through the CLI


def write_sharded(folder, rng, prefix="model", variant=""):
    """Two shards and their index, as transformers names them."""
    folder.mkdir(parents=True, exist_ok=True)
    v = f".{variant}" if variant else ""
    shards = {
        f"{prefix}{v}-00001-of-00002.safetensors": {"embed.weight": rng.standard_normal((8, 4)).astype(np.float32),
                                                    "layers.0.w": rng.standard_normal((4, 4)).astype(np.float16)},
        f"{prefix}{v}-00002-of-00002.safetensors": {"layers.1.w": np.arange(6, dtype=np.int64).reshape(2, 3),
                                                    "lm_head.bias": np.zeros((0,), np.float32)},
    }
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        weight_map.update({t: shard for t in tensors})
    index_name = f"{prefix}.safetensors.index{v}.json"
    (folder / index_name).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return folder / index_name, [folder / s for s in sorted(shards)]


def test_sharded_index_through_cli(tmp_path, run_pinload):
    index, shards = write_sharded(tmp_path / "m", np.random.default_rng(1))
    expected = [line for s in shards for line in stfiles.expected_digest(s)]
    for target in (index, tmp_path / "m"):
        out = json.loads(assert_ok(run_pinload("inspect", "--json", target)).stdout)
        assert [f["path"] for f in out["files"]] == [str(s) for s in shards]
        assert out["index_files"] == [str(index)]
        assert out["total_tensors"] == 4
        assert digest_lines(run_pinload("load", "--digest", target)) == expected


def test_sharded_index_that_disagrees(tmp_path, run_pinload):
    index, shards = write_sharded(tmp_path / "m", np.random.default_rng(2))
    doc = json.loads(index.read_text())
    doc["weight_map"]["layers.1.w"] = shards[0].name
    index.write_text(json.dumps(doc))
    line = assert_one_error_line(run_pinload("inspect", tmp_path / "m"), index)
    assert "layers.1.w" in line
    doc["weight_map"]["layers.1.w"] = shards[1].name
    doc["weight_map"]["ghost"] = shards[1].name
    index.write_text(json.dumps(doc))
    assert "ghost" in assert_one_error_line(run_pinload("load", index), index)


def test_sharded_index_with_missing_shard(tmp_path, run_pinload):
    index, shards = write_sharded(tmp_path / "m", np.random.default_rng(3))
    shards[1].unlink()
    assert_one_error_line(run_pinload("inspect", index), shards[1])


def write_pipeline(root, rng):
    """A diffusers pipeline: model_index.json, weighted components, a tokenizer."""
    root.mkdir()
    (root / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    (root / "unet").mkdir()
    save_file({"conv_in.weight": rng.standard_normal((4, 4, 3, 3)).astype(np.float32),
               "w": np.ones((2,), np.float32)}, str(root / "unet" / "diffusion_pytorch_model.safetensors"))
    save_file({"conv_in.weight": rng.standard_normal((4, 4, 3, 3)).astype(np.float16),
               "w": np.ones((2,), np.float16)}, str(root / "unet" / "diffusion_pytorch_model.fp16.safetensors"))
    (root / "text_encoder").mkdir()
    save_file({"w": np.arange(5, dtype=np.int32)}, str(root / "text_encoder" / "model.safetensors"))
    save_file({"w": np.arange(5, dtype=np.int16)}, str(root / "text_encoder" / "model.fp16.safetensors"))
    write_sharded(root / "text_encoder_2", rng)
    write_sharded(root / "text_encoder_2", rng, variant="fp16")
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "vocab.json").write_text("{}")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text("{}")


def pipeline_files(root, variant=""):
    v = f".{variant}" if variant else ""
    return [("text_encoder/", root / "text_encoder" / f"model{v}.safetensors"),
            ("text_encoder_2/", root / "text_encoder_2" / f"model{v}-00001-of-00002.safetensors"),
            ("text_encoder_2/", root / "text_encoder_2" / f"model{v}-00002-of-00002.safetensors"),
            ("unet/", root / "unet" / f"diffusion_pytorch_model{v}.safetensors")]


@pytest.mark.parametrize("variant", ["", "fp16"])
def test_diffusers_pipeline_through_cli(tmp_path, run_pinload, variant):
    root = tmp_path / "pipe"
    write_pipeline(root, np.random.default_rng(4))
    args = ["--variant", variant] if variant else []
    files = pipeline_files(root, variant)
    out = json.loads(assert_ok(run_pinload("inspect", "--json", *args, root)).stdout)
    assert [f["path"] for f in out["files"]] == [str(p) for _, p in files]
    names = [t["name"] for f in out["files"] for t in f["tensors"]]
    assert all(any(n.startswith(prefix) for prefix, _ in files) for n in names)
    assert "unet/w" in names and "text_encoder/w" in names
    expected = [line for prefix, p in files for line in stfiles.expected_digest(p, prefix)]
    assert digest_lines(run_pinload("load", "--digest", *args, root)) == expected


def test_diffusers_variant_missing(tmp_path, run_pinload):
    root = tmp_path / "pipe"
    write_pipeline(root, np.random.default_rng(5))
    line = assert_one_error_line(run_pinload("inspect", "--variant", "bf16", root), root / "text_encoder")
    assert "bf16" in line


def test_only_variant_and_none_requested(tmp_path, run_pinload):
    folder = tmp_path / "unet"
    folder.mkdir()
    save_file({"w": np.ones(2, np.float16)}, str(folder / "diffusion_pytorch_model.fp16.safetensors"))
    line = assert_one_error_line(run_pinload("load", folder), folder)
    assert "fp16" in line


def test_duplicate_across_paths(tmp_path, run_pinload):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"x": np.ones(1, np.uint8), "y": np.ones(1, np.uint8)}, str(a))
    save_file({"y": np.ones(1, np.uint8)}, str(b))
    line = assert_one_error_line(run_pinload("inspect", a, b), b)
    assert "'y'" in line


@pytest.mark.parametrize("command", [[], ["inspect"], ["load"], ["convert"], ["trace"], ["warm"], ["agent"],
                                     ["manifest"], ["store"], ["store", "serve"], ["store", "status"],
                                     ["store", "warm"], ["store", "evict"]],
                         ids=lambda c: " ".join(c) if c else "pinload")
def test_every_help_is_short(run_pinload, command):
    """Every --help fits a 100-column terminal, one line an option, and a screen or so."""
    run = assert_ok(run_pinload(*command, "--help"))
    lines = run.stdout.splitlines()
    long = [line for line in lines if len(line) > 100]
    assert not long, long
    assert len(lines) <= 42, run


def test_readme_synopsis_is_complete(run_pinload):
    """Every subcommand and every option of each (but --help) is in the README's synopsis."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("## The `pinload` command", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    top = assert_ok(run_pinload("--help")).stdout
    commands = re.findall(r"^  (\w+) {2,}\S", top.split("Subcommands:", 1)[1], re.M)
    assert {"inspect", "load", "convert", "trace", "warm", "agent"} <= set(commands)
    for command in commands:
        assert re.search(rf"^pinload {command} ", block, re.M), command
        # CLI11's "Options:", or argparse's "options:" (encoder hands its arguments to Python)
        text = re.split(r"^[Oo]ptions:", assert_ok(run_pinload(command, "--help")).stdout, maxsplit=1, flags=re.M)[1]
        # each option's spellings: "-v,--verbose" is there as either
        options = [m.split(",") for m in re.findall(r"^  ((?:-\w,)?--[a-z][a-z0-9-]*)", text, re.M) if m != "-h,--help"]
        line = "\n".join(re.findall(rf"^pinload {command} .*(?:\n {{13}}.*)*", block, re.M))
        missing = sorted(o[-1] for o in options
                         if not any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", line) for n in o))
        assert not missing, (command, missing)
