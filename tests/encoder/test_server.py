"""``pinload encoder serve`` as a real process: answers against local encoding, batching, the cache,
bad requests, metrics, overload, restart and failure."""

import json
import subprocess
import sys
import threading
import time

import pytest
import torch
import urllib3
from safetensors.torch import load as st_load

from pinload.encoder import (EncoderBadRequestError, EncoderClient, EncoderOverloadedError,
                             EncoderUnavailableError)
from pinload.encoder.model import EncodeSpec, Encoder, stack

PROMPTS = ["a cat", "a photo of a cat sitting on a red chair in the sun", "dog",
           "an oil painting of a lighthouse on a cliff at night with stars and a small boat on the sea"]


def close(a, b, tol=1e-5):
    """Equal within ``tol`` of the largest magnitude (fp32)."""
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
    return float((a - b).abs().max()) <= tol * scale


def post(url, body, content_type="application/json"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return urllib3.request("POST", url + "/v1/encode", body=data, headers={"Content-Type": content_type},
                           retries=False, timeout=60)


def metric(url, name):
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib3.request("GET", url + "/metrics", timeout=10).data.decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    return 0.0


@pytest.fixture(scope="module")
def local_t5(models):
    """The same T5 through plain transformers (not pinload): the reference."""
    from transformers import AutoTokenizer, T5EncoderModel

    flux = models["flux"]
    return (T5EncoderModel.from_pretrained(str(flux / "text_encoder_2")).eval(),
            AutoTokenizer.from_pretrained(str(flux / "tokenizer_2")))


def reference(local_t5, prompts, max_length, longest=False):
    model, tok = local_t5
    enc = tok(prompts, padding="longest" if longest else "max_length", max_length=max_length, truncation=True,
              return_tensors="pt")
    with torch.inference_mode():
        out = model(enc.input_ids, attention_mask=enc.attention_mask if longest else None).last_hidden_state
    return out, enc.attention_mask


def test_health_and_ready(servers):
    url = servers["main"].url
    assert urllib3.request("GET", url + "/healthz").status == 200
    r = urllib3.request("GET", url + "/readyz")
    assert r.status == 200
    info = json.loads(r.data)
    assert info["class"] == "T5EncoderModel" and info["load_path"] == "skip_init" and info["dtype"] == "float32"
    assert len(info["encoder"]) == 64


def test_server_equals_local_encoding(servers, local_t5):
    client = EncoderClient(servers["main"].url)
    out = client.encode(PROMPTS, max_length=32)
    ref, mask = reference(local_t5, PROMPTS, 32)
    assert out.embeddings.shape == ref.shape == (4, 32, 32) and out.embeddings.dtype == torch.float32
    assert close(out.embeddings, ref), float((out.embeddings - ref).abs().max())
    assert torch.equal(out.attention_mask, mask.to(torch.int64))
    assert out.pooled is None and out.metadata["dtype"] == "float32"
    # "longest": each prompt's own tokens, the rest zero
    out = client.encode(PROMPTS, max_length=32, padding="longest")
    ref, mask = reference(local_t5, PROMPTS, 32, longest=True)
    assert torch.equal(out.attention_mask, mask.to(torch.int64))
    assert close(out.embeddings, ref * mask[..., None])


def test_batches_equal_single_prompts(servers, models):
    """Concurrent one-prompt requests are encoded in batches (the metrics show it); each answer
    equals the prompt encoded alone, within 1e-5 of the largest magnitude, in both padding modes."""
    url = servers["main"].url
    alone = Encoder.load(str(models["flux"]))
    for padding in ("longest", "max_length"):
        prompts = [f"{p} number {i} {padding}" for i, p in enumerate(PROMPTS * 3)]
        calls0, prompts0 = metric(url, "pinload_encoder_batch_size_count"), metric(url, "pinload_encoder_batch_size_sum")
        barrier = threading.Barrier(len(prompts))
        results = [None] * len(prompts)
        client = EncoderClient(url)

        def one(i):
            barrier.wait()
            results[i] = client.encode([prompts[i]], max_length=24, padding=padding)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        calls = metric(url, "pinload_encoder_batch_size_count") - calls0
        encoded = metric(url, "pinload_encoder_batch_size_sum") - prompts0
        assert encoded == len(prompts) and calls < encoded, (calls, encoded)  # some batch held several
        spec = EncodeSpec(max_length=24, padding=padding)
        for p, r in zip(prompts, results):
            single = stack(alone.encode([p], spec))
            assert torch.equal(r.attention_mask, single["attention_mask"])
            assert close(r.embeddings, single["embeddings"]), (p, float((r.embeddings - single["embeddings"]).abs().max()))
        # one request of several prompts against the same prompts alone
        many = client.encode(prompts[:5], max_length=24, padding=padding)
        for i, p in enumerate(prompts[:5]):
            n = int(results[i].attention_mask.sum()) if padding == "longest" else 24
            assert close(many.embeddings[i, :n], results[i].embeddings[0, :n])
            assert not many.embeddings[i, n:].any()


def test_cache_hits_are_bit_identical(servers):
    url = servers["main"].url
    body = {"prompts": ["a cached prompt", "another cached prompt", "a cached prompt"], "max_length": 16}
    hits0 = metric(url, "pinload_encoder_cache_hits_total")
    first, second = post(url, body), post(url, body)
    assert first.status == second.status == 200
    assert first.headers["X-Pinload-Cache-Hits"] == "0" and second.headers["X-Pinload-Cache-Hits"] == "3"
    assert first.data == second.data  # the same bytes, tensors and header
    assert metric(url, "pinload_encoder_cache_hits_total") - hits0 == 3
    a, b = st_load(first.data), st_load(second.data)
    assert torch.equal(a["embeddings"][0], a["embeddings"][2])
    # another max length is another key
    third = post(url, dict(body, max_length=17))
    assert third.headers["X-Pinload-Cache-Hits"] == "0"


BAD = [
    ({"prompts": []}, 400, "empty_prompts"),
    ({"prompts": ["a"] * 9}, 400, "too_many_prompts"),
    ({"prompts": ["a" * 201]}, 400, "prompt_too_long"),
    ({"prompts": ["a cat sat " * 10], "max_length": 8, "options": {"truncation": False}}, 400, "prompt_too_long"),
    ({"prompts": "a cat"}, 400, "invalid_type"),
    ({"prompts": ["a", 1]}, 400, "invalid_type"),
    ({"prompts": [None]}, 400, "invalid_type"),
    ({"prompts": ["a"], "max_length": "8"}, 400, "invalid_type"),
    ({"prompts": ["a"], "max_length": True}, 400, "invalid_type"),
    ({"prompts": ["a"], "max_length": 0}, 400, "max_length_out_of_range"),
    ({"prompts": ["a"], "max_length": 100000}, 400, "max_length_out_of_range"),
    ({"prompts": ["a"], "options": []}, 400, "invalid_type"),
    ({"prompts": ["a"], "options": {"padding": "left"}}, 400, "invalid_option"),
    ({"prompts": ["a"], "options": {"truncation": "yes"}}, 400, "invalid_type"),
    ({"prompts": ["a"], "options": {"hidden_layer": 99}}, 400, "invalid_option"),
    ({"prompts": ["a"], "options": {"colour": 1}}, 400, "unknown_option"),
    ({"prompt": ["a"]}, 400, "unknown_field"),
    ({"max_length": 8}, 400, "missing_field"),
    ([1, 2], 400, "invalid_type"),
    (b"{not json", 400, "invalid_json"),
    (b"\xff\xfe", 400, "invalid_json"),
]


@pytest.mark.parametrize("body,status,kind", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_requests(servers, body, status, kind):
    r = post(servers["main"].url, body)
    assert r.status == status, r.data
    error = json.loads(r.data)["error"]
    assert error["type"] == kind and error["message"]


def test_bad_requests_http_level(servers):
    url = servers["main"].url
    r = post(url, b'{"prompts": ["a"]}', content_type="text/plain")
    assert r.status == 415 and json.loads(r.data)["error"]["type"] == "unsupported_media_type"
    r = post(url, b'{"prompts": ["' + b"a" * (5 << 20) + b'"]}')
    assert r.status == 413 and json.loads(r.data)["error"]["type"] == "body_too_large"
    r = urllib3.request("GET", url + "/v1/encode")
    assert r.status == 405 and json.loads(r.data)["error"]["type"] == "method_not_allowed"
    r = urllib3.request("GET", url + "/v2/nothing")
    assert r.status == 404 and json.loads(r.data)["error"]["type"] == "not_found"
    # the client's typed error, not retried
    client = EncoderClient(url)
    with pytest.raises(EncoderBadRequestError) as e:
        client.encode([])
    assert e.value.status == 400 and e.value.kind == "empty_prompts"
    assert isinstance(e.value, ValueError)
    assert client.encode(["still serving"], max_length=8).embeddings.shape == (1, 8, 32)


def test_metrics_prometheus_text(servers):
    from prometheus_client.parser import text_string_to_metric_families

    url = servers["main"].url
    EncoderClient(url).encode(["for the metrics"], max_length=8)
    r = urllib3.request("GET", url + "/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.data.decode())}
    for name, kind in [("pinload_encoder_requests", "counter"), ("pinload_encoder_batch_size", "histogram"),
                       ("pinload_encoder_cache_hits", "counter"), ("pinload_encoder_request_seconds", "histogram"),
                       ("pinload_encoder_queue_prompts", "gauge"), ("pinload_encoder_cache_bytes", "gauge")]:
        assert families[name].type == kind, name
    codes = {s.labels["code"] for s in families["pinload_encoder_requests"].samples if s.labels.get("endpoint") == "/v1/encode"}
    assert "200" in codes


def test_overload_sheds_with_429(servers):
    """The small server queues at most 4 prompts and encodes one at a time: 16 clients sending 4
    new prompts each at once overflow it. Those answered 429 come back at once, not after a wait;
    every other request is answered."""
    url = servers["small"].url
    client = EncoderClient(url, retries=0, timeout=60)
    barrier = threading.Barrier(16)
    outcomes = [None] * 16

    def one(i):
        barrier.wait()
        t0 = time.perf_counter()
        try:
            client.encode([f"overload {i} {j}" for j in range(4)], max_length=16)
            outcomes[i] = ("ok", time.perf_counter() - t0)
        except EncoderOverloadedError as e:
            outcomes[i] = ("429", time.perf_counter() - t0, e.status)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(o is not None for o in outcomes), outcomes
    shed = [o for o in outcomes if o[0] == "429"]
    assert shed and len(shed) < 16, outcomes
    assert all(o[2] == 429 for o in shed)
    assert metric(url, "pinload_encoder_rejected_total") >= len(shed)
    # a raw 429 has the JSON error and Retry-After: 16 raw requests at once, as above
    r = None
    for attempt in range(20):  # prompts new each time: cached ones are never queued
        start = threading.Barrier(16)
        rs = []

        def raw(k):
            start.wait()
            rs.append(post(url, {"prompts": [f"raw {attempt} {k} {j}" for j in range(4)], "max_length": 16}))

        ts = [threading.Thread(target=raw, args=(k,)) for k in range(16)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        r = next((x for x in rs if x.status == 429), None)
        if r is not None:
            break
    assert r is not None
    assert json.loads(r.data)["error"]["type"] == "overloaded" and r.headers["Retry-After"] == "1"
    patient = EncoderClient(url, retries=20, backoff=0.05)
    threads = [threading.Thread(target=lambda i=i: patient.encode([f"patient {i} {j}" for j in range(4)],
                                                                   max_length=16)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def test_server_down_typed_error_and_fallback(models):
    from conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"
    client = EncoderClient(url, retries=2, backoff=0.01, timeout=2)
    t0 = time.perf_counter()
    with pytest.raises(EncoderUnavailableError) as e:
        client.encode(["a cat"])
    assert time.perf_counter() - t0 < 5 and isinstance(e.value, ConnectionError)
    local = Encoder.load(str(models["t5"]))
    fallback = EncoderClient(url, retries=1, backoff=0.01, fallback=lambda: local)
    out = fallback.encode(["a cat"], max_length=8)
    assert out.local and fallback.fallback_used == 1
    assert torch.equal(out.embeddings, stack(local.encode(["a cat"], EncodeSpec(max_length=8)))["embeddings"])


def test_client_survives_server_restart(servers):
    """A client keeps encoding while the server is killed (SIGKILL) and started again on its port:
    every call returns, with the same embeddings as before; then SIGTERM stops the server cleanly."""
    server = servers["small"]
    client = EncoderClient(server.url, retries=400, backoff=0.05, max_backoff=0.5, timeout=30)
    before = client.encode(["restart probe"], max_length=16).embeddings
    done, errors, answers = threading.Event(), [], []

    def loop():
        i = 0
        while not done.is_set():
            try:
                out = client.encode([f"during restart {i}"], max_length=16)
                answers.append((time.monotonic(), out))  # when it returned
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            i += 1

    t = threading.Thread(target=loop)
    t.start()
    time.sleep(0.5)
    server.kill()
    killed = time.monotonic()
    server.start()
    server.wait_ready()
    time.sleep(0.5)
    done.set()
    t.join(120)
    assert not errors, errors
    assert any(when > killed for when, _ in answers)
    after = client.encode(["restart probe"], max_length=16)
    assert close(after.embeddings, before, tol=0) or torch.equal(after.embeddings, before)
    assert server.stop() == 0
    assert "stopped in" in server.log.read_text()


def test_cli_usage_and_load_failure(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pinload", "encoder", "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage: pinload encoder serve" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pinload", "encoder", "serve", "--model", str(tmp_path / "none"),
                        "--max-prompts", "9", "--max-queue", "4"], capture_output=True, text=True)
    assert r.returncode == 2 and "--max-prompts 9 is more than --max-queue 4" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pinload", "encoder", "serve", "--model", str(tmp_path / "none"),
                        "--port", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "no such encoder folder" in r.stderr
