"""An HTTP server on loopback that sends whatever bytes a test gives it, and a node store daemon.

RawServer answers each request with the bytes `answer(request)` returns, then closes the
connection: any status line, any header bytes (non-UTF-8, control bytes), any body, cut anywhere.
`ranged_answer` is an honest answer to a ranged GET (206, Content-Range, a strong ETag), the base
that tests mutate. StoreDaemon runs `pinload store serve` (as tests/store/conftest.py does).
"""

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path


class RawServer:
    """`answer(request)` -> bytes, for a request dict: method, path, headers (lowercase names,
    str), range (first, last) or None, n (its number on this server, from 0)."""

    def __init__(self, answer):
        self.answer = answer
        self.count = 0
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(256)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self):
        self._stopped = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept(self):
        while not self._stopped:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
            method, path = (head[0].split(" ") + ["", ""])[:2]
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", headers.get("range", ""))
            with self._lock:
                n = self.count
                self.count += 1
            request = {"method": method, "path": path, "headers": headers, "n": n,
                       "range": (int(m.group(1)), int(m.group(2))) if m else None}
            conn.sendall(self.answer(request))
        except OSError:
            pass
        finally:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


def http_answer(status_line: bytes, headers: list, body: bytes) -> bytes:
    """One answer: `headers` is a list of (name, value) bytes, sent in order, as given."""
    lines = [status_line] + [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def ranged_answer(data: bytes, request: dict, etag: bytes):
    """The honest answer to `request` for an object of bytes `data`: (status line, headers, body)."""
    common = [(b"ETag", etag), (b"Last-Modified", b"Tue, 01 Dec 2026 15:51:16 GMT"),
              (b"Date", b"Mon, 07 Dec 2026 12:00:00 GMT"), (b"Connection", b"close")]
    if request["range"] is None:
        return b"HTTP/1.1 200 OK", common + [(b"Content-Length", str(len(data)).encode())], data
    first, last = request["range"]
    if first >= len(data):
        return (b"HTTP/1.1 416 Range Not Satisfiable",
                common + [(b"Content-Range", f"bytes */{len(data)}".encode()), (b"Content-Length", b"0")], b"")
    last = min(last, len(data) - 1)
    body = data[first:last + 1]
    return (b"HTTP/1.1 206 Partial Content",
            common + [(b"Content-Range", f"bytes {first}-{last}/{len(data)}".encode()),
                      (b"Content-Length", str(len(body)).encode())], body)


def object_server(objects: dict) -> RawServer:
    """Honest ranged answers: `objects` maps a path to (bytes, ETag); any other path is the one
    under the key None (where there is one)."""
    def answer(request):
        data, etag = objects.get(request["path"], objects.get(None, (None, None)))
        if data is None:
            return http_answer(b"HTTP/1.1 404 Not Found", [(b"Content-Length", b"0")], b"")
        return http_answer(*ranged_answer(data, request, etag))
    return RawServer(answer)


class StoreDaemon:
    """`pinload store serve` in a subprocess, stderr to `folder/daemon.log`."""

    def __init__(self, binary: str, folder: Path, *args: str, env: dict = None):
        self.binary, self.folder, self.args, self.env = binary, Path(folder), list(args), env
        self.socket = str(self.folder / "store.sock")
        self.ready = self.folder / "daemon.ready"
        self.log = self.folder / "daemon.log"
        self.proc = None

    def start(self) -> "StoreDaemon":
        self.ready.unlink(missing_ok=True)
        cmd = [self.binary, "store", "serve", "--socket", self.socket, "--ready-file", str(self.ready), *self.args]
        self.proc = subprocess.Popen(cmd, stderr=open(self.log, "ab"), stdout=subprocess.DEVNULL, env=self.env)
        deadline = time.monotonic() + 30
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited {self.proc.returncode}: {self.log.read_text(errors='replace')}")
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not get ready: " + self.log.read_text(errors="replace"))
            time.sleep(0.02)
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def remote_allow_args(pinload_bin: str, *prefixes: str) -> list:
    """`--remote-allow PREFIX` for each prefix, where the daemon has that option (it fetches remote
    objects for its clients only under such prefixes, docs/store.md)."""
    help_text = subprocess.run([pinload_bin, "store", "serve", "--help"], capture_output=True, text=True).stdout
    if "--remote-allow" not in help_text:
        return []
    return [arg for p in prefixes for arg in ("--remote-allow", p)]


def base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PINLOAD_"))}
    env.update({"PINLOAD_LOG_LEVEL": "warn", **extra})
    return env
