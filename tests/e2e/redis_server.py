"""A real redis-server for the remote tier's tests: a free port, an ACL user with a password,
the default user off, optionally TLS only."""

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

USER, PASSWORD = "kvxfer", "s3cret-for-tests"
REDIS = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tls(directory: Path) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 (openssl)."""
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.crt", "server.key", "server.csr",
                                                          "server.crt"))
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
        "-subj", "/CN=kvxfer-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(cert),
        "-days", "1", "-extfile", str(ext))
    return {"ca": str(ca), "cert": str(cert), "key": str(key)}


class RedisServer:
    def __init__(self, maxmemory: str = "64mb", tls: bool = False, port: int | None = None, notify: str = "") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvxredis"))
        self.port = port or free_port()
        self.tls = make_tls(self.dir) if tls else None
        self.password_file = self.dir / "password"
        self.password_file.write_text(PASSWORD + "\n")
        self.maxmemory = maxmemory
        self.notify = notify  # notify-keyspace-events
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [REDIS, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                "--user", "default", "off", "--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all",
                "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
                *(["--notify-keyspace-events", self.notify] if self.notify else [])]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls["cert"],
                     "--tls-key-file", self.tls["key"], "--tls-ca-cert-file", self.tls["ca"],
                     "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        self._run(args)

    def _run(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client().ping()
                return
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start (exit {self.proc.poll()})") from None
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        extra = {"ssl_ca_certs": self.tls["ca"]} if self.tls else {}
        return redis.Redis.from_url(self.url, username=USER, password=PASSWORD, socket_timeout=2, **extra)

    def config(self, **remote) -> dict:
        """The daemon's ``remote`` section for this server."""
        section = {"url": self.url, "username": USER, "password_file": str(self.password_file), "timeout_ms": 200,
                   **remote}
        if self.tls:
            section.setdefault("tls_ca", self.tls["ca"])
        return section

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisClusterServers:
    """Three redis-server nodes in cluster mode (no replicas), slots spread by redis-cli."""

    def __init__(self) -> None:
        self.nodes = [RedisNode() for _ in range(3)]
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(["redis-cli", "--user", USER, "--pass", PASSWORD, "--no-auth-warning", "--cluster", "create",
                        *addresses, "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True,
                       timeout=60)
        deadline = time.monotonic() + 30
        while any(n.client().cluster("info").get("cluster_state") != "ok" for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not come up")
            time.sleep(0.2)
        self.password_file = self.nodes[0].password_file

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def config(self, **remote) -> dict:
        return {"url": self.url, "username": USER, "password_file": str(self.password_file), "timeout_ms": 500,
                **remote}

    def close(self) -> None:
        for n in self.nodes:
            n.close()


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    continue


class RedisNode(RedisServer):
    """One cluster-mode node (its cluster bus listens on port + 10000)."""

    def __init__(self) -> None:
        super().__init__(port=cluster_port())

    def start(self) -> None:
        args = [REDIS, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--user", "default", "off", "--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all"]
        self._run(args)
