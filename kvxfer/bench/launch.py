"""Start a real daemon subprocess and wait until it serves (benchmarks and tests use this).

The daemon is the ``kvxfer serve`` program, started by its module name: the library never
imports the daemon's code (``service``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the program's package beside kvxfer's


@dataclass
class DaemonProcess:
    """A ``kvxfer serve`` subprocess with its own socket directory, and a directory on
    /dev/shm for the files of engines that register pools with it."""

    proc: subprocess.Popen
    dir: Path
    config: dict
    log: Path
    shm_dir: Path

    @property
    def socket(self) -> str:
        return self.config["socket"]

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    def health(self) -> int:
        with grpc.insecure_channel(self.target) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status

    def wait_serving(self, timeout: float = 60) -> None:
        """Until health says SERVING and no tier is still loading its index (a disk tier loads in the
        background while the daemon serves)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")
            if Path(self.socket).exists():
                try:
                    if self.health() == health_pb2.HealthCheckResponse.SERVING and not self.loading():
                        return
                except grpc.RpcError:
                    pass
            time.sleep(0.1)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"daemon not serving after {timeout}s:\n{self.log_text()}")

    def loading(self) -> bool:
        """Whether a tier of any pool is still loading its index."""
        return any(t.loading for t in self._tiers())

    def wait_warm(self, timeout: float = 300) -> None:
        """Until no host tier is still faulting its memory in: a server's steady state, where the plain
        copy a bench compares with writes memory touched before too (a first write to a page faults)."""
        deadline = time.monotonic() + timeout
        while any(t.warming for t in self._tiers()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"a host tier still faulting its memory in after {timeout}s")
            time.sleep(0.2)

    def _tiers(self) -> list:
        from kvxfer.client import Client  # (this module is imported by the program, which needs no client)

        token = Path(self.config["token_file"]).read_text().strip() if self.config.get("token_file") else None
        with Client(self.target, token=token) as client:
            return [t for s in client.stats() for t in s.tiers]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def log_text(self) -> str:
        return self.log.read_text()

    def cleanup(self) -> None:
        """Kill if still running and remove its directories."""
        if self.proc.poll() is None:
            self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


def spawn(config: dict, wait: bool = True, command: list[str] | None = None,
          env: dict[str, str] | None = None) -> DaemonProcess:
    """Start ``kvxfer serve`` with ``config`` over a short socket path (Unix sockets allow ~107
    bytes). ``command`` replaces the Python command line before ``serve`` (tests start the
    daemon under another user this way); ``env``: variables added to its environment."""
    workdir = Path(tempfile.mkdtemp(prefix="kx", dir="/tmp"))
    shm_dir = Path(tempfile.mkdtemp(prefix="kx", dir="/dev/shm"))
    # No metrics port unless asked: daemons started side by side would contend for the default one.
    full = {"socket": str(workdir / "d.sock"), "metrics_listen": "", **config}
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(full))
    log = workdir / "daemon.log"
    env = {**os.environ, **(env or {}), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with log.open("w") as log_file:
        argv = command or [sys.executable, "-m", "service.program"]
        proc = subprocess.Popen([*argv, "serve", "--config", str(config_path)],
                                env=env, stdout=subprocess.DEVNULL, stderr=log_file, cwd=ROOT)
    daemon = DaemonProcess(proc, workdir, full, log, shm_dir)
    if wait:
        try:
            daemon.wait_serving()
        except BaseException:
            daemon.cleanup()
            raise
    return daemon
