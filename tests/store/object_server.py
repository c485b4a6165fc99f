"""A small HTTP object server for the store's tests: serves one object with ranges, and lets a test
say, per request, what goes wrong (a missing or hostile ETag, a Content-Range holding bytes that are
not UTF-8, an error body). The daemon and its clients are real processes; this server is the
hostile or broken one the node store must survive (docs/store.md, the trust model)."""

import re
import socket
import threading


class ObjectServer:
    """Serves `data` at every path. `etag`: bytes of the ETag header (None: none sent). `fault(first,
    last)` may return a dict {"status": int, "headers": [(bytes, bytes)], "body": bytes} that replaces
    or amends the answer to a range; each request is recorded in `requests` as (first, last)."""

    def __init__(self, data: bytes, etag: bytes = b'"5d41402abc4b2a76b9719d911017c592"', fault=None):
        self.data, self.etag, self.fault = data, etag, fault or (lambda first, last: None)
        self.requests = []
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self):
        self._stopped = True
        self._sock.close()

    def _accept(self):
        while not self._stopped:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            buffered = b""
            while True:
                while b"\r\n\r\n" not in buffered:
                    try:
                        chunk = conn.recv(65536)
                    except OSError:
                        return
                    if not chunk:
                        return
                    buffered += chunk
                head, _, buffered = buffered.partition(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method = lines[0].split(b" ")[0]
                headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(b":") for l in lines[1:])}
                size = len(self.data)
                m = re.match(rb"bytes=(\d+)-(\d*)", headers.get(b"range", b""))
                if m:
                    first = int(m.group(1))
                    last = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
                else:
                    first, last = 0, size - 1
                self.requests.append((first, last))
                status, out = (206, [(b"Content-Range", b"bytes %d-%d/%d" % (first, last, size))]) if m else (200, [])
                body = self.data[first:last + 1]
                if self.etag is not None:
                    out.append((b"ETag", self.etag))
                fault = self.fault(first, last) or {}
                status = fault.get("status", status)
                if "body" in fault:
                    body = fault["body"]
                replaced = {k.lower() for k, _ in fault.get("headers", [])}
                out = [(k, v) for k, v in out if k.lower() not in replaced] + fault.get("headers", [])
                reason = b"Partial Content" if status == 206 else b"OK" if status == 200 else b"Error"
                answer = b"HTTP/1.1 %d %s\r\n" % (status, reason)
                for k, v in out + [(b"Content-Length", str(len(body)).encode()), (b"Connection", b"keep-alive")]:
                    answer += k + b": " + v + b"\r\n"
                answer += b"\r\n" + (b"" if method == b"HEAD" else body)
                try:
                    conn.sendall(answer)
                except OSError:
                    return
