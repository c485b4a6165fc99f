"""The encoder server against hostile input (issue 46, items 10 and 11): a prompt the tokenizer
refuses fails its own request only; a batch that fails is encoded apart; pathological JSON gets a
typed 400; connections that send slowly or nothing neither keep a normal request out nor stay open
past their timeout, even beyond the server's descriptor limit."""

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import urllib3
from safetensors.torch import load as st_load

from pinload.encoder import EncoderClient
from pinload.encoder.model import EncodeSpec, Encoder, stack

PROMPTS = ["a cat", "a photo of a cat sitting on a red chair in the sun", "dog", "a lighthouse at night",
           "an oil painting of a boat", "two birds on a wire", "snow on a mountain", "a red car",
           "a bowl of fruit", "a city street in the rain", "a child with a kite", "a quiet forest path"]


def close(a, b, tol=1e-5):
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
    return float((a - b).abs().max()) <= tol * scale


def raw_post(url, data: bytes, content_type="application/json"):
    return urllib3.request("POST", url + "/v1/encode", body=data, headers={"Content-Type": content_type},
                           retries=False, timeout=60)


@pytest.fixture(scope="module")
def alone(models):
    return Encoder.load(str(models["flux"]))


def test_bad_prompt_fails_only_its_own_request(servers, alone):
    """12 normal requests and one whose prompt is JSON's "\\ud800" (a lone surrogate) sent at once,
    twice over: the 12 get their embeddings (equal to each prompt encoded alone), the bad one a 400
    naming the prompt. Old code: the tokenizer failed the whole batch, 500 for up to all 12."""
    url = servers["main"].url
    spec = EncodeSpec(max_length=24)
    for round_ in range(2):
        prompts = [f"{p} {round_}" for p in PROMPTS]
        barrier = threading.Barrier(len(prompts) + 1)
        results, bad = [None] * len(prompts), []
        client = EncoderClient(url, retries=0)

        def one(i):
            barrier.wait()
            try:
                results[i] = client.encode([prompts[i]], max_length=24)
            except Exception as e:  # noqa: BLE001 - reported below
                results[i] = e

        def poison():
            barrier.wait()
            bad.append(raw_post(url, b'{"prompts": ["a cat \\ud800 on a chair"], "max_length": 24}'))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        threads.append(threading.Thread(target=poison))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [(p, r) for p, r in zip(prompts, results) if isinstance(r, Exception)]
        assert not failed, failed
        for p, r in zip(prompts, results):
            single = stack(alone.encode([p], spec))
            assert close(r.embeddings, single["embeddings"]), p
        r = bad[0]
        assert r.status == 400 and r.headers["Content-Type"].startswith("application/json"), (r.status, r.data[:200])
        err = json.loads(r.data)["error"]
        assert err["type"] == "invalid_prompt" and err["index"] == 0 and "surrogate" in err["message"], err


def test_a_failing_batch_is_encoded_apart(models, alone):
    """The Batcher with the real encoder, made to raise on any batch holding one prompt: that prompt
    alone gets encoder_failed (500), the 9 others their results, equal to each encoded alone. Old
    code: all 10 failed with the batch."""
    from pinload.encoder.cache import EmbeddingCache
    from pinload.encoder.server import Batcher, Metrics, RequestError

    class Failing:
        def __init__(self, inner):
            self.inner, self.identity, self.calls = inner, inner.identity, []

        def encode(self, prompts, spec):
            self.calls.append(len(prompts))
            if "poison" in prompts:
                raise RuntimeError("injected: the encoder raised on this batch")
            return self.inner.encode(prompts, spec)

    prompts = [f"prompt number {i}" for i in range(9)]
    prompts.insert(6, "poison")
    spec = EncodeSpec(max_length=16)
    encoder = Failing(alone)

    async def run():
        b = Batcher(encoder, EmbeddingCache(1 << 20), Metrics(), max_batch=32, window_s=0.05)
        b.start()
        try:
            return await asyncio.gather(*(b.submit([p], spec) for p in prompts), return_exceptions=True)
        finally:
            await b.stop()

    out = asyncio.run(run())
    assert encoder.calls[0] == len(prompts)  # one batch first
    for p, r in zip(prompts, out):
        if p == "poison":
            assert isinstance(r, RequestError) and r.status == 500 and r.kind == "encoder_failed", r
            assert "injected" in str(r)
        else:
            assert not isinstance(r, BaseException), (p, r)
            single = alone.encode([p], spec)[0]
            assert close(r[0][0]["embeddings"], single["embeddings"]), p
    assert len(encoder.calls) <= 1 + 2 * 4  # halves, not one call per prompt


def test_max_length_below_the_special_tokens_is_a_400(models):
    """CLIP adds BOS and EOS: with max_length 1 the tokenizer cannot truncate, and a batch of prompts
    of different lengths fails (old code: 500 encoder_failed for every request in it). Now the
    request is refused with 400 max_length_out_of_range before it is queued; 2 is taken."""
    from pinload.encoder.server import RequestError, build_parser, parse_request

    clip = Encoder.load(str(models["clip"]))
    args = build_parser().parse_args(["--model", "unused"])
    with pytest.raises(Exception):  # what the old server queued: the encoder raises
        clip.encode(["a cat", "a photo of a dog on a red chair"], EncodeSpec(max_length=1))
    with pytest.raises(RequestError) as e:
        parse_request({"prompts": ["a cat"], "max_length": 1}, clip, args)
    assert e.value.status == 400 and e.value.kind == "max_length_out_of_range" and "2.." in str(e.value)
    prompts, spec = parse_request({"prompts": ["a cat", "a photo of a dog on a red chair"], "max_length": 2},
                                  clip, args)
    assert [r["embeddings"].shape[0] for r in clip.encode(prompts, spec)] == [2, 2]


def test_pathological_json_is_a_typed_400(servers):
    """100k-deep nesting: a JSON 400 invalid_json (old code: a text/plain 500 from RecursionError);
    an unknown charset parameter does not turn a valid body into a 500."""
    url = servers["main"].url
    r = raw_post(url, b"[" * 100000 + b"]" * 100000)
    assert r.status == 400 and r.headers["Content-Type"].startswith("application/json"), (r.status, r.data[:200])
    assert json.loads(r.data)["error"]["type"] == "invalid_json"
    r = raw_post(url, b'{"prompts": {"a": ' * 50000 + b"1" + b"}" * 100000)
    assert r.status == 400 and json.loads(r.data)["error"]["type"] == "invalid_json"
    r = raw_post(url, json.dumps({"prompts": ["a cat"], "max_length": 8}).encode(),
                 content_type="application/json; charset=no-such-charset")
    assert r.status == 200, (r.status, r.data[:200])
    assert st_load(r.data)["embeddings"].shape[:2] == (1, 8)


NOFILE = 320  # the server's soft descriptor limit: its default --max-connections is this less 256
SLOW = 400  # more connections than the server may hold descriptors


def _start(models, tmp_path):
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    number = port.getsockname()[1]
    port.close()
    log = open(tmp_path / "robust-server.log", "wb")

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = subprocess.Popen([sys.executable, "-m", "pinload", "encoder", "serve", "--model", str(models["t5"]),
                             "--host", "127.0.0.1", "--port", str(number), "--threads", "1",
                             "--header-timeout", "2", "--body-timeout", "2"],
                            stdout=log, stderr=log, env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=limit)
    url = f"http://127.0.0.1:{number}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "robust-server.log").read_text()
        try:
            if urllib3.request("GET", url + "/readyz", retries=False, timeout=2).status == 200:
                return proc, url, number
        except urllib3.exceptions.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError((tmp_path / "robust-server.log").read_text())


def _closed_by_server(s: socket.socket, deadline: float) -> bool:
    """Reads until the server closes the connection (EOF or reset) or the deadline passes."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        s.settimeout(left)
        try:
            if not s.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False


def test_slow_connections_neither_block_nor_stay(models, tmp_path):
    """400 connections to a server whose descriptor limit is 320: a third send half a request line
    and headers, a third complete headers and part of a body, a third nothing. A normal request
    then gets its answer at once (no retry), and every slow connection is closed by the server
    within its 2 s timeout (plus slack). Old code: the server ran out of descriptors, the normal
    request timed out, and the slow connections stayed open (aiohttp's timer: 3630 s)."""
    proc, url, port = _start(models, tmp_path)
    slow = []
    try:
        opened = time.monotonic()
        for i in range(SLOW):
            s = socket.create_connection(("127.0.0.1", port))
            if i % 3 == 0:
                s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
            elif i % 3 == 1:
                s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompts\": [")
            slow.append(s)
        client = EncoderClient(url, retries=0, timeout=20)
        out = client.encode(["a cat on a chair"], max_length=16)
        assert out.embeddings.shape[:2] == (1, 16)
        served = time.monotonic() - opened
        deadline = time.monotonic() + 2 + 10
        still_open = [i for i, s in enumerate(slow) if not _closed_by_server(s, deadline)]
        assert not still_open, f"{len(still_open)} slow connections still open {time.monotonic() - opened:.1f} s on"
        # and the server still answers afterwards
        assert EncoderClient(url, retries=0).encode(["a dog"], max_length=8).embeddings.shape[:2] == (1, 8)
        assert served < 20
    finally:
        for s in slow:
            s.close()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = (tmp_path / "robust-server.log").read_text()
    assert "Traceback" not in log and "Too many open files" not in log, log[-3000:]
