#!/usr/bin/env python3
"""The node store (docs/store.md) against its peers: every load in a fresh worker process.

    sudo bench/store_bench.py                         # the 7.8 GB set (fresh_bench's), 2 GB x 8 holders
    sudo bench/store_bench.py --scale 0.25 --memory-gb 0.5      # a small run (~5 min)

A `pinload store serve` daemon (budget: 2.5 x the set) runs beside the workers; "pinload + store" is
pinload with PINLOAD_STORE set to its socket. Cases (each system in turn, rotated every round):
  restart  the article's second request: one page-cache drop (`echo 3 > drop_caches`), then two fresh
           workers in a row. Every peer runs the same two starts; the store is emptied (store evict)
           before pinload + store's first start, so its first start fills it from the disk.
  device   the same for loads to the `sim` stand-in device: pinload + store's restart (store ->
           device) against pinload from the page cache (filled by a read beforehand) and cold (disk).
  elastic  MAIO's cycle: model A (the set's UNet-like file), then B (its T5-like shard), then A again,
           each in a fresh worker, after one drop; with the store (budget holds both) and without.
  memory   --holders (8) processes loading the same --memory-gb file and holding it: the node's
           memory in use (MemTotal - MemAvailable) and Shmem, beside 8 pinload processes with pools
           of their own (zero_copy="off": 8 copies).
  convert  converted entries (Note [Converted store entries]): an FP8 file (`pinload convert` of 24
           finite fp16 matrices of 4096 x 12288: 1.2 GB) loaded as bf16 by a fresh `pinload load --dtype bf16` worker: converting
           it itself (its file in the page cache, read beforehand), then with the store: the daemon's
           conversion (the entry evicted first), and a fresh worker once the store holds the bf16
           entry. Seconds per worker; the store's and the local load's digests are compared once.
  s3       the set uploaded to a SeaweedFS S3 server on this machine (tests/remote/servers.py): a
           fresh worker loading it from S3 directly (pinload), then with the
           store: the daemon's first fetch, and a fresh worker once the store holds it. The
           server's files stay in the page cache (no drop), so S3 rows measure the server's path.
Limits measured in the same run: fio's direct read and a fresh pool's first touch (pinload-bench),
the set's files. Output: --out JSON (default bench/results/store.<scale>.json) and a markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import fresh_bench as fb  # noqa: E402
from peers import checkpoint, harness  # noqa: E402

PEERS = ["pinload", "safetensors mmap", "safetensors pread", "fastsafetensors", "runai-model-streamer"]
STORE = "pinload + store"


class Daemon:
    def __init__(self, binary: str, folder: str, budget: int, env: dict | None = None) -> None:
        self.binary, self.socket = binary, os.path.join(folder, "store.sock")
        ready = os.path.join(folder, "store.ready")
        if os.path.exists(ready):
            os.unlink(ready)
        self.log = open(os.path.join(folder, "store.log"), "a")
        self.proc = subprocess.Popen([binary, "store", "serve", "--socket", self.socket, "--budget", str(budget),
                                      "--ready-file", ready], stderr=self.log, stdout=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the store daemon did not start")
            time.sleep(0.05)

    def status(self) -> dict:
        r = subprocess.run([self.binary, "store", "status", "--socket", self.socket, "--json"], capture_output=True,
                           text=True, check=True)
        return json.loads(r.stdout)

    def evict(self) -> None:
        subprocess.run([self.binary, "store", "evict", "--socket", self.socket], capture_output=True, check=True)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


def meminfo() -> dict:
    with open("/proc/meminfo") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}


def node_used() -> int:
    m = meminfo()
    return m["MemTotal"] - m["MemAvailable"]


HOLDER = """
import sys, torch, pinload
sd = pinload.load_files([sys.argv[1]], **eval(sys.argv[2])) if sys.argv[1] != "-" else {}
sum(int(t.view(-1)[:: 4096 // max(t.element_size(), 1)].float().sum() != 0) for t in sd.values() if t.numel())
print("ready", flush=True)
sys.stdin.read()
"""


def memory_case(path: str, holders: int, env: dict, store_socket: str | None) -> dict:
    """`holders` processes holding `path`: the node's memory in use once all are ready, less what
    as many holders of nothing (their interpreters) take."""
    empty = holding("-", holders, env, None)
    loaded = holding(path, holders, env, store_socket)
    size = os.path.getsize(path)
    used = loaded["node_used_bytes"] - empty["node_used_bytes"]
    return {"holders": holders, "set_bytes": size, "node_used_bytes": used, "processes_bytes": empty["node_used_bytes"],
            "shmem_bytes": loaded["shmem_bytes"], "x_set": used / size}


def holding(path: str, holders: int, env: dict, store_socket: str | None) -> dict:
    """The node's memory in use (and Shmem) while `holders` processes hold `path` ("-": nothing)."""
    options = {"store": store_socket} if store_socket else {"zero_copy": "off"}
    subprocess.run(["sync"])
    time.sleep(1)
    before, shmem_before = node_used(), meminfo()["Shmem"]
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, path, repr(options)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(holders)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a holder failed")
        time.sleep(1)
        used, shmem = node_used() - before, meminfo()["Shmem"] - shmem_before
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(60)
    return {"node_used_bytes": used, "shmem_bytes": shmem}



SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_enabled() -> str:
    """The bracketed word of transparent_hugepage/shmem_enabled ("never", "advise", ...)."""
    with open(SHMEM_ENABLED) as f:
        return f.read().split("[")[1].split("]")[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="the set's bytes, times 7.8 GB")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cases", default="restart,device,elastic,memory,s3,convert")
    ap.add_argument("--memory-gb", type=float, default=2.0, help="the memory case's file (GB)")
    ap.add_argument("--holders", type=int, default=8)
    ap.add_argument("--build", default="build")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--fio-runtime", type=int, default=10)
    ap.add_argument("--shmem-huge-pages", default="advise",
                    help="transparent_hugepage/shmem_enabled for the run (restored after; 'keep': as it is); "
                         "docs/store.md's deployment sets advise")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    build = os.path.join(ROOT, a.build)
    binary = os.path.join(build, "pinload")
    root = a.dir or os.path.join(fb.gen.default_out(), f"fresh-bench-{a.scale:g}")
    files = fb.generate(root, a.scale, 0, 0)["set"]
    set_bytes = sum(map(os.path.getsize, files))
    fb.setup_peers(os.path.join(HERE, ".peers"), False)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(build, "python"), os.path.join(ROOT, "python")])
    digests = {}  # per list of files: checkpoint.reference_digests
    sentinel = os.path.join(root, "sentinel.bin")
    if not os.path.exists(sentinel):
        with open(sentinel, "wb") as f:
            f.write(os.urandom(1 << 20))
    cases = a.cases.split(",")
    runs, lims, memory = [], [], []
    folder = os.path.join(root, "store")
    os.makedirs(folder, exist_ok=True)
    thp = SHMEM_ENABLED
    thp_before = shmem_enabled()
    if a.shmem_huge_pages != "keep":
        with open(thp, "w") as f:
            f.write(a.shmem_huge_pages)
    weed, urls, s3_env = None, None, {}
    if "s3" in cases:
        sys.path.insert(0, os.path.join(ROOT, "tests", "remote"))
        import servers  # noqa: E402  (the remote tests' SeaweedFS)
        weed = servers.Seaweed(volume_max=int(set_bytes / (256 << 20)) + 8)  # 256 MB volumes
        client = weed.client()
        client.create_bucket(Bucket="store-bench")
        for f in files:
            client.upload_file(f, "store-bench", os.path.basename(f))
        urls = [f"s3://store-bench/{os.path.basename(f)}" for f in files]
        s3_env = weed.env()
    # The daemon fetches S3 objects with its own credentials (docs/store.md, the trust model).
    daemon = Daemon(binary, folder, int(2.5 * set_bytes) + (1 << 30), env=dict(os.environ, **s3_env))
    store_env = dict(env, PINLOAD_STORE=daemon.socket)

    def one(system, case, paths, cold, keep, device="cpu", with_store=False, evict=False, remote=False):
        if evict:
            daemon.evict()
        key = tuple(paths)
        if key not in digests:
            digests[key] = checkpoint.reference_digests(paths)
        run_env = store_env if with_store else env
        r = fb.run_one(system, "set", paths, digests[key], cold, dict(run_env, **s3_env) if remote else run_env, device,
                       case=case, keep_cache=keep,
                       # the store's files are not in the page cache: its restart needs none of them there
                       sentinel=None if with_store or remote else sentinel, paths=urls if remote else None)
        r["system"] = STORE if with_store else system
        r["round"] = rnd
        runs.append(r)
        shown = f"{r['gbps']:.2f} GB/s" if "gbps" in r else f"skipped: {r.get('skipped', '')[:200]}"
        flag = "" if r.get("verified", True) else f" NOT VERIFIED {r.get('verify')}"
        fb.log(f"[round {rnd + 1}] {case} {r['system']}: {shown}{flag}")
        return r

    try:
        for rnd in range(a.rounds):
            lim = fb.limits(os.path.join(build, "bench", "pinload-bench"), files, 5, a.fio_runtime)
            lim["round"] = rnd
            lims.append(lim)
            fb.log(f"[round {rnd + 1}] limits: fio {lim.get('fio_gbps')} GB/s, first touch {lim.get('first_touch_gbps')}")
            if "restart" in cases:
                names = [STORE] + PEERS
                k = rnd % len(names)
                for name in names[k:] + names[:k]:
                    s = name == STORE
                    one("pinload" if s else name, "cold", files, True, False, with_store=s, evict=s)
                    one("pinload" if s else name, "restart", files, False, True, with_store=s)
                one("pinload", "warm (page cache)", files, False, False)
            if "device" in cases:
                one("pinload", "device: cold (disk)", files, True, False, "sim")
                one("pinload", "device: warm (page cache)", files, False, False, "sim")
                one("pinload", "device: cold (disk)", files, True, False, "sim", with_store=True, evict=True)
                one("pinload", "device: restart (store)", files, False, True, "sim", with_store=True)
            if "elastic" in cases:
                model_a, model_b = files[0], files[1]
                for s in (True, False):
                    daemon.evict()
                    one("pinload", "elastic: A cold", [model_a], True, False, with_store=s)
                    one("pinload", "elastic: B", [model_b], False, True, with_store=s)
                    one("pinload", "elastic: A again", [model_a], False, True, with_store=s)
            if "memory" in cases:
                path = os.path.join(root, "memory", "model.safetensors")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fb.gen.write_file(path, fb._first(fb.gen.t5_encoder(), a.memory_gb * 1e9), fb.gen.RandomBytes(7), False)
                daemon.evict()
                for label, sock in ((STORE, daemon.socket), ("pinload, pools of their own", None)):
                    m = memory_case(path, a.holders, env, sock)
                    m.update(system=label, round=rnd)
                    memory.append(m)
                    fb.log(f"[round {rnd + 1}] memory {label}: {m['node_used_bytes'] / 1e9:.2f} GB in use "
                           f"({m['x_set']:.2f} x the file), Shmem +{m['shmem_bytes'] / 1e9:.2f} GB")
            if "convert" in cases:
                fp8 = os.path.join(root, "fp8", "weights.fp8.safetensors")
                if not os.path.exists(fp8):
                    # Finite weights (random bytes hold infinities, which FP8 with a scale cannot):
                    # 24 fp16 matrices of 4096 x 12288 (2.4 GB), then their FP8 copy (1.2 GB).
                    import numpy as np
                    from safetensors.numpy import save_file
                    source = os.path.join(root, "fp8", "weights.fp16.safetensors")
                    os.makedirs(os.path.dirname(fp8), exist_ok=True)
                    rng = np.random.default_rng(34)
                    save_file({f"blocks.{i}.mlp.weight": (rng.standard_normal((4096, 12288), dtype=np.float32) * 0.02)
                               .astype(np.float16) for i in range(24)}, source)
                    subprocess.run([binary, "convert", source, fp8], check=True, capture_output=True)
                    os.remove(source)
                harness.read_all([fp8])

                def convert_worker(with_store: bool, digest: bool = False) -> subprocess.CompletedProcess:
                    cmd = [binary, "load", "--dtype", "bf16", "-q"] + (["--digest"] if digest else [])
                    cmd += (["--store", daemon.socket, "--store-required"] if with_store else []) + [fp8]
                    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)

                for label, with_store, evict in (("convert: local", False, False),
                                                 ("convert: store fill", True, True),
                                                 ("convert: store", True, False)):
                    if evict:
                        daemon.evict()
                    t = time.monotonic()
                    convert_worker(with_store)
                    seconds = time.monotonic() - t
                    r = {"system": STORE if with_store else "pinload", "case": label, "round": rnd,
                         "seconds": seconds, "bytes": os.path.getsize(fp8), "gbps": os.path.getsize(fp8) / seconds / 1e9}
                    runs.append(r)
                    fb.log(f"[round {rnd + 1}] {label}: {seconds:.3f} s")
                if rnd == 0 and convert_worker(True, True).stdout != convert_worker(False, True).stdout:
                    raise SystemExit("store_bench: the store's bf16 entry differs from a local conversion")
            if "s3" in cases:
                # The server's own limit: each object read whole by boto3 (one GET, one stream).
                t = time.monotonic()
                for f in files:
                    body = client.get_object(Bucket="store-bench", Key=os.path.basename(f))["Body"]
                    while body.read(64 << 20):
                        pass
                lim["s3_raw_get_gbps"] = set_bytes / (time.monotonic() - t) / 1e9
                fb.log(f"[round {rnd + 1}] limits: S3 raw GET {lim['s3_raw_get_gbps']:.2f} GB/s")
                one("pinload", "s3: direct", files, False, True, remote=True)
                one("pinload", "s3: store fetch", files, False, True, with_store=True, evict=True, remote=True)
                one("pinload", "s3: store", files, False, True, with_store=True, remote=True)
        store_status = daemon.status()
    finally:
        daemon.stop()
        if weed is not None:
            weed.cleanup()
        with open(thp, "w") as f:
            f.write(thp_before)
    out = {"tool": "store_bench", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + (argv if argv is not None else sys.argv[1:])),
           "host": {"cores": os.cpu_count(), "kernel": platform.release(), "loadavg_at_end": os.getloadavg()},
           "versions": harness.versions(), "scale": a.scale, "set_bytes": set_bytes, "limits": lims, "runs": runs,
           "memory": memory, "store_status": store_status, "shmem_huge_pages": store_status.get("shmem_huge_pages"), "seconds": time.monotonic() - t0}
    path = a.out or os.path.join(HERE, "results", f"store.{a.scale:g}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(table(out))
    fb.log(f"store_bench: wrote {path} ({time.monotonic() - t0:.0f} s)")
    return 0


def table(out: dict) -> str:
    def med(system, case):
        xs = [r["gbps"] for r in out["runs"] if r["system"] == system and r["case"] == case and "gbps" in r]
        return sorted(xs)[len(xs) // 2] if xs else None

    lines = ["| case | system | GB/s | ratio |", "|---|---|---:|---:|"]
    # pinload without the store is the baseline, not a peer
    best_peer = max((g for s in PEERS[1:] if (g := med(s, "restart")) is not None), default=None)
    for case in ("cold", "restart"):
        for s in [STORE] + PEERS:
            g = med(s, case)
            if g is not None:
                ratio = f"{g / best_peer:.2f} x best peer's restart" if case == "restart" and best_peer else ""
                lines.append(f"| {case} | {s} | {g:.2f} | {ratio} |")
    warm = med("pinload", "warm (page cache)")
    if warm and med(STORE, "restart"):
        lines.append(f"| fresh worker, host | {STORE} (resident) vs pinload from the page cache | "
                     f"{med(STORE, 'restart'):.2f} | {med(STORE, 'restart') / warm:.2f} x |")
    dev = {c: med(s, c) for s, c in (("pinload", "device: cold (disk)"), ("pinload", "device: warm (page cache)"),
                                     (STORE, "device: restart (store)")) if med(s, c)}
    if dev.get("device: restart (store)") and dev.get("device: warm (page cache)"):
        for c, g in dev.items():
            lines.append(f"| fresh worker, sim device | {c} | {g:.2f} | "
                         f"{dev['device: restart (store)'] / g:.2f} x (store / this) |")
    for s in (STORE, "pinload"):
        a1, a2 = med(s, "elastic: A cold"), med(s, "elastic: A again")
        if a1 and a2:
            lines.append(f"| elastic A -> B -> A | {s} | {a2:.2f} | A again {a2 / a1:.1f} x A cold |")
    direct, stored = med("pinload", "s3: direct"), med(STORE, "s3: store")
    raw = [lim["s3_raw_get_gbps"] for lim in out["limits"] if "s3_raw_get_gbps" in lim]
    if raw:
        lines.append(f"| S3, the server's limit | boto3 GET, one stream per object | {sorted(raw)[len(raw) // 2]:.2f} | |")
    if direct and stored:
        for s, c in (("pinload", "s3: direct"), (STORE, "s3: store fetch"), (STORE, "s3: store")):
            if med(s, c):
                lines.append(f"| S3, fresh worker | {s}: {c} | {med(s, c):.2f} | "
                             f"{stored / med(s, c):.1f} x (store / this) |")
    local, stored = med("pinload", "convert: local"), med(STORE, "convert: store")
    if local and stored:
        for s, c in (("pinload", "convert: local"), (STORE, "convert: store fill"), (STORE, "convert: store")):
            if med(s, c):
                lines.append(f"| FP8 file as bf16, fresh worker (GB/s of the FP8 file) | {s}: {c} | {med(s, c):.2f} | "
                             f"{stored / med(s, c):.1f} x (store / this) |")
    for m in out["memory"]:
        lines.append(f"| memory, {m['holders']} holders of {m['set_bytes'] / 1e9:.2f} GB | {m['system']} | "
                     f"{m['node_used_bytes'] / 1e9:.2f} GB | {m['x_set']:.2f} x the file |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
