"""A ``kvxfer serve`` process for the device check's stages, started as a program (the library
never imports the daemon's code), from the checkout the check runs in."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from kvxfer.client import Client
from kvxfer.errors import KvxferError

ROOT = Path(__file__).resolve().parents[2]


class Daemon:
    """The daemon process, its socket and its log, removed by ``close``."""

    def __init__(self, config: dict, command: list[str] | None = None, timeout: float = 60.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kxdc", dir="/tmp"))  # Unix socket paths are short
        self.config = {"socket": str(self.dir / "d.sock"), "metrics_listen": "", **config}
        (self.dir / "config.yaml").write_text(yaml.safe_dump(self.config))
        self.log = self.dir / "daemon.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([*(command or [sys.executable, "-m", "service.cli"]), "serve", "--config",
                                          str(self.dir / "config.yaml")], cwd=ROOT, env=env,
                                         stdout=subprocess.DEVNULL, stderr=log)
        self._wait_serving(timeout)

    @property
    def target(self) -> str:
        return f"unix:{self.config['socket']}"

    def _wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if Path(self.config["socket"]).exists():
                try:
                    with Client(self.target, timeout=2) as client:
                        if client.health() == "SERVING":
                            return
                except KvxferError:
                    pass
            time.sleep(0.1)
        self.close()
        raise RuntimeError(f"the daemon was not serving after {timeout} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)
