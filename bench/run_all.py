#!/usr/bin/env python3
"""All benchmark scenarios, pinload and the peers side by side with the machine's limits, in one run.

    bench/run_all.py --quick                  # the small checkpoints, a few minutes
    bench/run_all.py                          # full size: SDXL, T5-XXL, FLUX parts (see --estimate)
    bench/run_all.py --set sdxl=/nas/sdxl-base --set t5=/nas/flux/text_encoder_2 ...

Scenarios (--scenarios, default all that apply):
  limits   pinload-bench --phases fio,buffered,memcpy on each set (fio direct at iodepth 1
           and 32, read(), memcpy); on a GPU also pinned host-to-device copy (torch)
  cold     each system loads each set after the page cache is dropped; /proc/<pid>/io
           read_bytes sampled every 50 ms (the bandwidth-over-time plot)
  warm     the same with the files read once before (SDXL and the FLUX parts)
  switch   FLUX parts -> SDXL -> FLUX parts in one process: pinload with its pool,
           pinload.ModelCache where the library has it; the peers reload each time
  memlimit each system cold on SDXL inside a memory cgroup of --mem-limit x the set's
           bytes (CPU: 1.25, the state dict must fit but the page cache next to it
           does not; GPU: 0.5 with pinload's staging budget); peak RSS, the cgroup's
           peak and OOM kills recorded. Without a cgroup, pinload's budget alone, said so.
  Every scenario runs on cuda:0 too when torch sees a GPU (--device).

Sets (--set NAME=PATH[,PATH...], any paths: a NAS, a local disk):
  full:  sdxl = <models>/sdxl-base (fp16 variant), t5 = <models>/flux-dev/text_encoder_2 (2 shards),
         flux = <models>/flux-dev/{text_encoder,vae,text_encoder_2/model-00002-of-00002.safetensors}
  quick: the same from the -small folders.
Missing checkpoints are generated (scripts/gen_checkpoints.py), missing peers are
pip-installed (--setup only, or first thing in every run: find_spec, never reinstalls).

Output: bench/results/run_all.<mode>.json (--out); bench/report.py turns it into the
tables of docs/benchmarks.md and the plots in docs/img/.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from peers import checkpoint, convert, harness  # noqa: E402

# pip name -> import name; installed only when find_spec says missing
PIP_PEERS = {"fastsafetensors": "fastsafetensors", "runai-model-streamer": "runai_model_streamer",
             "tensorizer": "tensorizer", "instanttensor": "instanttensor", "flashpack": "flashpack",
             "matplotlib": "matplotlib"}

SYSTEMS_CPU = ["pinload", "safetensors mmap + clone", "safetensors pread", "fastsafetensors",
               "runai-model-streamer", "instanttensor", "tensorizer", "torch.load mmap + clone", "torch.load",
               "flashpack"]
SYSTEMS_EXTRA = ["safetensors.numpy.load_file", "mmap + numpy copy", "safetensors lazy mmap (not a load)"]


def models_root() -> str:
    return os.environ.get("PINLOAD_MODELS") or os.path.join(os.path.expanduser("~"), ".cache", "pinload", "models")


def setup(quick: bool, log=print) -> dict:
    """Install the missing peers and generate the missing checkpoints; idempotent."""
    missing = [pip for pip, mod in PIP_PEERS.items() if importlib.util.find_spec(mod) is None]
    done = {"pip_missing": missing}
    if missing:
        log(f"setup: pip install {' '.join(missing)}")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing])
        done["pip_exit"] = r.returncode
    gen = [sys.executable, os.path.join(ROOT, "scripts", "gen_checkpoints.py")]
    m = models_root()
    if quick:
        need = [os.path.join(m, "flux-dev-small", "vae"), os.path.join(m, "sdxl-base-small", "unet")]
        if not all(os.path.isdir(p) for p in need):
            subprocess.run(gen + ["--scale", "small"], check=True)
    else:
        need = {"clip-l,vae,t5-xxl": [os.path.join(m, "flux-dev", "text_encoder", "model.safetensors"),
                                      os.path.join(m, "flux-dev", "vae", "diffusion_pytorch_model.safetensors")]
                + [os.path.join(m, "flux-dev", "text_encoder_2", f"model-0000{i}-of-00002.safetensors")
                   for i in (1, 2)],
                "sdxl": [os.path.join(m, "sdxl-base", c, f)
                         for c, f in (("unet", "diffusion_pytorch_model.fp16.safetensors"),
                                      ("text_encoder", "model.fp16.safetensors"),
                                      ("text_encoder_2", "model.fp16.safetensors"),
                                      ("vae", "diffusion_pytorch_model.fp16.safetensors"))]}
        for only, paths in need.items():
            if not all(os.path.isfile(p) for p in paths):
                log(f"setup: generating {only}")
                subprocess.run(gen + ["--only", only], check=True)
    return done


def default_sets(quick: bool) -> dict:
    m = models_root()
    sfx = "-small" if quick else ""
    flux = os.path.join(m, "flux-dev" + sfx)
    return {
        "sdxl": {"paths": [os.path.join(m, "sdxl-base" + sfx)], "variant": "fp16", "label": "SDXL base (fp16)"},
        "t5": {"paths": [os.path.join(flux, "text_encoder_2")], "label": "T5-XXL (2 shards)"},
        "flux": {"paths": [os.path.join(flux, "text_encoder"), os.path.join(flux, "vae"),
                           os.path.join(flux, "text_encoder_2", "model-00002-of-00002.safetensors")],
                 "label": "FLUX parts (CLIP-L, VAE, T5 shard 2)"},
    }


class Runner:
    def __init__(self, a, systems):
        self.a = a
        self.systems = systems
        self.t0 = time.monotonic()
        self.out = {"tool": "run_all", "mode": "quick" if a.quick else "full",
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                    "host": host_info(), "versions": harness.versions(), "sets": {}, "limits": {},
                    "scenarios": {}}
        self.env = dict(os.environ)
        pyp = [os.path.join(ROOT, a.build, "python"), os.path.join(ROOT, "python")]
        self.env["PYTHONPATH"] = os.pathsep.join(pyp + ([self.env["PYTHONPATH"]] if self.env.get("PYTHONPATH") else []))
        self.env.setdefault("RUNAI_STREAMER_LOG_LEVEL", "WARNING")

    def log(self, msg):
        print(f"[run_all +{time.monotonic() - self.t0:5.0f}s] {msg}", file=sys.stderr, flush=True)

    def save(self):
        self.out["elapsed_seconds"] = time.monotonic() - self.t0
        os.makedirs(os.path.dirname(self.a.out), exist_ok=True)
        with open(self.a.out, "w") as f:
            json.dump(self.out, f, indent=1)
            f.write("\n")

    def prepare_set(self, name, s):
        files = checkpoint.resolve(s["paths"], s.get("variant"))
        missing = [p for p in files if not os.path.isfile(p)]
        if not files or missing:
            raise SystemExit(f"set {name}: no files or missing {missing[:3]} (paths {s['paths']})")
        total = checkpoint.data_bytes(files)
        step = {"paths": s["paths"], "files": files, "variant": s.get("variant"),
                "digests": checkpoint.reference_digests(files), "converted": {}}
        skip = {}
        if self.a.convert_dir:
            import shutil
            want = {"tensorizer": "tensorizer" in self.systems, "flashpack": "flashpack" in self.systems,
                    "pt": any(s.startswith("torch.load") for s in self.systems)}
            for fmt, ext in (("tensorizer", "tensors"), ("pt", "pt"), ("flashpack", "flashpack")):
                if not want[fmt]:
                    continue
                if total > self.a.convert_max_gb * 1e9:
                    skip[fmt] = (f"not converted: the set ({total / 1e9:.1f} GB) is over --convert-max-gb "
                                 f"{self.a.convert_max_gb} (disk)")
                    continue
                dst = os.path.join(self.a.convert_dir, f"{self.out['mode']}-{name}", f"model.{ext}")
                free = shutil.disk_usage(os.path.dirname(self.a.convert_dir) or "/").free
                if not os.path.exists(dst) and free - total < self.a.keep_free_gb * 1e9:
                    skip[fmt] = f"not converted: would leave under {self.a.keep_free_gb} GB of disk free"
                    continue
                try:
                    c = convert.convert(files, fmt, dst)
                    step["converted"][fmt] = c["path"]
                    if c.get("converted"):
                        self.log(f"converted {name} to {fmt} in {c['seconds']:.0f} s")
                except Exception as e:  # noqa: BLE001
                    skip[fmt] = f"conversion failed: {type(e).__name__}: {e}"
        else:
            skip = {f: "no --convert-dir" for f in ("tensorizer", "pt", "flashpack")}
        self.out["sets"][name] = {"label": s.get("label", name), "paths": s["paths"], "files":
                                  [{"path": p, "bytes": os.path.getsize(p)} for p in files],
                                  "tensor_bytes": total, "variant": s.get("variant"), "convert_skipped": skip}
        return step, skip

    def limits(self, name, step):
        if not os.path.exists(self.a.bin):
            self.out["limits"][name] = {"skipped": f"{self.a.bin} not built"}
            return
        js = os.path.join(self.a.tmp, f"limits-{name}.json")
        cmd = [self.a.bin, *step["paths"], "--phases", "fio,buffered,memcpy", "--repeat", str(self.a.limit_repeat),
               "--hugetlb", "auto", "--json", js]
        if step.get("variant"):
            cmd += ["--variant", step["variant"]]
        if self.a.quick:
            cmd += ["--memcpy-bytes", "256M"]
        self.log(" ".join(cmd))
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0 or not os.path.exists(js):
            self.out["limits"][name] = {"error": f"exit {r.returncode}: {r.stderr[-800:]}"}
            return
        with open(js) as f:
            res = json.load(f)["results"]
        self.out["limits"][name] = res

    def gpu_limit(self):
        code = ("import torch,time,json\n"
                "n=1<<30\nh=torch.empty(n,dtype=torch.uint8).pin_memory();d=torch.empty(n,dtype=torch.uint8,device='cuda')\n"
                "best=0\nfor _ in range(5):\n torch.cuda.synchronize();t=time.perf_counter();d.copy_(h,non_blocking=True);"
                "torch.cuda.synchronize();best=max(best,n/(time.perf_counter()-t)/1e9)\nprint(json.dumps({'pinned_h2d_gbps':best}))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        try:
            self.out["limits"]["gpu"] = json.loads(r.stdout.strip().splitlines()[-1])
        except Exception:  # noqa: BLE001
            self.out["limits"]["gpu"] = {"error": r.stderr[-800:]}

    def run(self, scenario, set_name, system, steps, cold=True, mem_limit=None, options=None):
        res = harness.run_system(system, steps, device=self.a.device, cold=cold, mem_limit=mem_limit, env=self.env,
                            options=options, timeout=self.a.timeout)
        if scenario not in ("cold",):
            res.pop("io_samples", None)
        self.log(f"{scenario} {set_name} {system}: {harness.summary(res)}")
        self.out["scenarios"].setdefault(scenario, {}).setdefault(set_name, {})[system] = res
        self.save()
        return res


def host_info() -> dict:
    info = {"cores": os.cpu_count(), "kernel": platform.release(), "loadavg": os.getloadavg()}
    try:
        with open("/proc/meminfo") as f:
            info["mem_total"] = int(f.readline().split()[1]) * 1024
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    return info


def set_bytes(s) -> int:
    """Tensor bytes of a set, from the index files where shards are not there yet."""
    total = 0
    for p in s["paths"]:
        idx = sorted(glob.glob(os.path.join(p, "*.safetensors.index.json"))) if os.path.isdir(p) else []
        if idx:
            with open(idx[0]) as f:
                total += json.load(f)["metadata"]["total_size"]
        else:
            total += checkpoint.data_bytes([f for f in checkpoint.resolve([p], s.get("variant")) if os.path.isfile(f)])
    return total


def estimate(sets_bytes: dict, n_systems: int, convert_max: float) -> float:
    """Seconds for a run, from this machine's figures: the peers at about 0.6 GB/s cold
    and 1 GB/s warm plus 4 s of process start each; pinload-bench's limits (5 fio
    variants x 2 rounds at ~2 GB/s, read() cold at 0.5 GB/s); conversions (two
    formats, read + write at ~0.4 GB/s) of the sets under --convert-max-gb."""
    total = sum(sets_bytes.values())
    cold = n_systems * (total / 0.6e9 + 4 * len(sets_bytes))
    warm = n_systems * ((total - sets_bytes.get("t5", 0)) / 1.0e9 + 4 * len(sets_bytes))
    sw = (n_systems + 1) * ((2 * sets_bytes.get("flux", 0) + sets_bytes.get("sdxl", 0)) / 0.8e9 + 4)
    mem = n_systems * (sets_bytes.get("sdxl", 0) / 0.5e9 + 4)
    lim = total * (10 / 2e9 + 1 / 0.5e9 + 1 / 5e9)
    conv = sum(2 * 2 * b / 0.4e9 for b in sets_bytes.values() if b <= convert_max * 1e9)
    return cold + warm + sw + mem + lim + conv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the small checkpoints, fewer systems, a few minutes")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=PATH[,PATH...]",
                    help="replace or add a set of paths (NAME sdxl, t5 or flux keeps its scenario role)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=VARIANT")
    ap.add_argument("--scenarios", default="limits,cold,warm,switch,memlimit")
    ap.add_argument("--systems", default=None, help="comma list (default: pinload and the peers; --extra adds more)")
    ap.add_argument("--extra", action="store_true", help="also the numpy peers and the lazy mmap reference")
    ap.add_argument("--device", default=None, help="cpu or cuda:0 (default: cuda:0 when torch sees a GPU)")
    ap.add_argument("--mem-limit", type=float, default=None,
                    help="memlimit: cgroup limit as a fraction of the SDXL set (default 1.25 on cpu, 0.5 on cuda)")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build-bench", "bench", "pinload-bench"))
    ap.add_argument("--build", default="build-bench", help="build folder with python/pinload/_core*.so")
    ap.add_argument("--limit-repeat", type=int, default=None)
    ap.add_argument("--convert-dir", default=os.path.join(models_root(), ".converted"))
    ap.add_argument("--convert-max-gb", type=float, default=8.0)
    ap.add_argument("--keep-free-gb", type=float, default=15.0)
    ap.add_argument("--timeout", type=int, default=900, help="per worker process")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", action="store_true",
                    help="keep the other scenarios of an existing --out JSON (re-run some scenarios only)")
    ap.add_argument("--setup", action="store_true", help="install peers, generate checkpoints, and stop")
    ap.add_argument("--no-setup", action="store_true")
    ap.add_argument("--estimate", action="store_true", help="print the expected duration and stop")
    a = ap.parse_args(argv)
    mode = "quick" if a.quick else "full"
    a.out = a.out or os.path.join(HERE, "results", f"run_all.{mode}.json")
    a.limit_repeat = a.limit_repeat or (1 if a.quick else 2)
    a.tmp = os.path.join("/tmp", f"pinload-run_all-{os.getpid()}")
    os.makedirs(a.tmp, exist_ok=True)

    if not a.no_setup and not a.estimate:
        setup(a.quick, log=lambda m: print(m, file=sys.stderr))
    if a.setup:
        return 0
    if a.device is None:
        try:
            import torch
            a.device = "cuda:0" if torch.cuda.is_available() else "cpu"
        except ImportError:
            a.device = "cpu"
    sets = default_sets(a.quick)
    for s in a.set:
        k, _, v = s.partition("=")
        sets[k] = {"paths": v.split(","), "label": k}
    for s in a.variant:
        k, _, v = s.partition("=")
        sets[k]["variant"] = v
    systems = a.systems.split(",") if a.systems else SYSTEMS_CPU + (SYSTEMS_EXTRA if a.extra else [])
    if not a.systems and not a.extra and not (a.device or "").startswith("cuda"):
        # on the CPU its load is a map of the file (flagged as not a load): not worth
        # a converted copy of every set; --extra or a GPU run includes it
        systems = [s for s in systems if s != "flashpack"]
    if a.estimate:
        b = {k: set_bytes(v) for k, v in sets.items()}
        print(f"{len(systems)} systems on {', '.join(f'{k} {v / 1e9:.1f} GB' for k, v in b.items())}: "
              f"about {estimate(b, len(systems), a.convert_max_gb) / 60:.0f} minutes (conversions included)")
        return 0

    R = Runner(a, systems)
    if a.merge and os.path.exists(a.out):
        with open(a.out) as f:
            old = json.load(f)
        for k in ("limits", "scenarios"):
            R.out[k] = old.get(k, {})
        R.out["merged_from"] = old.get("date")
    R.out["device"] = a.device
    R.out["systems"] = systems
    scen = a.scenarios.split(",")
    steps = {}
    for name, s in list(sets.items()):
        try:
            steps[name], _ = R.prepare_set(name, s)
        except SystemExit as e:  # a set whose files are not there: said, and left out
            R.log(str(e))
            R.out["sets"][name] = {"label": s.get("label", name), "paths": s["paths"], "missing": str(e)}
            del sets[name]
    if not steps:
        raise SystemExit("no set has its files: run scripts/gen_checkpoints.py or pass --set")
    R.save()
    if "limits" in scen:
        for name in sets:
            R.limits(name, steps[name])
        if a.device.startswith("cuda"):
            R.gpu_limit()
        R.save()
    # T5-XXL (9.5 GB) is the large-file cold case; warm runs on SDXL and the FLUX parts
    # (and in --quick the small T5 is in the FLUX parts already), to keep the full run
    # under 25 minutes here
    phase_sets = {"cold": [s for s in sets if not (a.quick and s == "t5")],
                  "warm": [s for s in sets if s != "t5"] or list(sets)}
    for phase in ("cold", "warm"):
        if phase not in scen:
            continue
        for k, name in enumerate(phase_sets[phase]):
            # Each set starts at another system: the first worker after a phase change (a
            # fio run, huge pages reserved and freed) finds colder memory, and no system
            # should always be the one that pays for it.
            first = (k + 1) % len(systems)
            for system in systems[first:] + systems[:first]:
                st = dict(steps[name], label="load")
                two = [st]
                if system == "pinload":  # the same process loads again: the pool is kept
                    two = [st, dict(st, label="re-load (pool kept)", drop_caches=(phase == "cold"))]
                R.run(phase, name, system, two, cold=(phase == "cold"))
    if "switch" in scen and "flux" in sets and "sdxl" in sets:
        seq = [dict(steps["flux"], label="FLUX"), dict(steps["sdxl"], label="SDXL"),
               dict(steps["flux"], label="FLUX again")]
        budget = int(1.2 * (R.out["sets"]["flux"]["tensor_bytes"] + R.out["sets"]["sdxl"]["tensor_bytes"]))
        for system in ["pinload", "pinload ModelCache"] + [s for s in systems if s != "pinload"]:
            R.run("switch", "flux-sdxl-flux", system, seq, cold=True, options={"cache_budget": budget})
    if "memlimit" in scen and "sdxl" in sets:
        frac = a.mem_limit or (0.5 if a.device.startswith("cuda") else 1.25)
        # the interpreter with torch imported, before any load: the limit is that plus
        # a fraction of the set (the interpreter is not what is measured)
        b = harness.run_system("safetensors mmap + clone", [], device=a.device, cold=False, env=R.env)
        base = int(1.1 * (b.get("status_imported", {}).get("VmRSS") or 0))
        limit = base + int(frac * R.out["sets"]["sdxl"]["tensor_bytes"])
        R.out["mem_limit"] = {"fraction": frac, "interpreter_bytes": base, "bytes": limit,
                              "rule": f"1.1 x the RSS of a worker with torch imported + {frac} x the set's tensor bytes"}
        R.log(f"memlimit: {limit / 1e9:.2f} GB = interpreter {base / 1e9:.2f} GB + {frac} x the set")
        for system in systems:
            opts = {}
            if system == "pinload" and a.device.startswith("cuda"):
                opts = {"pinload": {"staging_bytes": limit // 4}}
            R.run("memlimit", "sdxl", system, [dict(steps["sdxl"], label="load")], cold=True, mem_limit=limit,
                  options=opts)
    R.save()
    R.log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
