"""A fuzzer of server answers (issue 46): whatever an HTTP server sends, `pinload load` of its
object, direct and through a node store daemon (`--store S`), ends with the object's bytes (checked
against the safetensors reader) or a typed error (exit 1, one "pinload: error:" line), never a
signal; its error output is valid UTF-8, the server's bytes in it escaped as \\xNN (Note [Printable
text] in src/base/printable.h); and the daemon stays alive through every case.

Each case mutates the honest answers (206, Content-Range, a strong ETag) to one request, or to
every request from one on: the status line, a header (Content-Range, ETag, Content-Length,
Last-Modified, Date, Transfer-Encoding) set to other digits or to bytes that are not UTF-8, an S3
XML error body whose <Code> is not UTF-8, a body cut short, a header line of raw bytes. Seeded
(PINLOAD_FUZZ_SEED, PINLOAD_FUZZ_CASES) and bounded: a failing case names its seed and plan."""

import json
import os
import random
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from safetensors.numpy import save_file

import stfiles
from raw_http import RawServer, StoreDaemon, base_env, http_answer, ranged_answer, remote_allow_args

SEED = int(os.environ.get("PINLOAD_FUZZ_SEED", "46"))
CASES = int(os.environ.get("PINLOAD_FUZZ_CASES", "160"))
# Faults fail fast: one retry, 1 ms of backoff, a 1 s stall bound.
FAST = {"PINLOAD_REMOTE_RETRIES": "1", "PINLOAD_REMOTE_RETRY_BASE_MS": "1", "PINLOAD_REMOTE_LOW_SPEED_TIME": "1",
        "PINLOAD_REMOTE_CONNECT_TIMEOUT": "2"}

HEADERS = [b"Content-Range", b"ETag", b"Content-Length", b"Last-Modified", b"Date"]
STATUS_LINES = [b"HTTP/1.1 200 OK", b"HTTP/1.1 404 Not Found", b"HTTP/1.1 412 Precondition Failed",
                b"HTTP/1.1 416 Range Not Satisfiable", b"HTTP/1.1 500 Oops", b"HTTP/1.1 503 Slow Down",
                b"HTTP/1.1 999 What", b"HTTP/1.1 2\xff6 \xfe\xfd", b"HTTP/1.1 206", b"HTTP/9.9 206 OK",
                b"\xff\xfegarbage", b"HTTP/1.1 301 Moved", b"HTTP/1.1 304 Not Modified", b"HTTP/1.1 -206 X",
                b"HTTP/1.1 100 Continue", b"HTTP/1.0 206 Partial Content"]
ODD_BYTES = [b"\xff", b"\xfe\xfd", b"\xc3", b"\xc2\x85", b"\xed\xa0\x80", b"\xe0\x80\xaf", b"\x00", b"\x1b[31m",
             b"\x7f", b"\\", b"\x80\x81", b"\xf4\x90\x80\x80"]


def odd(rng):
    """A few bytes that are not printable UTF-8."""
    return b"".join(rng.choice(ODD_BYTES) for _ in range(rng.randrange(1, 4)))


def mutate_value(rng, value: bytes) -> bytes:
    kind = rng.randrange(7)
    if kind == 0:  # a byte that is not UTF-8 (or a control byte) somewhere in it
        at = rng.randrange(len(value) + 1)
        return value[:at] + odd(rng) + value[at:]
    if kind == 1:  # every number in it moved a little, or far
        out, digits = b"", b""
        for c in value + b" ":
            if chr(c).isdigit():
                digits += bytes([c])
                continue
            if digits:
                n = int(digits) + rng.choice([-1, 1, 7, -7, 2 ** 64, 2 ** 63 - int(digits), -2 * int(digits)])
                out += str(n).encode()
                digits = b""
            out += bytes([c])
        return out[:-1]
    if kind == 2:
        return b""
    if kind == 3:  # random bytes
        return bytes(rng.randrange(32, 256) for _ in range(rng.randrange(1, 40)))
    if kind == 4:  # cut short
        return value[:rng.randrange(len(value) + 1)]
    if kind == 5:
        return rng.choice([b"bytes */0", b"bytes 0-0/*", b"bytes 1-0/5", b"items 0-1/2", b"W/\"abc\"", b"-1",
                           b"18446744073709551616", b"bytes 0-18446744073709551615/18446744073709551616"])
    return value + odd(rng)


def make_plan(rng):
    """What goes wrong in one case: (which requests, what)."""
    which = rng.choice(["one", "from"])
    at = rng.randrange(0, 4)
    kind = rng.choice(["status", "header", "header", "header", "s3_error", "truncate", "raw_line", "chunked"])
    plan = {"which": which, "at": at, "kind": kind, "seed": rng.getrandbits(32)}
    if kind == "header":
        plan["header"] = rng.choice(HEADERS)
    return plan


def mutated(plan, data, request, etag):
    rng = random.Random(plan["seed"] * 1000 + request["n"])
    status, headers, body = ranged_answer(data, request, etag)
    kind = plan["kind"]
    if "force" in plan:  # the honest value, or S3 code, with these bytes inside
        if kind == "header":
            headers = [(n, v[:len(v) // 2] + plan["force"] + v[len(v) // 2:] if n == plan["header"] else v)
                       for n, v in headers]
            return http_answer(status, headers, body)
        code = b"AccessDenied" + plan["force"]
        body = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>' + code + b"</Code></Error>"
        return http_answer(b"HTTP/1.1 403 Forbidden", [(b"Content-Type", b"application/xml"),
                                                       (b"Content-Length", str(len(body)).encode())], body)
    if kind == "status":
        status = rng.choice(STATUS_LINES)
    elif kind == "header":
        name = plan["header"]
        present = [v for n, v in headers if n == name]
        value = mutate_value(rng, present[0] if present else b"bytes 0-0/1")
        headers = [(n, value if n == name else v) for n, v in headers]
        if not present or rng.random() < 0.2:
            headers.append((name, value))  # added, or sent twice
    elif kind == "s3_error":
        status = rng.choice([b"HTTP/1.1 403 Forbidden", b"HTTP/1.1 404 Not Found", b"HTTP/1.1 400 Bad Request",
                             b"HTTP/1.1 500 Internal Error"])
        code = rng.choice([b"AccessDenied", b"NoSuchKey", b"SignatureDoesNotMatch"]) + odd(rng)
        body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>' + code + b"</Code><Message>" + odd(rng) +
                b"</Message><Resource>/m</Resource></Error>")
        headers = [(n, v) for n, v in headers if n not in (b"Content-Length", b"Content-Range")]
        headers += [(b"Content-Type", b"application/xml"), (b"Content-Length", str(len(body)).encode())]
    elif kind == "truncate":
        body = body[:rng.randrange(len(body) + 1)]
    elif kind == "raw_line":
        headers.insert(rng.randrange(len(headers) + 1), (odd(rng) + b"X-" + odd(rng), odd(rng)))
    elif kind == "chunked":
        headers = [(n, v) for n, v in headers if n != b"Content-Length"] + [(b"Transfer-Encoding", b"chunked")]
        body = rng.choice([b"zz\r\n", b"ffffffffffffffffff\r\n", f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n",
                           odd(rng) + b"\r\n" + body])
    return http_answer(status, headers, body)


class FuzzServer:
    """Serves /c<case>/m.safetensors: honest answers, but the case's plan for the requests it names."""

    def __init__(self, data):
        self.data = data
        self.plans = {}
        self.counts = {}
        self.lock = threading.Lock()
        self.server = RawServer(self.answer)

    def answer(self, request):
        try:
            case = int(request["path"].split("/")[1][1:])
        except (IndexError, ValueError):
            return http_answer(b"HTTP/1.1 404 Not Found", [(b"Content-Length", b"0")], b"")
        with self.lock:
            n = self.counts.get(case, 0)
            self.counts[case] = n + 1
        plan = self.plans[case]
        etag = f'"{case:08x}{SEED:08x}0123456789abcdef"'.encode()  # strong; one version per case
        hit = n == plan["at"] if plan["which"] == "one" else n >= plan["at"]
        request = {**request, "n": n}
        if not hit:
            return http_answer(*ranged_answer(self.data, request, etag))
        return mutated(plan, self.data, request, etag)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Two tensors, 96 KiB: more than the 64 KiB first read, so a load asks more than once."""
    path = tmp_path_factory.mktemp("fuzz") / "m.safetensors"
    rng = np.random.default_rng(46)
    save_file({"w": rng.standard_normal(24000).astype(np.float32), "b": rng.standard_normal(5).astype(np.float16)},
              str(path))
    return path


def check(case, plan, mode, r, expected):
    where = f"case {case} ({mode}, PINLOAD_FUZZ_SEED={SEED}, plan {plan})"
    assert r.returncode in (0, 1), f"{where}: exit {r.returncode}\n{r.stderr!r}"
    try:
        err = r.stderr.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AssertionError(f"{where}: error output is not UTF-8: {e}\n{r.stderr!r}")
    assert not any(c < " " and c != "\n" or "\x7f" <= c <= "\x9f" for c in err), f"{where}: control bytes: {err!r}"
    if r.returncode == 0:
        assert r.stdout.decode().splitlines() == expected, f"{where}: exit 0 with other bytes\n{err}"
    else:
        assert err.splitlines()[-1].startswith("pinload: error: "), f"{where}: {err!r}"


def test_server_answers_fuzzed(tmp_path, pinload_bin, model):
    expected = stfiles.expected_digest(model)
    fuzz = FuzzServer(model.read_bytes())
    env = base_env(**FAST)
    daemon = StoreDaemon(pinload_bin, tmp_path, "--budget", "512M",
                         *remote_allow_args(pinload_bin, fuzz.server.url + "/"), env=env).start()
    rng = random.Random(SEED)
    # Defect 2's three: a byte >= 0x80 in Content-Range, ETag and an S3 <Code>, on every request
    # after the two header reads (the daemon's fetch, and the client's own read after it).
    fixed = [{"which": "from", "at": 2, "kind": "header", "header": b"Content-Range", "seed": 1, "force": b"\xff"},
             {"which": "from", "at": 2, "kind": "header", "header": b"ETag", "seed": 2, "force": b"\xff"},
             {"which": "from", "at": 2, "kind": "s3_error", "seed": 3, "force": b"\xff"}]
    plans = fixed + [make_plan(rng) for _ in range(CASES)]
    for case, plan in enumerate(plans):
        fuzz.plans[2 * case] = fuzz.plans[2 * case + 1] = plan  # one case number per mode: fresh counts

    def run(case, store):
        url = f"{fuzz.server.url}/c{2 * case + store}/m.safetensors"
        cmd = [pinload_bin, "load", "--digest", "-q", "--connections", "2"] + (["--store", daemon.socket] if store else [])
        return subprocess.run(cmd + [url], capture_output=True, env=env, timeout=60)

    try:
        with ThreadPoolExecutor(4) as pool:
            runs = {(case, store): pool.submit(run, case, store) for case in range(len(plans)) for store in (0, 1)}
            for (case, store), future in runs.items():
                r = future.result()
                check(case, plans[case], "through the store" if store else "direct", r, expected)
                assert daemon.alive(), f"the daemon died ({daemon.proc.returncode}) at case {case}, plan {plans[case]}"
                if case < len(fixed):  # the server's 0xff reaches the message escaped
                    assert r.returncode == 1 and b"\\xff" in r.stderr, r.stderr
        status = subprocess.run([pinload_bin, "store", "status", "--socket", daemon.socket, "--json"],
                                capture_output=True, env=env, timeout=30)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["misses"] > 0  # the daemon fetched: its own fetches were fuzzed too
    finally:
        daemon.stop()
        fuzz.server.stop()
