"""What the real servers that tests and benchmarks start (SeaweedFS, ``mooncake_master``) share: a process on
loopback to stall (SIGSTOP), resume, and stop gracefully (SIGKILL past 20 s), keeping its data for a restart."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import IO


class ServerProcess:
    """A server subprocess; the subclass starts it (``proc``, with its output in ``log``)."""

    proc: subprocess.Popen | None = None
    log: IO[bytes]

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
