"""``pinload encoder serve``: one text encoder (T5, CLIP) served over HTTP to every pipeline of a node.

    pinload encoder serve --model /models/flux-dev --port 8471        # the pipeline's T5 (text_encoder_2)
    python -m pinload encoder serve --model /models/t5-v1_1-xxl --dtype bf16

aiohttp serves; prometheus_client writes /metrics. docs/encoder.md has the API, the cache key and
the failure behaviour.

Note [Dynamic batching]
A request's prompts are looked up in the cache (a hit is answered from it), joined to an identical
prompt already being encoded (in flight), or queued. One task takes queued prompts in batches: it
waits for the first, then up to ``--batch-window`` (5 ms) for more, up to ``--max-batch``; prompts
with another encoding spec (max length, padding, ...) stay queued for the next batch. The batch is
encoded on the encoder's own thread while the loop keeps accepting requests, so a busy encoder
makes the next batch larger. The queue is bounded (``--max-queue`` prompts): a request that does
not fit is answered 429 at once, with Retry-After, not left waiting. Each prompt's result is split
from the batch and copied (Note [Encoding modes] in model.py), so the cache holds only its bytes.

Note [A failing batch]
A prompt is checked before it is queued (a string, within the limits, valid Unicode: JSON's
``"\\ud800"`` decodes to a lone surrogate, which the tokenizer refuses), so a bad prompt fails its own
request with a 400. If the encoder raises on a batch anyway, the batch is split in halves and each
half encoded again, down to single prompts: only the prompts that fail alone get the 500, every
other one its result (which does not depend on the batch, Note [Encoding modes]). One failing
prompt in a batch of n costs about 2 log2(n) more encoder calls, not n; a batch too large for the
device's memory is encoded in parts the same way.

Note [Slow and idle connections]
Each connection must deliver a request's headers within ``--header-timeout`` of opening or of its
previous answer (aiohttp's keep-alive timer, which closes a connection that has no complete request
when it fires: partly sent headers, or idle), and a request's body within ``--body-timeout`` (408
``body_timeout``). At most ``--max-connections`` are open (default: the soft descriptor limit less
256, which leaves room for a burst of accepts, the model's files and the log). When a new connection
would pass the limit, the connection that has waited longest for a request of its own is closed to
make room (one sending headers or a body, idle between requests, or not reading its answer); only
connections whose request the encoder is working on are never closed so, and when every connection
is one of those the new one is answered 503 ``too_many_connections`` and closed. So connections that
send nothing, or send slowly, neither exhaust the descriptors nor keep a normal request out, and
each is closed after its timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .cache import EmbeddingCache, cache_key
from .model import DTYPES, EncodeSpec, Encoder, stack

log = logging.getLogger("pinload.encoder")

__all__ = ["main", "make_app", "Batcher", "Overloaded", "ConnectionLimit"]

PADDINGS = ("max_length", "longest")
OPTIONS = ("padding", "truncation", "hidden_layer")


class Overloaded(Exception):
    pass


class RequestError(Exception):
    """A bad request: answered with ``status`` and ``{"error": {"type": kind, "message": ...}}``."""

    def __init__(self, status: int, kind: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.kind, self.extra = status, kind, extra


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()

        r = self.registry = CollectorRegistry()
        p = "pinload_encoder_"
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status code", ["endpoint", "code"],
                                registry=r)
        self.prompts = Counter(p + "prompts", "prompts asked for", registry=r)
        self.cache_hits = Counter(p + "cache_hits", "prompts answered from the embedding cache", registry=r)
        self.cache_misses = Counter(p + "cache_misses", "prompts not in the embedding cache", registry=r)
        self.joined = Counter(p + "inflight_joins", "prompts joined to the same prompt being encoded", registry=r)
        self.rejected = Counter(p + "rejected", "requests shed with 429 (queue full)", registry=r)
        self.batch_size = Histogram(p + "batch_size", "prompts per encoder call", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.latency = Histogram(p + "request_seconds", "POST /v1/encode latency", registry=r,
                                 buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30))
        self.encode_seconds = Histogram(p + "encode_seconds", "time of one encoder call (a batch)", registry=r,
                                        buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30))
        self.queue = Gauge(p + "queue_prompts", "prompts waiting for the encoder", registry=r)
        self.cache_bytes = Gauge(p + "cache_bytes", "bytes held by the embedding cache", registry=r)
        self.cache_entries = Gauge(p + "cache_entries", "prompts held by the embedding cache", registry=r)
        self.ready = Gauge(p + "ready", "1 once the encoder is loaded and serving", registry=r)


class Batcher:
    """Note [Dynamic batching]."""

    def __init__(self, encoder: Encoder, cache: EmbeddingCache, metrics: Metrics, *, max_batch: int = 32,
                 window_s: float = 0.005, max_queue: int = 1024) -> None:
        self.encoder, self.cache, self.metrics = encoder, cache, metrics
        self.max_batch, self.window_s, self.max_queue = max_batch, window_s, max_queue
        self._queue: "collections.deque[Tuple[str, str, EncodeSpec, asyncio.Future]]" = collections.deque()
        self._inflight: Dict[str, asyncio.Future] = {}
        self._wake = asyncio.Event()
        # One thread runs the encoder: torch spreads each call over its own intra-op threads.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pinload-encoder")
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for _, _, _, fut in self._queue:
            if not fut.done():
                fut.set_exception(RequestError(503, "shutting_down", "the server is shutting down"))
        self._queue.clear()
        self._executor.shutdown(wait=True)

    async def submit(self, prompts: Sequence[str], spec: EncodeSpec) -> Tuple[List[Dict[str, Any]], int]:
        """The results of ``prompts`` (one dict each) and how many came from the cache."""
        loop = asyncio.get_running_loop()
        identity = self.encoder.identity
        keys = [cache_key(identity, spec, p) for p in prompts]
        results: List[Any] = [None] * len(prompts)
        waits: List[Tuple[int, asyncio.Future]] = []
        new: Dict[str, List[int]] = {}
        hits = 0
        for i, k in enumerate(keys):
            value = self.cache.get(k)
            if value is not None:
                results[i] = value
                hits += 1
            elif k in self._inflight:
                waits.append((i, self._inflight[k]))
                self.metrics.joined.inc()
            else:
                new.setdefault(k, []).append(i)
        self.metrics.prompts.inc(len(prompts))
        self.metrics.cache_hits.inc(hits)
        self.metrics.cache_misses.inc(len(prompts) - hits)
        if len(self._queue) + len(new) > self.max_queue:
            raise Overloaded(f"{len(self._queue)} prompts queued, {len(new)} more would pass --max-queue "
                             f"{self.max_queue}")
        for k, idx in new.items():
            fut = loop.create_future()
            # A request stops at its first failed prompt: the others' errors count as retrieved.
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._inflight[k] = fut
            self._queue.append((k, prompts[idx[0]], spec, fut))
            waits += [(i, fut) for i in idx]
        if new:
            self.metrics.queue.set(len(self._queue))
            self._wake.set()
        for i, fut in waits:
            results[i] = await asyncio.shield(fut)
        return results, hits

    def _take(self) -> List[Tuple[str, str, EncodeSpec, asyncio.Future]]:
        spec = self._queue[0][2]
        batch, rest = [], collections.deque()
        while self._queue and len(batch) < self.max_batch:
            item = self._queue.popleft()
            (batch if item[2] == spec else rest).append(item)
        rest.extend(self._queue)
        self._queue = rest
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            deadline = loop.time() + self.window_s
            while len(self._queue) < self.max_batch:
                left = deadline - loop.time()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch = self._take()
            self.metrics.queue.set(len(self._queue))
            out = await self._encode_apart(loop, batch)
            for (k, _, _, fut), value in zip(batch, out):
                self._inflight.pop(k, None)
                if isinstance(value, BaseException):
                    if not fut.done():
                        fut.set_exception(RequestError(500, "encoder_failed", f"{type(value).__name__}: {value}"))
                    continue
                self.cache.put(k, value)
                if not fut.done():
                    fut.set_result(value)
            self.metrics.cache_bytes.set(self.cache.bytes)
            self.metrics.cache_entries.set(len(self.cache))

    async def _encode_apart(self, loop: asyncio.AbstractEventLoop, batch: List[Tuple[str, str, EncodeSpec, Any]],
                            ) -> List[Any]:
        """Each prompt's result, or the exception that encoding it alone raised (Note [A failing batch])."""
        self.metrics.batch_size.observe(len(batch))
        t0 = time.perf_counter()
        try:
            out = await loop.run_in_executor(self._executor, self.encoder.encode, [b[1] for b in batch], batch[0][2])
        except Exception as e:
            if len(batch) == 1:
                log.error("encoding a prompt failed: %s: %s", type(e).__name__, e)
                return [e]
            log.warning("encoding a batch of %d prompts failed (%s: %s): encoding its halves apart", len(batch),
                        type(e).__name__, e)
            half = len(batch) // 2
            return await self._encode_apart(loop, batch[:half]) + await self._encode_apart(loop, batch[half:])
        self.metrics.encode_seconds.observe(time.perf_counter() - t0)
        return list(out)


class ConnectionLimit:
    """Note [Slow and idle connections]: the open connections, those waiting for a request of their own
    (evictable, the longest waiting first) and those whose request is being encoded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0  # admitted and not yet closed (an evicted one stops counting when it is closed)
        self.evicted = 0
        self.refused = 0
        self._logged = (0.0, 0)  # when the last warning was written, and the evictions then
        self._waiting: "collections.OrderedDict[_Guard, None]" = collections.OrderedDict()
        self._by_handler: Dict[Any, "_Guard"] = {}

    def admit(self, guard: "_Guard") -> bool:
        if self.open >= self.limit:
            if not self._waiting:
                self.refused += 1
                return False
            oldest, _ = self._waiting.popitem(last=False)
            self.evicted += 1
            oldest.counted = False
            self.open -= 1
            oldest.evict()
            now = time.monotonic()
            if now - self._logged[0] >= 10:
                log.warning("%d connections open (--max-connections): closed %d waiting longest for a request "
                            "to make room", self.limit, self.evicted - self._logged[1])
                self._logged = (now, self.evicted)
        self.open += 1
        self._waiting[guard] = None
        return True

    def register(self, guard: "_Guard", handler: Any) -> None:
        self._by_handler[handler] = guard

    def gone(self, guard: "_Guard") -> None:
        if guard.handler is not None:
            self._by_handler.pop(guard.handler, None)
        if guard.counted:
            guard.counted = False
            self.open -= 1
        self._waiting.pop(guard, None)

    def working(self, handler: Any, busy: bool) -> None:
        """``busy``: the connection's request is being encoded (not evictable); else it waits again."""
        guard = self._by_handler.get(handler)
        if guard is None or not guard.counted:
            return
        self._waiting.pop(guard, None)
        if not busy:
            self._waiting[guard] = None


_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
         b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s")


class _Guard(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the ConnectionLimit."""

    def __init__(self, limit: ConnectionLimit, make: Any) -> None:
        self.limit, self.handler, self.transport, self.counted = limit, None, None, False
        self._make = make

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if not self.limit.admit(self):
            body = json.dumps({"error": {"type": "too_many_connections", "message": f"{self.limit.open} connections "
                               "open, each with a request being encoded (--max-connections)"}}).encode()
            transport.write(_BUSY % (len(body), body))
            transport.close()
            return
        self.counted = True
        self.handler = self._make()
        self.limit.register(self, self.handler)
        self.handler.connection_made(transport)

    def evict(self) -> None:
        if self.transport is not None:  # abort: close() would wait to flush an answer nobody reads
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.handler.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.limit.gone(self)
        if self.handler is not None:
            self.handler.connection_lost(exc)
        self.transport = None


def _error(status: int, kind: str, message: str, headers: Optional[Dict[str, str]] = None, **extra: Any):
    from aiohttp import web

    body = {"error": {"type": kind, "message": message, **extra}}
    return web.json_response(body, status=status, headers=headers)


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.encoder: Optional[Encoder] = None
        self.batcher: Optional[Batcher] = None
        self.cache = EmbeddingCache(args.cache_bytes)
        self.metrics = Metrics()
        self.failed: Optional[str] = None
        self.draining = False
        self.connections: Optional[ConnectionLimit] = None


_MIN_LENGTHS: Dict[str, int] = {}


def min_max_length(encoder: Encoder) -> int:
    """The least max_length the encoder can take: the tokenizer's special tokens (CLIP's BOS and EOS:
    2), which truncation keeps; below it every prompt fails in the tokenizer."""
    n = _MIN_LENGTHS.get(encoder.identity)
    if n is None:
        try:
            with encoder._tokenizer_lock:
                n = max(1, int(encoder.tokenizer.num_special_tokens_to_add(pair=False)))
        except Exception:  # noqa: BLE001 - a tokenizer without the method: the encoder decides
            n = 1
        _MIN_LENGTHS[encoder.identity] = n
    return n


def parse_request(body: Any, encoder: Encoder, args: argparse.Namespace) -> Tuple[List[str], EncodeSpec]:
    """The prompts and spec of a /v1/encode body, or RequestError naming what is wrong."""
    if not isinstance(body, dict):
        raise RequestError(400, "invalid_type", "the body must be a JSON object")
    unknown = sorted(set(body) - {"prompts", "max_length", "options"})
    if unknown:
        raise RequestError(400, "unknown_field", f"unknown field(s) {unknown}: expected prompts, max_length, options")
    prompts = body.get("prompts")
    if prompts is None:
        raise RequestError(400, "missing_field", "'prompts' is required: a list of strings", field="prompts")
    if not isinstance(prompts, list):
        raise RequestError(400, "invalid_type", f"'prompts' must be a list of strings, not {type(prompts).__name__}",
                           field="prompts")
    if not prompts:
        raise RequestError(400, "empty_prompts", "'prompts' is empty", field="prompts")
    if len(prompts) > args.max_prompts:
        raise RequestError(400, "too_many_prompts", f"{len(prompts)} prompts: at most {args.max_prompts} per request",
                           field="prompts", limit=args.max_prompts)
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise RequestError(400, "invalid_type", f"prompts[{i}] is {type(p).__name__}, not a string",
                               field="prompts", index=i)
        if len(p) > args.max_prompt_chars:
            raise RequestError(400, "prompt_too_long", f"prompts[{i}] has {len(p)} characters: at most "
                               f"{args.max_prompt_chars}", field="prompts", index=i, limit=args.max_prompt_chars)
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as ex:  # a lone surrogate ("\ud800" in JSON): Note [A failing batch]
            raise RequestError(400, "invalid_prompt", f"prompts[{i}] is not valid Unicode: {ex.reason} "
                               f"{p[ex.start]!r} at character {ex.start}", field="prompts", index=i) from None
    limit = encoder.model_max_length
    max_length = body.get("max_length", args.default_max_length or limit)
    if not isinstance(max_length, int) or isinstance(max_length, bool):
        raise RequestError(400, "invalid_type", f"'max_length' must be an integer, not {type(max_length).__name__}",
                           field="max_length")
    low = min_max_length(encoder)
    if not low <= max_length <= limit:
        raise RequestError(400, "max_length_out_of_range", f"max_length {max_length} is not in {low}..{limit}"
                           + (f" (the tokenizer adds {low} special tokens)" if low > 1 else ""),
                           field="max_length", limit=limit)
    options = body.get("options", {})
    if not isinstance(options, dict):
        raise RequestError(400, "invalid_type", "'options' must be an object", field="options")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise RequestError(400, "unknown_option", f"unknown option(s) {unknown}: expected {', '.join(OPTIONS)}",
                           field="options")
    padding = options.get("padding", "max_length")
    if padding not in PADDINGS:
        raise RequestError(400, "invalid_option", f"options.padding {padding!r}: one of {', '.join(PADDINGS)}",
                           field="options.padding")
    truncation = options.get("truncation", True)
    if not isinstance(truncation, bool):
        raise RequestError(400, "invalid_type", "options.truncation must be true or false", field="options.truncation")
    hidden_layer = options.get("hidden_layer")
    layers = int(getattr(encoder.model.config, "num_hidden_layers", 0) or getattr(encoder.model.config, "num_layers", 0))
    if hidden_layer is not None and (not isinstance(hidden_layer, int) or isinstance(hidden_layer, bool)
                                     or not -(layers + 1) <= hidden_layer <= layers):
        raise RequestError(400, "invalid_option", f"options.hidden_layer {hidden_layer!r}: an integer in "
                           f"{-(layers + 1)}..{layers}, or null", field="options.hidden_layer")
    if not truncation:
        for i, n in enumerate(encoder.token_lengths(prompts)):
            if n > max_length:
                raise RequestError(400, "prompt_too_long", f"prompts[{i}] has {n} tokens: more than max_length "
                                   f"{max_length} (options.truncation is false)", field="prompts", index=i,
                                   limit=max_length)
    return prompts, EncodeSpec(max_length=max_length, padding=padding, truncation=truncation,
                               hidden_layer=hidden_layer)


def make_app(state: State):
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    m = state.metrics

    @web.middleware
    async def errors(request, handler):
        endpoint = request.path if request.path in ("/v1/encode", "/healthz", "/readyz", "/metrics") else "other"
        try:
            response = await handler(request)
        except web.HTTPException as e:  # aiohttp's own (404, 405, 413): with a JSON body as ours
            kind = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(e.status, "http_error")
            response = _error(e.status, kind, e.reason if e.status != 413 else e.text or e.reason)
        except RequestError as e:
            response = _error(e.status, e.kind, str(e), **e.extra)
        except Exception as e:  # a bug: still a JSON answer, and the log has the traceback
            log.exception("%s %s failed", request.method, request.path)
            response = _error(500, "internal_error", f"{type(e).__name__}: {e}")
        finally:
            if state.connections is not None:  # answered: the connection waits for a request again
                state.connections.working(request.protocol, False)
        m.requests.labels(endpoint, str(response.status)).inc()
        return response

    async def healthz(request):
        return web.json_response({"status": "alive", "pid": os.getpid()})

    async def readyz(request):
        e = state.encoder
        if state.failed:
            return _error(503, "load_failed", state.failed)
        if e is None or state.draining:
            return _error(503, "not_ready", "draining" if state.draining else "loading the encoder",
                          headers={"Retry-After": "1"})
        return web.json_response({"status": "ready", "encoder": e.identity, "model_identity": e.model_identity,
                                  "tokenizer_identity": e.tokenizer_identity, "dtype": e.dtype, "path": e.path,
                                  "class": e.info.get("class"), "load_path": e.load_path,
                                  "load_seconds": round(e.load_seconds, 3), "max_length": e.model_max_length,
                                  "cache": state.cache.stats()})

    async def metrics(request):
        m.cache_bytes.set(state.cache.bytes)
        m.cache_entries.set(len(state.cache))
        return web.Response(body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def encode(request):
        t0 = time.perf_counter()
        e, batcher = state.encoder, state.batcher
        if e is None or batcher is None or state.draining:
            return _error(503, "not_ready", "the encoder is loading" if not state.draining else "draining",
                          headers={"Retry-After": "1"})
        if request.content_type != "application/json":
            return _error(415, "unsupported_media_type",
                          f"Content-Type {request.content_type!r}: send application/json")
        try:
            raw = await asyncio.wait_for(request.read(), state.args.body_timeout)
        except (ConnectionError, RuntimeError) as ex:  # the client went (or was closed to make room)
            # aiohttp's reader raises RuntimeError("Connection closed.") once the connection is gone;
            # any other RuntimeError is a bug, logged with its traceback by the middleware.
            if isinstance(ex, RuntimeError) and request.transport is not None and not request.transport.is_closing():
                raise
            log.debug("a connection closed while sending its body")
            return _error(400, "connection_lost", "the connection closed while sending the body")
        except asyncio.TimeoutError:
            response = _error(408, "body_timeout", f"the body did not arrive within --body-timeout "
                              f"{state.args.body_timeout:g} s")
            response.force_close()
            return response
        try:
            body = json.loads(raw)  # bytes: UTF-8 (or the UTF-16/32 that RFC 8259 readers detect)
        except ValueError as ex:  # JSONDecodeError, UnicodeDecodeError
            return _error(400, "invalid_json", f"the body is not JSON: {ex}")
        except RecursionError:
            return _error(400, "invalid_json", "the body is not JSON this server reads: nested too deeply")
        prompts, spec = parse_request(body, e, state.args)
        if state.connections is not None:  # its request is being encoded: never closed to make room
            state.connections.working(request.protocol, True)
        try:
            items, hits = await batcher.submit(prompts, spec)
        except Overloaded as ex:
            m.rejected.inc()
            return _error(429, "overloaded", str(ex), headers={"Retry-After": "1"})
        # One metadata key: safetensors writes a metadata map in no fixed order, and the same request
        # must get the same bytes. Nothing in it varies between answers (cache hits go in a header).
        info = {"encoder": e.identity, "dtype": e.dtype, "max_length": spec.max_length, "padding": spec.padding}
        metadata = {"pinload.encoder": json.dumps(info, sort_keys=True)}
        payload = await asyncio.get_running_loop().run_in_executor(None, _serialize, items, metadata)
        m.latency.observe(time.perf_counter() - t0)
        return web.Response(body=payload, content_type="application/octet-stream",
                            headers={"X-Pinload-Cache-Hits": str(hits), "X-Pinload-Encoder": e.identity})

    app = web.Application(middlewares=[errors], client_max_size=state.args.max_body_bytes)
    app.router.add_post("/v1/encode", encode)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


def _serialize(items: List[Dict[str, Any]], metadata: Dict[str, str]) -> bytes:
    from safetensors.torch import save

    return save(stack(items), metadata=metadata)


def _size(text: str) -> int:
    from .. import _core

    try:
        return int(_core.parse_size(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pinload encoder serve",
                                 description="Serve a text encoder (T5, CLIP) over HTTP (docs/encoder.md).")
    ap.add_argument("--model", required=True, help="encoder folder, or a diffusers pipeline folder")
    ap.add_argument("--component", help="the pipeline's encoder folder (default: text_encoder_3 for SD3, "
                    "else text_encoder_2)")
    ap.add_argument("--tokenizer", help="tokenizer folder (default: the model's, or the pipeline's tokenizer_N)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8471, help="0: any free port (printed on stderr)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--max-batch", type=int, default=32, help="prompts per encoder call (1: no batching)")
    ap.add_argument("--batch-window", type=float, default=5.0, help="ms to wait for more prompts")
    ap.add_argument("--max-queue", type=int, default=1024, help="prompts waiting; more are answered 429")
    ap.add_argument("--max-prompts", type=int, default=64, help="prompts per request")
    ap.add_argument("--max-prompt-chars", type=int, default=20000)
    ap.add_argument("--max-body-bytes", type=_size, default=_size("4M"))
    ap.add_argument("--default-max-length", type=int, default=0, help="0: the tokenizer's model_max_length")
    ap.add_argument("--cache-bytes", type=_size, default=_size("1G"), help="embedding cache budget (0: off)")
    ap.add_argument("--header-timeout", type=float, default=15.0,
                    help="s for a connection to send a request's headers, from its start or its previous answer; "
                    "idle connections are closed after it too")
    ap.add_argument("--body-timeout", type=float, default=30.0, help="s for a request's body to arrive (408)")
    ap.add_argument("--max-connections", type=int, default=0,
                    help="open connections (0: the soft descriptor limit less 256)")
    ap.add_argument("--drain-seconds", type=float, default=10.0,
                    help="on SIGTERM, how long requests in flight may take to finish")
    ap.add_argument("--log-level", default="info")
    return ap


def _default_max_connections() -> int:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(8, soft - 256)


def _load(state: State, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    args = state.args
    try:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        encoder = Encoder.load(args.model, component=args.component, tokenizer=args.tokenizer, dtype=args.dtype,
                               device=args.device)
        low = min_max_length(encoder)
        if args.default_max_length and not low <= args.default_max_length <= encoder.model_max_length:
            raise ValueError(f"--default-max-length {args.default_max_length} is not in "
                             f"{low}..{encoder.model_max_length}")
        encoder.encode(["warm up"], EncodeSpec(max_length=min(max(8, low), encoder.model_max_length)))
    except Exception as e:
        state.failed = f"{type(e).__name__}: {e}"
        log.error("loading the encoder failed: %s", state.failed)
        loop.call_soon_threadsafe(stop.set)
        return

    def ready() -> None:
        state.batcher = Batcher(encoder, state.cache, state.metrics, max_batch=args.max_batch,
                                window_s=args.batch_window / 1000, max_queue=args.max_queue)
        state.batcher.start()
        state.encoder = encoder
        state.metrics.ready.set(1)
        log.info("ready: %s (%s, %s, %d parameters) loaded in %.2f s via %s; identity %s", encoder.path,
                 encoder.info["class"], encoder.dtype, encoder.info["parameters"], encoder.load_seconds,
                 encoder.load_path, encoder.identity[:16])

    loop.call_soon_threadsafe(ready)


async def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    state = State(args)
    state.connections = limit = ConnectionLimit(args.max_connections or _default_max_connections())
    app = make_app(state)
    # keepalive_timeout: aiohttp closes a connection without a complete request when it fires
    # (Note [Slow and idle connections]).
    # lingering_time: how long the rest of an unread body is read after the answer (aiohttp: 10 s).
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=args.drain_seconds,
                           keepalive_timeout=args.header_timeout, lingering_time=min(args.body_timeout, 5.0))
    await runner.setup()
    loop = asyncio.get_running_loop()
    make = runner.server  # aiohttp's protocol factory, each connection's behind the limit
    assert make is not None
    listener = await loop.create_server(lambda: _Guard(limit, make), args.host, args.port, reuse_address=True)
    port = listener.sockets[0].getsockname()[1]
    sys.stderr.write(f"pinload encoder: listening on http://{args.host}:{port}\n")
    sys.stderr.flush()
    log.info("at most %d connections; header timeout %g s, body timeout %g s", limit.limit, args.header_timeout,
             args.body_timeout)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    threading.Thread(target=_load, args=(state, loop, stop), name="pinload-encoder-load", daemon=True).start()
    await stop.wait()
    # Draining: /readyz and new encodes answer 503 while the requests in flight finish.
    state.draining = True
    state.metrics.ready.set(0)
    t0 = time.perf_counter()
    log.info("stopping: draining the requests in flight")
    listener.close()  # stops listening
    await runner.cleanup()  # waits for the requests in flight
    if state.batcher is not None:
        await state.batcher.stop()
    log.info("stopped in %.2f s", time.perf_counter() - t0)
    return 1 if state.failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    """``pinload encoder serve [options]`` (argv without ``serve`` also works)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        sys.stderr.write(f"pinload encoder: unknown command {argv[0]!r}; usage: pinload encoder serve --model PATH\n")
        return 2
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="pinload encoder: %(levelname)s: %(message)s")
    for name, lo in (("max_batch", 1), ("max_queue", 1), ("max_prompts", 1), ("max_prompt_chars", 1)):
        if getattr(args, name) < lo:
            build_parser().error(f"--{name.replace('_', '-')} must be at least {lo}")
    if args.max_prompts > args.max_queue:
        build_parser().error(f"--max-prompts {args.max_prompts} is more than --max-queue {args.max_queue}: "
                             "such a request could never be queued")
    if args.batch_window < 0:
        build_parser().error("--batch-window must be >= 0")
    for name in ("header_timeout", "body_timeout"):
        if not getattr(args, name) > 0:
            build_parser().error(f"--{name.replace('_', '-')} must be > 0")
    if args.max_connections < 0:
        build_parser().error("--max-connections must be >= 0 (0: from the descriptor limit)")
    rc = asyncio.run(_serve(args))
    # Drained and stopped: nothing is left to flush but the logs. Tearing down the interpreter with
    # torch and transformers loaded takes seconds (10 s measured on a busy machine), which would
    # only delay a supervisor's restart.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
