"""Start a real daemon subprocess and wait until it serves (benchmarks and tests use this)."""

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

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class DaemonProcess:
    """A ``kvxfer serve`` subprocess with its own socket directory and shm directory."""

    proc: subprocess.Popen
    dir: Path
    config: dict
    log: Path

    @property
    def socket(self) -> str:
        return self.config["socket"]

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    @property
    def shm_dir(self) -> Path:
        return Path(self.config["shm_dir"])

    def health(self) -> int:
        with grpc.insecure_channel(self.target) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status

    def wait_serving(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")
            if Path(self.socket).exists():
                try:
                    if self.health() == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
            time.sleep(0.1)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"daemon not serving after {timeout}s:\n{self.log_text()}")

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


def spawn(config: dict, wait: bool = True) -> DaemonProcess:
    """Start ``kvxfer serve`` with ``config`` over a short socket path (Unix sockets allow ~107
    bytes) and a private shm directory, unless the config names its own."""
    workdir = Path(tempfile.mkdtemp(prefix="kx", dir="/tmp"))
    shm_dir = config.get("shm_dir") or tempfile.mkdtemp(prefix="kx", dir="/dev/shm")
    full = {"socket": str(workdir / "d.sock"), **config, "shm_dir": str(shm_dir)}
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(full))
    log = workdir / "daemon.log"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with log.open("w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "kvxfer.cli", "serve", "--config", str(config_path)],
                                env=env, stdout=subprocess.DEVNULL, stderr=log_file, cwd=ROOT)
    daemon = DaemonProcess(proc, workdir, full, log)
    if wait:
        try:
            daemon.wait_serving()
        except BaseException:
            daemon.cleanup()
            raise
    return daemon
