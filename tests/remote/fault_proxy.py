"""A fault-injecting HTTP proxy on loopback, in front of nginx or SeaweedFS.

Each client connection carries one request (the proxy answers with
"Connection: close"). `fault(request)` decides per request what goes wrong:
None (forward as is), or a dict with one of
  {"status": 503}               answer that status with an empty body
  {"drop_after": n}             forward n body bytes, then reset the connection
  {"stall_after": n, "for": s}  forward n body bytes, then wait s seconds, then close
  {"strip_range": True}         forward without the Range header
  {"content_range": "bytes ..."} rewrite the answer's Content-Range
  {"drop_headers": ["etag", ...]} remove those headers from the answer (with any of the others)
  {"before": callable}          call it, then forward (overwrite the object, say)
The request is a dict: method, path, headers (lowercase names), range (first,
last) or None, and n (its number, from 0). Every request is logged in `log`.
"""

import re
import socket
import struct
import threading
import time


class FaultProxy:
    def __init__(self, upstream_port, fault=None):
        self.upstream_port = upstream_port
        self.fault = fault or (lambda request: None)
        self.log = []
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(256)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def stop(self):
        self._stopped = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept(self):
        while not self._stopped:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            self._handle(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def _handle(self, conn):
        head = b""
        while b"\r\n\r\n" not in head:
            data = conn.recv(65536)
            if not data:
                return
            head += data
        head, _, rest = head.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers.append((name, value.strip()))
        lower = {n.lower(): v for n, v in headers}
        rng = None
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", lower.get("range", ""))
        if m:
            rng = (int(m.group(1)), int(m.group(2)))
        with self._lock:
            request = {"method": method, "path": path, "headers": lower, "range": rng, "n": len(self.log)}
            self.log.append(request)
        fault = self.fault(request) or {}
        if "before" in fault:
            fault["before"]()
        if "status" in fault:
            conn.sendall(f"HTTP/1.1 {fault['status']} Injected\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
            return
        out = [f"{method} {path} HTTP/1.1"]
        for name, value in headers:
            if name.lower() == "connection" or (fault.get("strip_range") and name.lower() == "range"):
                continue
            out.append(f"{name}: {value}")
        out.append("Connection: close")
        up = socket.create_connection(("127.0.0.1", self.upstream_port))
        try:
            up.sendall(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + rest)
            self._relay(up, conn, fault)
        finally:
            up.close()

    def _relay(self, up, conn, fault):
        head = b""
        while b"\r\n\r\n" not in head:
            data = up.recv(65536)
            if not data:
                conn.sendall(head)
                return
            head += data
        head, _, body = head.partition(b"\r\n\r\n")
        for name in fault.get("drop_headers", ()):
            head = re.sub(rb"(?im)^" + re.escape(name.encode()) + rb":[^\r\n]*\r\n", b"", head + b"\r\n")[:-2]
        if "content_range" in fault:
            head = re.sub(rb"(?im)^content-range:[^\r\n]*", b"Content-Range: " + fault["content_range"].encode(), head)
        conn.sendall(head + b"\r\n\r\n")
        limit = fault.get("drop_after", fault.get("stall_after"))
        sent = 0
        while True:
            if limit is not None and sent + len(body) >= limit:
                conn.sendall(body[: limit - sent])
                if "drop_after" in fault:  # a reset, not a clean close
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    time.sleep(fault["for"])
                return
            conn.sendall(body)
            sent += len(body)
            body = up.recv(1 << 20)
            if not body:
                return
                return


class HeldRequests:
    """A `fault` that holds every request `seconds` before forwarding it and counts how many are
    held at once: each connection carries one request, so `max_active` is the most connections a
    client had in flight together. A load completes only after its requests' holds, so a count
    never straddles two loads."""

    def __init__(self, seconds=0.05):
        self.seconds = seconds
        self.active = self.max_active = 0
        self._lock = threading.Lock()

    def __call__(self, request):
        return {"before": self._hold}

    def _hold(self):
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(self.seconds)
        with self._lock:
            self.active -= 1
