#!/usr/bin/env python3
"""Remote sources: pinload over HTTP(S) and S3 next to the same run's peers.

One command (servers on loopback, started and stopped here):

    python3 bench/remote_bench.py --pinload build/pinload [--size-mib 512] [--json out.json]

Rows (each rate is model bytes / wall seconds of one process, cold client):
  nconnect   nginx with `limit_rate` per connection (50m): pinload with 1 and
             16 connections, against the server's aggregate over 16
             connections measured in the same run (the reference,
             `aggregate`): 16 threads, each on its own connection opened
             before the clock starts, GET their own 1/16 range at once
             (threaded_ranges); 16 curl processes at once (one range each,
             wall from the first start to the last exit, process start-up
             included) and curl -Z (one process, 16 ranges) beside it;
             pinload's 16-connection rate is reported as a ratio of
             min(16 x the cap, the aggregate);
  s3         SeaweedFS (`weed server -s3`, SigV4): pinload, the best raw
             parallel ranged GET (16 curl processes or curl -Z, 16 ranges,
             --aws-sigv4; the faster of the two), boto3
             download then safetensors.torch.load_file, and
             runai-model-streamer's S3 path where it is installed;
  cpu        CPU seconds (user + sys of the process) per GB over HTTP and HTTPS;
  rss        peak RSS of a host load against the model's size.
The machine's other load is not controlled: quote the ratios of one run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "remote"))
import servers  # noqa: E402

BUCKET = "bench"


def _size_bytes(text):
    """nginx's size syntax (limit_rate 50m): k and m are 1024-based."""
    text = str(text).strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("kmg")) * mult


def make_model(path, mib):
    """A safetensors file of `mib` MiB of random bytes in 64 MiB tensors."""
    import numpy as np
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    tensors, left, i = {"tiny": np.zeros(1024, dtype=np.float32)} if mib == 0 else {}, mib, 0
    while left > 0:
        n = min(left, 64)
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = rng.integers(0, 255, size=(n * 1024, 1024), dtype=np.uint8)
        left -= n
        i += 1
    save_file(tensors, str(path))


def measured(args, env=None):
    """(wall s, cpu s, peak RSS bytes) of one child process; raises on failure."""
    full = dict(os.environ)
    full.update(env or {})
    start = time.monotonic()
    proc = subprocess.Popen(args, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{args[0]} failed: {err[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def curl_parallel(url, size, parts, extra=()):
    """curl -Z with `parts` ranges of one object, bodies to /dev/null."""
    args = ["curl", "-s", "-Z", "--parallel-max", str(parts)]
    step = (size + parts - 1) // parts
    for k in range(parts):
        first = k * step
        if first >= size:
            break
        if k > 0:
            args.append("--next")  # per-URL options (range, output) start again
        args += ["-f", *extra, "-r", f"{first}-{min(size, first + step) - 1}", "-o", "/dev/null", url]
    return args


def measured_together(commands, env=None):
    """(wall s, cpu s, max peak RSS) of `commands` run at once, each its own process: wall from
    the first start to the last exit, CPU summed; raises if any fails."""
    full = dict(os.environ)
    full.update(env or {})
    start = time.monotonic()
    procs = {}
    for args in commands:
        p = subprocess.Popen(args, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs[p.pid] = p
    cpu, rss, failed = 0.0, 0, []
    while procs:
        pid, status, usage = os.wait4(-1, 0)
        p = procs.pop(pid, None)
        if p is None:
            continue
        cpu += usage.ru_utime + usage.ru_stime
        rss = max(rss, usage.ru_maxrss * 1024)
        err = p.stderr.read().decode(errors="replace")
        p.stderr.close()
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(f"{p.args[0]}: {err[-500:]}")
    wall = time.monotonic() - start
    if failed:
        raise RuntimeError("; ".join(failed))
    return wall, cpu, rss


def curl_processes(url, size, parts, extra=()):
    """`parts` curl commands, each fetching its own contiguous range of the object on its own
    connection (one ranged GET), body to /dev/null: the server's aggregate over `parts`
    connections, without one client process's CPU as the limit (curl -Z runs every transfer on
    one thread)."""
    step = (size + parts - 1) // parts
    return [["curl", "-s", "-f", *extra, "-r", f"{first}-{min(size, first + step) - 1}", "-o", "/dev/null", url]
            for first in range(0, size, step)]


def threaded_ranges(url, size, parts):
    """(wall s, cpu s, 0): `parts` threads, each on its own TCP connection (opened before the clock
    starts, as a pooled keep-alive connection is), GET one contiguous 1/parts range of the object
    at the same moment and read the body with recv_into (no copy, the GIL released in the
    system call). What the server can give over `parts` connections, without a client process's
    start-up or one event-loop thread as the limit. Raises unless every answer is a 206 of the
    range asked."""
    import socket
    import threading
    from urllib.parse import urlparse

    u = urlparse(url)
    step = (size + parts - 1) // parts
    ranges = [(first, min(size, first + step) - 1) for first in range(0, size, step)]
    socks = [socket.create_connection((u.hostname, u.port or 80)) for _ in ranges]
    start = threading.Barrier(len(ranges) + 1)
    errors = []

    def fetch(sock, first, last):
        try:
            start.wait()
            sock.sendall(f"GET {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nRange: bytes={first}-{last}\r\n"
                         f"Connection: keep-alive\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(65536)
                if not chunk:
                    raise OSError("closed before the headers")
                head += chunk
            head, _, body = head.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
            want = last - first + 1
            if " 206 " not in lines[0] + " " or int(fields.get("content-length", -1)) != want:
                raise OSError(f"{lines[0]!r}, Content-Length {fields.get('content-length')} for {want} bytes")
            buf = memoryview(bytearray(1 << 20))
            got = len(body)
            while got < want:
                n = sock.recv_into(buf, min(len(buf), want - got))
                if n == 0:
                    raise OSError(f"closed at {got} of {want} bytes")
                got += n
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
        finally:
            sock.close()

    threads = [threading.Thread(target=fetch, args=(sk, a, b)) for sk, (a, b) in zip(socks, ranges)]
    for t in threads:
        t.start()
    cpu0 = time.process_time()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    if errors:
        raise RuntimeError("; ".join(errors))
    return wall, cpu, 0


def best(fn, repeat):
    runs = [fn() for _ in range(repeat)]
    return min(runs, key=lambda r: r[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pinload", default=str(HERE.parent / "build" / "pinload"))
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--rate", default="50m", help="nginx limit_rate per connection")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json")
    opts = ap.parse_args()
    pinload = opts.pinload
    n = opts.connections
    work = Path(tempfile.mkdtemp(prefix="pinload-remote-bench-"))
    model = work / "root" / "model.safetensors"
    model.parent.mkdir()
    # In a child: the parent's RSS would count in every child's ru_maxrss (fork).
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import remote_bench as b; "
                    "b.make_model(sys.argv[2], int(sys.argv[3])); b.make_model(sys.argv[4], 0)",
                    str(HERE), str(model), str(opts.size_mib), str(model.parent / "tiny.safetensors")], check=True)
    size = model.stat().st_size
    rows = {}

    def rate(wall):
        return size / wall / 1e6  # MB/s

    def pin(url, connections, env=None):
        return measured([pinload, "load", "--connections", str(connections), url], env)

    # -- the nconnect effect: a per-connection cap --------------------------
    capped = servers.Nginx(str(model.parent), limit_rate=opts.rate)
    try:
        url = capped.url + "/model.safetensors"
        one = best(lambda: pin(url, 1), opts.repeat)
        many = best(lambda: pin(url, n), opts.repeat)
        aggregate = best(lambda: threaded_ranges(url, size, n), opts.repeat)
        curl_procs = best(lambda: measured_together(curl_processes(url, size, n)), opts.repeat)
        curl_z = best(lambda: measured(curl_parallel(url, size, n)), opts.repeat)
        cap = _size_bytes(opts.rate) / 1e6  # MB/s; nginx's 50m is 50 MiB/s
        target = min(n * cap, rate(aggregate[0]))
        rows["nconnect"] = {"pinload_1_MBps": rate(one[0]), f"pinload_{n}_MBps": rate(many[0]),
                            f"aggregate_{n}_connections_MBps": rate(aggregate[0]),
                            f"curl_{n}_processes_MBps": rate(curl_procs[0]),
                            f"curl_Z_{n}_ranges_MBps": rate(curl_z[0]),
                            "cap_per_connection": opts.rate, "cap_per_connection_MBps": cap,
                            f"min_{n}_x_cap_or_aggregate_MBps": target,
                            f"pinload_{n}_over_target": rate(many[0]) / target,
                            "pinload_1_over_cap": rate(one[0]) / cap}
    finally:
        capped.cleanup()

    # -- CPU per GB over HTTP and HTTPS, and peak RSS -----------------------
    plain = servers.Nginx(str(model.parent))
    cert, key = servers.self_signed_cert(str(work))
    tls = servers.Nginx(str(model.parent), ssl=(cert, key))
    try:
        http = best(lambda: pin(plain.url + "/model.safetensors", n), opts.repeat)
        https = best(lambda: pin(tls.url + "/model.safetensors", n, {"AWS_CA_BUNDLE": cert}), opts.repeat)
        curl_http = best(lambda: measured(curl_parallel(plain.url + "/model.safetensors", size, n)), opts.repeat)
        rows["cpu"] = {"http_MBps": rate(http[0]), "http_cpu_s_per_GB": http[1] / (size / 1e9),
                       "https_MBps": rate(https[0]), "https_cpu_s_per_GB": https[1] / (size / 1e9),
                       "curl_parallel_http_MBps": rate(curl_http[0]),
                       "curl_parallel_http_cpu_s_per_GB": curl_http[1] / (size / 1e9)}
        tiny = measured([pinload, "load", plain.url + "/tiny.safetensors"])
        rows["rss"] = {"model_MB": size / 1e6, "pinload_http_peak_rss_MB": http[2] / 1e6,
                       "ratio": http[2] / size, "baseline_rss_MB (a 4 KiB model)": tiny[2] / 1e6,
                       "ratio_above_baseline": (http[2] - tiny[2]) / size}
    finally:
        plain.cleanup()
        tls.cleanup()

    # -- S3 on SeaweedFS -----------------------------------------------------
    weed = servers.Seaweed()
    try:
        client = weed.client()
        client.create_bucket(Bucket=BUCKET)
        client.upload_file(str(model), BUCKET, "model.safetensors")
        env = weed.env()
        s3 = best(lambda: pin(f"s3://{BUCKET}/model.safetensors", n, env), opts.repeat)
        sigv4 = ["--aws-sigv4", f"aws:amz:{servers.REGION}:s3", "--user", f"{servers.ACCESS_KEY}:{servers.SECRET_KEY}",
                 "-H", "x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"]
        object_url = f"{weed.endpoint}/{BUCKET}/model.safetensors"
        raw_z = best(lambda: measured(curl_parallel(object_url, size, n, sigv4)), opts.repeat)
        raw_procs = best(lambda: measured_together(curl_processes(object_url, size, n, sigv4)), opts.repeat)
        raw = min(raw_z, raw_procs, key=lambda r: r[0])
        download = work / "downloaded.safetensors"
        script = ("import boto3, sys\nfrom botocore.config import Config\n"
                  "from safetensors.torch import load_file\n"
                  "c = boto3.client('s3', config=Config(s3={'addressing_style': 'path'}))\n"
                  f"c.download_file('{BUCKET}', 'model.safetensors', '{download}')\n"
                  f"sd = load_file('{download}')\n")
        boto = best(lambda: measured([sys.executable, "-c", script], env), opts.repeat)
        rows["s3"] = {"pinload_MBps": rate(s3[0]), "pinload_cpu_s_per_GB": s3[1] / (size / 1e9),
                      "pinload_peak_rss_MB": s3[2] / 1e6,
                      f"curl_parallel_{n}_MBps": rate(raw[0]), f"curl_Z_{n}_MBps": rate(raw_z[0]),
                      f"curl_{n}_processes_MBps": rate(raw_procs[0]),
                      "pinload_over_best_raw": rate(raw[0]) and rate(s3[0]) / rate(raw[0]),
                      "boto3_download_then_load_MBps": rate(boto[0])}
        runai = ("from runai_model_streamer import SafetensorsStreamer\n"
                 "with SafetensorsStreamer() as s:\n"
                 f"    s.stream_file('s3://{BUCKET}/model.safetensors')\n"
                 "    for name, t in s.get_tensors(): pass\n")
        try:
            r = best(lambda: measured([sys.executable, "-c", runai],
                                      {**env, "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                                       "AWS_EC2_METADATA_DISABLED": "true"}), opts.repeat)
            rows["s3"]["runai_streamer_MBps"] = rate(r[0])
        except RuntimeError as e:
            rows["s3"]["runai_streamer"] = "not run: " + str(e).strip().splitlines()[-1][:200]
    finally:
        weed.cleanup()

    result = {"size_bytes": size, "connections": n, "machine": os.uname().nodename, "cpus": os.cpu_count(),
              "loadavg_at_end": os.getloadavg(), "rows": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if opts.json:
        Path(opts.json).write_text(text)


if __name__ == "__main__":
    main()
