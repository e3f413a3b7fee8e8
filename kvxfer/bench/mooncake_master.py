"""A real Mooncake Store master for the Mooncake tier's tests and ``kvxfer bench mooncake``: the wheel's
``mooncake_master`` (``pip install 'kvxfer[mooncake]'``) on loopback, on free ports, with its HTTP metadata
server built in (no etcd). ``stop``/``start`` restart it on the same ports (a restarted master holds nothing:
it keeps its metadata in memory); ``pause``/``resume`` stall it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvxfer.bench.server_process import ServerProcess

MASTER = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeMaster(ServerProcess):
    """``mooncake_master`` with its metadata server; ``section()`` is a daemon's ``mooncake`` config for it."""

    def __init__(self, *flags: str) -> None:
        """``flags``: the master's own (``--client_ttl=2``: a client silent 2 s is gone, its segment with it)."""
        self.dir = Path(tempfile.mkdtemp(prefix="kvxmc"))
        self.rpc_port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.flags = list(flags)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def section(self, **extra) -> dict:
        """A daemon's ``mooncake`` section for this master (a client on loopback over TCP)."""
        return {"master": self.master, "metadata": self.metadata, "local_hostname": "127.0.0.1", **extra}

    def start(self) -> None:
        args = [MASTER, "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}", "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}", "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
                *self.flags]
        self.log = open(self.dir / "master.log", "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.dir)
        deadline = time.monotonic() + 60
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start (exit {self.proc.poll()}):\n"
                                   f"{(self.dir / 'master.log').read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)

    def _answers(self) -> bool:
        """Both of its ports take connections."""
        for port in (self.rpc_port, self.http_port):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) != 0:
                    return False
        return True

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
