"""pinload trace / warm / agent (docs/trace.md) against real, unmodified consumers.

Consumers run in subprocesses: safetensors (pread and mmap backends),
transformers from_pretrained, numpy through safe_open, and cat. Templates are
read back with an independent parser (trace_helpers.read_template). Tests that
need fanotify pre-content events skip, saying why, where they are unavailable;
the fallback modes are tested everywhere.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import trace_helpers as th

SHM = Path("/dev/shm")


def make_checkpoint(path, tensors=8, elements=256 * 1024, seed=0):
    rng = np.random.default_rng(seed)
    data = {f"layer.{i}.weight": rng.standard_normal(elements + 37 * i, dtype=np.float32) for i in range(tensors)}
    save_file(data, str(path))
    return path


def tensor_ranges(path, names=None):
    """(offset, length) of each named tensor's bytes, from the header itself."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = []
    for k, v in header.items():
        if k == "__metadata__" or (names is not None and k not in names):
            continue
        b, e = v["data_offsets"]
        out.append((8 + n + b, e - b))
    return out


@pytest.fixture(scope="module")
def pre_content(pinload_bin, tmp_path_factory):
    """"" where pre-content events work under pytest's tmp folder, else the reason."""
    d = tmp_path_factory.mktemp("probe")
    (d / "f").write_bytes(b"x" * 100)
    r = subprocess.run([pinload_bin, "trace", "--template", str(d / "t"), "--root", str(d), "--", "cat", str(d / "f")],
                       capture_output=True, text=True, timeout=60)
    if "not tracing" in r.stderr:
        return r.stderr.strip()
    return ""


@pytest.fixture
def need_events(pre_content):
    if pre_content:
        pytest.skip(f"fanotify pre-content events unavailable: {pre_content}")


def trace(run_pinload, out, root, cmd, timeout=120):
    r = run_pinload("trace", "--template", out, "--root", root, "--", *cmd, timeout=timeout)
    assert r.returncode == 0, r
    return th.read_template(out)


# ---- trace ----

def test_trace_pread_backend_holds_exactly_the_ranges_read(tmp_path, run_pinload, need_events):
    ckpt = make_checkpoint(tmp_path / "model.safetensors")
    names = ["layer.1.weight", "layer.4.weight", "layer.6.weight"]
    script = ("import sys; from safetensors import safe_open\n"
              "with safe_open(sys.argv[1], framework='numpy', backend='pread') as f:\n"
              f"    [f.get_tensor(k) for k in {names!r}]\n")
    t = trace(run_pinload, tmp_path / "t.pltemplate", tmp_path, [sys.executable, "-c", script, str(ckpt)])
    size = ckpt.stat().st_size
    pages, total = th.template_pages(t, ckpt)
    # safetensors maps the file to read its header, then preads the tensors:
    # the reads are exactly the named tensors' pages, the mapping apart.
    assert pages == th.pages_of(tensor_ranges(ckpt, names), size)
    assert th.template_pages(t, ckpt, "page-cache-mapped")[0] == set(range((size + th.PAGE - 1) // th.PAGE))
    # Each byte once, no more than the pages the reads touch.
    assert total == sum(min(th.PAGE, size - p * th.PAGE) for p in pages)
    f = t["files"][0]
    st = ckpt.stat()
    assert f == (str(ckpt), st.st_size, st.st_mtime_ns, st.st_ino, th.pinload_device(st))


@pytest.mark.parametrize("cache", ["cached", "evicted"])
def test_trace_load_file_pread_and_mmap(tmp_path, run_pinload, need_events, cache):
    # One process (one torch import): load_file with backend="pread" on one
    # copy, with the default mmap on another. Evicted, the mapping's pages
    # arrive by page faults (events outside any system call, where a kernel
    # reports them): still the mapping's.
    pread, mmap = make_checkpoint(tmp_path / "pread.safetensors"), make_checkpoint(tmp_path / "mmap.safetensors")
    if cache == "evicted":
        th.drop_file_cache(pread, mmap)
    script = ("import sys, safetensors.torch as st\n"
              "a = st.load_file(sys.argv[1], backend='pread'); b = st.load_file(sys.argv[2]); print(len(a) + len(b))\n")
    t = trace(run_pinload, tmp_path / "t.pltemplate", tmp_path, [sys.executable, "-c", script, str(pread), str(mmap)],
              timeout=300)
    for ckpt in (pread, mmap):
        size = ckpt.stat().st_size
        read, _ = th.template_pages(t, ckpt)
        mapped, _ = th.template_pages(t, ckpt, "page-cache-mapped")
        assert mapped == set(range((size + th.PAGE - 1) // th.PAGE)), ckpt
        assert read == (th.pages_of(tensor_ranges(ckpt), size) if ckpt == pread else set()), ckpt


def test_trace_cat_ignores_files_outside_the_root_and_symlinks_out(tmp_path, run_pinload, need_events):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    inside_file = root / "a.bin"
    inside_file.write_bytes(os.urandom(3 * th.PAGE + 5))
    out_file = outside / "b.bin"
    out_file.write_bytes(os.urandom(th.PAGE))
    (root / "link.bin").symlink_to(out_file)
    (root / "linkdir").symlink_to(outside, target_is_directory=True)
    t = trace(run_pinload, tmp_path / "t.pltemplate", root,
              ["sh", "-c", f"cat {inside_file} {out_file} {root}/link.bin {root}/linkdir/b.bin > /dev/null"])
    assert [f[0] for f in t["files"]] == [str(inside_file)]
    assert t["dests"]["page-cache"] == [(0, 0, 3 * th.PAGE + 5)]


def test_trace_names_the_reader_of_every_range(tmp_path, run_pinload, need_events):
    # Three real processes, one after another: dd reads the head of a.bin, cat
    # then all of it (only its tail is new, and it abuts dd's range), python
    # preads a range of b.bin. Each range is one reader's, never merged across
    # readers; pids are what the shell saw.
    root = tmp_path / "root"
    root.mkdir()
    a, b = root / "a.bin", root / "b.bin"
    a.write_bytes(os.urandom((1 << 20) + 5))
    b.write_bytes(os.urandom(2 << 20))
    pread = f"import os; fd = os.open({str(b)!r}, os.O_RDONLY); assert len(os.pread(fd, 262144, 1 << 20)) == 262144"
    script = (f"dd if={a} of=/dev/null bs=65536 count=2 2>/dev/null & echo dd $!; wait; "
              f"cat {a} > /dev/null & echo cat $!; wait; "
              f"{shlex.quote(sys.executable)} -c {shlex.quote(pread)} & echo python $!; wait")
    out = tmp_path / "t.pltemplate"
    r = run_pinload("trace", "--template", out, "--root", root, "--", "sh", "-c", script, timeout=120)
    assert r.returncode == 0, r
    pids = {name: int(pid) for name, pid in (line.split() for line in r.stdout.split("\n") if line)}
    t = th.read_template(out)
    assert t["version"] == 2
    files = [f[0] for f in t["files"]]
    assert files == [str(a), str(b)]
    size_a = a.stat().st_size
    reads = list(zip(t["dests"]["page-cache"], t["read_by"]["page-cache"]))
    who = [(f, off, n, t["readers"][i][0], t["readers"][i][1]) for (f, off, n), i in reads]
    # dd's second 64 KiB block may be served without a second event (it can arrive with the first
    # read's folio); cat then reads on from wherever dd's recorded range ends.
    dd_bytes = who[0][2] if who and who[0][2] in (65536, 131072) else 131072
    assert who == [(0, 0, dd_bytes, pids["dd"], "dd"),
                   (0, dd_bytes, size_a - dd_bytes, pids["cat"], "cat"),
                   (1, 1 << 20, 262144, pids["python"], Path(sys.executable).name[:15])], (who, t["readers"], r.stderr)
    exes = {pid: exe for pid, _, exe in t["readers"]}
    assert Path(exes[pids["dd"]]).name == "dd" and Path(exes[pids["cat"]]).name == "cat"
    assert Path(exes[pids["python"]]).resolve() == Path(sys.executable).resolve()
    # pinload inspect prints the same template, readers included.
    j = json.loads(run_pinload("inspect", "--json", out).stdout)
    assert [(x["pid"], x["comm"], x["exe"]) for x in j["readers"]] == [tuple(x) for x in t["readers"]]
    assert [(x["file"], x["offset"], x["length"], x["reader"]) for x in j["destinations"]["page-cache"]] == \
        [(f, off, n, i) for (f, off, n), i in reads]
    text = run_pinload("inspect", out).stdout
    assert f"pid {pids['cat']}\tcat" in text and "reader 1" in text, text
    assert f"reader pid {pids['dd']} dd" in r.stderr, r


def test_trace_transformers_from_pretrained(tmp_path, run_pinload, need_events):
    pytest.importorskip("transformers")
    # A tiny Llama saved as save_pretrained would (config.json, model.safetensors),
    # random weights, written without importing torch.
    model_dir = tmp_path / "tiny-llama"
    model_dir.mkdir()
    v, h, i, layers = 128, 64, 128, 2
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (h // 2, h),
                   p + "self_attn.v_proj.weight": (h // 2, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    rng = np.random.default_rng(0)
    save_file({k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}, str(model_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": v, "hidden_size": h,
        "intermediate_size": i, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "torch_dtype": "float32", "tie_word_embeddings": False}))
    load = ("import sys, transformers as tf\n"
            "m = tf.LlamaForCausalLM.from_pretrained(sys.argv[1]); print(sum(p.numel() for p in m.parameters()))\n")
    t = trace(run_pinload, tmp_path / "t.pltemplate", model_dir, [sys.executable, "-c", load, str(model_dir)], timeout=300)
    paths = {Path(f[0]).name for f in t["files"]}
    assert "model.safetensors" in paths and "config.json" in paths
    ckpt = model_dir / "model.safetensors"
    pages = th.template_pages(t, ckpt)[0] | th.template_pages(t, ckpt, "page-cache-mapped")[0]
    assert th.pages_of(tensor_ranges(ckpt), ckpt.stat().st_size) <= pages


def test_trace_runs_untraced_where_events_are_unavailable(run_pinload):
    d = SHM / f"pinload-trace-{os.getpid()}"
    d.mkdir(exist_ok=True)
    try:
        (d / "f").write_bytes(b"abc")
        r = run_pinload("trace", "--template", d / "t", "--root", d, "--", "sh", "-c", f"cat {d}/f; exit 7")
        assert r.returncode == 7 and r.stdout == "abc", r
        assert "not tracing" in r.stderr and not (d / "t").exists(), r
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


# ---- warm ----

def warm_json(r):
    assert r.returncode == 0, r
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_warm_reads_each_byte_once(tmp_path, run_pinload, need_events):
    ckpt = make_checkpoint(tmp_path / "model.safetensors", tensors=12)
    script = ("import sys; from safetensors import safe_open\n"
              "with safe_open(sys.argv[1], framework='numpy', backend='pread') as f:\n"
              "    [f.get_tensor(k) for k in sorted(f.keys())[::2]]\n")
    t = trace(run_pinload, tmp_path / "t.pltemplate", tmp_path, [sys.executable, "-c", script, str(ckpt)])
    recorded = sum(n for _, _, n in t["dests"]["page-cache"])
    assert recorded < 0.7 * ckpt.stat().st_size
    th.drop_file_cache(ckpt)
    w = warm_json(run_pinload("warm", "--template", tmp_path / "t.pltemplate", "--threads", "4"))
    assert w["source"] == "traced template" and w["planned_bytes"] == recorded == w["warmed_bytes"], w
    # The replay's /proc/self/io: what came from storage is the template's bytes, each once
    # (six ranges; two pages allowed for the warmer's own code faulted in meanwhile).
    assert recorded - 4 * th.PAGE <= w["proc_io"]["read_bytes"] <= recorded + 2 * th.PAGE, w


def test_warm_refuses_a_stale_template(tmp_path, run_pinload, need_events):
    ckpt = make_checkpoint(tmp_path / "model.safetensors")
    trace(run_pinload, tmp_path / "t.pltemplate", tmp_path, ["cat", str(ckpt)])
    # Replaced by a file of the same bytes: another inode, so another identity.
    (tmp_path / "new").write_bytes(ckpt.read_bytes())
    os.replace(tmp_path / "new", ckpt)
    th.drop_file_cache(ckpt)
    r = run_pinload("warm", "--template", tmp_path / "t.pltemplate")
    assert r.returncode == 3 and "stale" in r.stderr and r.stdout == "", r


def test_warm_fallbacks_plain_paths_and_pinload_templates(tmp_path, run_pinload):
    a = make_checkpoint(tmp_path / "a.safetensors", tensors=2)
    b = make_checkpoint(tmp_path / "b.safetensors", tensors=3, seed=1)
    th.drop_file_cache(a, b)
    w = warm_json(run_pinload("warm", tmp_path))
    assert w["source"] == "plain paths" and w["warmed_bytes"] == a.stat().st_size + b.stat().st_size, w
    assert "no consumer" in w["mode"]
    # A template as pinload's own loads record it ("host" reads): warmed in its order.
    th.write_template(tmp_path / "host.pltemplate", [str(a)], {"host": [(0, 4096, 8192), (0, 0, 4096)]})
    th.drop_file_cache(a)
    w = warm_json(run_pinload("warm", "--template", tmp_path / "host.pltemplate"))
    assert w["source"] == "pinload-recorded template" and w["warmed_bytes"] == 12288, w
    assert w["proc_io"]["read_bytes"] <= 12288, w


def test_warm_without_events_says_so_and_still_warms(run_pinload):
    d = SHM / f"pinload-warm-{os.getpid()}"
    d.mkdir(exist_ok=True)
    try:
        f = d / "m.bin"
        f.write_bytes(os.urandom(1 << 20))
        th.write_template(d / "t.pltemplate", [str(f)], {"page-cache": [(0, 0, 1 << 20)]})
        w = warm_json(run_pinload("warm", "--template", d / "t.pltemplate", "--follow", os.getpid(),
                                  "--budget", "256K"))
        assert w["mode"].startswith("no fanotify") and "not support" in w["mode"], w
        assert w["warmed_bytes"] == 256 << 10, w  # blind: only the budget's worth
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def run_consumer_with_warmer(pinload_bin, ckpt, template, cgroup=None, budget=None, kill_warmer_after=None,
                             backend="pread", init=0.8):
    consumer_cmd = th.consumer_cmd(ckpt, init=init, backend=backend)
    if cgroup:
        consumer_cmd = cgroup.enter_cmd(consumer_cmd)
    consumer = subprocess.Popen(consumer_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    warm_cmd = [pinload_bin, "warm", "--template", str(template), "--follow", str(consumer.pid), "--threads", "4"]
    if budget:
        warm_cmd += ["--budget", str(budget)]
    if cgroup:
        warm_cmd = cgroup.enter_cmd(warm_cmd)
    warmer = subprocess.Popen(warm_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill_warmer_after is not None:
        time.sleep(kill_warmer_after)
        warmer.kill()
    out, err = consumer.communicate(timeout=300)
    wout, werr = warmer.communicate(timeout=60)
    assert consumer.returncode == 0, err
    digest, consumer_read, load_s = out.split()
    w = json.loads(wout.strip().splitlines()[-1]) if kill_warmer_after is None else None
    return digest, int(consumer_read), w, werr


def test_warm_follows_a_consumer_in_a_memory_cgroup_smaller_than_the_model(tmp_path, pinload_bin, run_pinload,
                                                                          need_events):
    why = th.cgroup_available()
    if why:
        pytest.skip(why)
    ckpt = make_checkpoint(tmp_path / "model.safetensors", tensors=24, elements=1 << 20)  # ~100 MB
    size = ckpt.stat().st_size
    trace(run_pinload, tmp_path / "t.pltemplate", tmp_path, th.consumer_cmd(ckpt))
    expected = th.reference_digest(ckpt)
    # The consumer alone (python + numpy + one tensor) needs ~40 MB; the page
    # cache gets what is left: well under the model.
    cg = th.MemoryCgroup(64 << 20)
    try:
        th.drop_file_cache(ckpt)
        digest, consumer_read, w, werr = run_consumer_with_warmer(pinload_bin, ckpt, tmp_path / "t.pltemplate", cg,
                                                                  budget=8 << 20)
    finally:
        cg.close()
    assert digest == expected
    assert w["mode"].startswith("follow"), w
    assert w["dropped_bytes"] > 0, (w, werr)
    total = consumer_read + w["proc_io"]["read_bytes"]
    # The 1.1x target is measured by bench/trace_bench.py; on a loaded 2-core VM the
    # consumer's own readahead can add a few MB here, so the test guards against thrashing
    # (native under this cgroup rereads far more) with a little slack.
    assert total <= 1.15 * size, (total, size, w, werr)


def test_killing_the_warmer_mid_run_leaves_the_consumer_correct(tmp_path, pinload_bin, run_pinload, need_events):
    ckpt = make_checkpoint(tmp_path / "model.safetensors", tensors=16)
    trace(run_pinload, tmp_path / "t.pltemplate", tmp_path, th.consumer_cmd(ckpt))
    th.drop_file_cache(ckpt)
    digest, _, _, _ = run_consumer_with_warmer(pinload_bin, ckpt, tmp_path / "t.pltemplate", budget=4 << 20,
                                               kill_warmer_after=1.0, init=0.5)
    assert digest == th.reference_digest(ckpt)


# ---- agent ----

def wait_for(pred, timeout=20):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def start_agent(pinload_bin, root, templates):
    agent = subprocess.Popen([pinload_bin, "agent", "--root", str(root), "--templates", str(templates),
                              "--idle-ms", "3000"], stderr=subprocess.PIPE, text=True)
    line = agent.stderr.readline()
    assert "watching" in line, line
    return agent


def test_agent_records_then_replays_then_invalidates(tmp_path, pinload_bin, need_events):
    root, templates = tmp_path / "models", tmp_path / "templates"
    root.mkdir()
    ckpt = make_checkpoint(root / "model.safetensors")
    expected = th.reference_digest(ckpt)
    agent = start_agent(pinload_bin, root, templates)
    try:
        out = subprocess.run(th.consumer_cmd(ckpt), capture_output=True, text=True, check=True, timeout=120).stdout
        assert out.split()[0] == expected
        assert wait_for(lambda: list(templates.glob("*.pltemplate")))
        t = th.read_template(next(templates.glob("*.pltemplate")))
        pages, _ = th.template_pages(t, ckpt)
        assert pages == th.pages_of(tensor_ranges(ckpt), ckpt.stat().st_size)  # the consumer preads every tensor
        th.drop_file_cache(ckpt)
        out = subprocess.run(th.consumer_cmd(ckpt, init=0.3), capture_output=True, text=True, check=True,
                             timeout=120).stdout
        assert out.split()[0] == expected
        # The file replaced: the agent drops the stale template and records afresh.
        (root / "new").write_bytes(ckpt.read_bytes())
        os.replace(root / "new", ckpt)
        subprocess.run(th.consumer_cmd(ckpt), capture_output=True, check=True, timeout=120)
        time.sleep(1.5)
    finally:
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=30)
    assert agent.returncode == 0, err
    assert "replaying" in err and "stale" in err, err
    t = th.read_template(next(templates.glob("*.pltemplate")))
    assert t["files"][0][3] == ckpt.stat().st_ino, err  # recorded afresh, with the new identity


def test_a_crashed_agent_never_blocks_or_fails_a_consumer(tmp_path, pinload_bin, need_events):
    root = tmp_path / "models"
    root.mkdir()
    ckpt = make_checkpoint(root / "model.safetensors")
    agent = start_agent(pinload_bin, root, tmp_path / "templates")
    try:
        agent.send_signal(signal.SIGSTOP)  # events now pend, unanswered
        consumer = subprocess.Popen(th.consumer_cmd(ckpt), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.5)
        assert consumer.poll() is None  # blocked on its first read: the agent was really in the way
        agent.kill()  # crashed with events pending: the kernel allows them
        out, err = consumer.communicate(timeout=60)
    finally:
        agent.kill()
        agent.wait()
    assert consumer.returncode == 0, err
    assert out.split()[0] == th.reference_digest(ckpt)


def test_trace_takes_the_documented_forms_without_root(tmp_path, run_pinload):
    """`trace --template T -- CMD` (no --root) was a usage error: "The following arguments were
    not expected". The command's exit status is trace's whether or not events are available."""
    forms = [["--template", tmp_path / "a.pltemplate", "--", "sh", "-c", "exit 7"],
             ["--template", tmp_path / "b.pltemplate", "sh", "-c", "exit 7"],
             ["--template", tmp_path / "c.pltemplate", "--root", tmp_path, "--", "sh", "-c", "exit 7"],
             # A "--" of the command's own stays the command's.
             ["--template", tmp_path / "d.pltemplate", "--", "sh", "-c", 'exit $(($# + 5))', "sh", "--", "x"]]
    for args in forms:
        r = run_pinload("trace", *args)
        assert r.returncode == 7, r
    r = run_pinload("trace", "--template", tmp_path / "e.pltemplate", "--")
    assert r.returncode == 2 and "no command to trace" in r.stderr, r


def test_warm_refuses_what_it_cannot_warm(tmp_path, run_pinload):
    """`warm http://…` printed "skipped" and exited 0, as did a local path that cannot be opened."""
    for path in ("http://127.0.0.1:9/m.safetensors", "s3://bucket/m.safetensors"):
        r = run_pinload("warm", path)
        assert r.returncode == 1 and r.stderr.startswith(f"pinload: error: {path}: a remote object"), r
    missing = tmp_path / "missing.safetensors"
    r = run_pinload("warm", missing)
    assert r.returncode == 1 and r.stderr.startswith(f"pinload: error: {missing}: cannot open"), r
