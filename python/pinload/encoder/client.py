"""A client of ``pinload encoder serve``: retries with backoff, timeouts, typed errors, and an
optional local fallback.

    client = EncoderClient("http://127.0.0.1:8471", timeout=30, retries=8)
    out = client.encode(["a cat on a chair"], max_length=512)
    out.embeddings, out.attention_mask, out.pooled    # torch tensors; out.metadata: the server's

Note [Client retries]
urllib3's ``Retry`` does the retrying: connection errors (the server is down or restarting), read
timeouts, and the answers 429 (overloaded), 502, 503 (loading, draining) and 504, with exponential
backoff (``backoff`` × 2^n, at most ``max_backoff`` seconds; a Retry-After header is honoured) up to
``retries`` times. Encoding is idempotent, so POST is retried too. A bad request (400, 413, 415) is
not retried. Once retries run out the client raises a typed error, or, where it was given a
``fallback`` (an ``Encoder`` or a function that makes one, called once, on first need), encodes
locally with the same code the server runs; ``fallback_used`` counts those calls.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

__all__ = ["EncoderClient", "EncodeResult", "EncoderError", "EncoderUnavailableError", "EncoderBadRequestError",
           "EncoderOverloadedError", "EncoderServerError", "EncoderTimeoutError"]


class EncoderError(Exception):
    """Any failure of an encode call. ``status`` (HTTP status or None), ``kind`` (the server's error
    type, or the client's: "unavailable", "timeout"), ``body`` (the server's JSON error, if any)."""

    def __init__(self, message: str, *, status: Optional[int] = None, kind: Optional[str] = None,
                 body: Optional[dict] = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.body = status, kind, body


class EncoderUnavailableError(EncoderError, ConnectionError):
    """The server could not be reached, or answered 502/503/504, after every retry."""


class EncoderTimeoutError(EncoderUnavailableError, TimeoutError):
    """The server did not answer within the timeout, after every retry."""


class EncoderBadRequestError(EncoderError, ValueError):
    """The server refused the request (4xx other than 429): ``kind`` says why (empty_prompts,
    too_many_prompts, prompt_too_long, invalid_type, ...)."""


class EncoderOverloadedError(EncoderError):
    """429 after every retry: the server's queue stayed full."""


class EncoderServerError(EncoderError):
    """500: the encoder failed on the server."""


@dataclass
class EncodeResult:
    embeddings: Any  # torch.Tensor [n, L, d]
    attention_mask: Any  # torch.Tensor [n, L] int64
    pooled: Any = None  # torch.Tensor [n, p] (CLIP) or None
    metadata: Dict[str, Any] = field(default_factory=dict)  # encoder (identity), dtype, max_length, padding
    local: bool = False  # made by the fallback encoder, not the server


class EncoderClient:
    """Thread-safe (urllib3's pool). ``timeout``: seconds per attempt (a float, or (connect, read));
    ``retries``: attempts after the first; ``backoff``/``max_backoff``: Note [Client retries].
    ``fallback``: an ``Encoder``, or a function returning one (loaded on first need)."""

    def __init__(self, url: str = "http://127.0.0.1:8471", *, timeout: Union[float, tuple] = 60.0,
                 retries: int = 8, backoff: float = 0.1, max_backoff: float = 2.0,
                 fallback: Union[None, Any, Callable[[], Any]] = None, pool_size: int = 16) -> None:
        import urllib3

        self.url = url.rstrip("/")
        connect, read = timeout if isinstance(timeout, tuple) else (min(timeout, 10.0), timeout)
        self._timeout = urllib3.Timeout(connect=connect, read=read)
        self._retry = urllib3.Retry(total=retries, connect=retries, read=retries, status=retries, other=0,
                                    allowed_methods=None, status_forcelist=(429, 502, 503, 504),
                                    backoff_factor=backoff, backoff_max=max_backoff,
                                    respect_retry_after_header=True, raise_on_status=False,
                                    raise_on_redirect=True, redirect=0)
        self._http = urllib3.PoolManager(maxsize=pool_size, block=False)
        self._fallback = fallback
        self._fallback_lock = threading.Lock()
        self.fallback_used = 0

    def set_fallback(self, fallback: Union[None, Any, Callable[[], Any]]) -> None:
        """An ``Encoder``, or a function returning one, used when the server cannot answer."""
        with self._fallback_lock:
            self._fallback = fallback

    @property
    def has_fallback(self) -> bool:
        return self._fallback is not None

    def close(self) -> None:
        self._http.clear()

    def __enter__(self) -> "EncoderClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _request(self, method: str, path: str, body: Optional[bytes] = None, headers: Optional[dict] = None,
                 retries: Any = None):
        import urllib3

        try:
            return self._http.request(method, self.url + path, body=body, headers=headers, timeout=self._timeout,
                                      retries=self._retry if retries is None else retries)
        except urllib3.exceptions.MaxRetryError as e:
            reason = e.reason
            if isinstance(reason, (urllib3.exceptions.TimeoutError,)):
                raise EncoderTimeoutError(f"{self.url}{path}: no answer in time after {self._retry.total} retries: "
                                          f"{reason}", kind="timeout") from e
            raise EncoderUnavailableError(f"{self.url}{path}: unreachable after {self._retry.total} retries: {reason}",
                                          kind="unavailable") from e
        except urllib3.exceptions.TimeoutError as e:
            raise EncoderTimeoutError(f"{self.url}{path}: no answer in time: {e}", kind="timeout") from e
        except urllib3.exceptions.HTTPError as e:
            raise EncoderUnavailableError(f"{self.url}{path}: {e}", kind="unavailable") from e

    def ready(self) -> bool:
        """Whether /readyz answers 200 now (one attempt, no retries)."""
        try:
            return self._request("GET", "/readyz", retries=0).status == 200
        except EncoderError:
            return False

    def info(self) -> Dict[str, Any]:
        """The server's /readyz answer (identity, dtype, max length, cache statistics)."""
        r = self._request("GET", "/readyz")
        if r.status != 200:
            raise _error(r, "/readyz")
        return json.loads(r.data)

    def encode(self, prompts: Sequence[str], max_length: Optional[int] = None, **options: Any) -> EncodeResult:
        """Embeddings of ``prompts``. ``options``: padding ("max_length" or "longest"), truncation,
        hidden_layer (docs/encoder.md). Raises an ``EncoderError`` subclass, or uses the fallback."""
        if isinstance(prompts, str):
            prompts = [prompts]
        body: Dict[str, Any] = {"prompts": list(prompts)}
        if max_length is not None:
            body["max_length"] = max_length
        if options:
            body["options"] = options
        data = json.dumps(body).encode()
        try:
            r = self._request("POST", "/v1/encode", body=data, headers={"Content-Type": "application/json"})
            if r.status != 200:
                raise _error(r, "/v1/encode")
        except (EncoderUnavailableError, EncoderOverloadedError):
            if self._fallback is None:
                raise
            return self._local(list(prompts), max_length, options)
        from safetensors.torch import load

        tensors = load(r.data)
        metadata = _metadata(r.data)
        return EncodeResult(tensors["embeddings"], tensors["attention_mask"], tensors.get("pooled"), metadata)

    def _local(self, prompts: List[str], max_length: Optional[int], options: Dict[str, Any]) -> EncodeResult:
        from .model import EncodeSpec, stack

        with self._fallback_lock:
            if callable(self._fallback) and not hasattr(self._fallback, "encode"):
                self._fallback = self._fallback()
            encoder = self._fallback
            self.fallback_used += 1
        spec = EncodeSpec(max_length=max_length or encoder.model_max_length, **options)
        out = stack(encoder.encode(prompts, spec))
        return EncodeResult(out["embeddings"], out["attention_mask"], out.get("pooled"),
                            {"encoder": encoder.identity, "dtype": encoder.dtype, "max_length": spec.max_length,
                             "padding": spec.padding}, local=True)


def _metadata(data: bytes) -> Dict[str, Any]:
    """The answer's "pinload.encoder" metadata: encoder (identity), dtype, max_length, padding."""
    n = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + n]).get("__metadata__") or {}
    return json.loads(metadata.get("pinload.encoder", "{}"))


def _error(r: Any, path: str) -> EncoderError:
    try:
        body = json.loads(r.data)
        err = body.get("error", {})
        kind, message = err.get("type"), err.get("message", "")
    except (ValueError, AttributeError):
        body, kind, message = None, None, r.data[:200].decode("utf-8", "replace")
    text = f"{path}: HTTP {r.status} {kind or ''}: {message}"
    if r.status == 429:
        return EncoderOverloadedError(text, status=r.status, kind=kind, body=body)
    if r.status in (502, 503, 504):
        return EncoderUnavailableError(text, status=r.status, kind=kind, body=body)
    if 400 <= r.status < 500:
        return EncoderBadRequestError(text, status=r.status, kind=kind, body=body)
    return EncoderServerError(text, status=r.status, kind=kind, body=body)
