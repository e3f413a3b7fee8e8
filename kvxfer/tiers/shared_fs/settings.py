"""The shared filesystem tier's settings and its config section (``shared_fs``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvxfer.core.errors import ConfigError
from kvxfer.core.validate import shown
from kvxfer.tiers.sections import bounded, secret

KEYS = frozenset({"path", "timeout_ms", "workers", "max_inflight", "secret_file"})


@dataclass(frozen=True)
class SharedFsSettings:
    """A directory on a shared mount; every node's cache group ``g`` uses ``<path>/<g>/``."""

    path: str
    timeout_s: float = 2.0  # one call into the mount, at most
    workers: int = 8  # threads calling into the mount (stuck ones included)
    max_inflight: int = 256  # writes staged in memory
    #: shared by the daemons of a share: every file carries a MAC under it and under its full path
    secret: bytes = field(default=b"", repr=False)

    @property
    def staged_blocks(self) -> int:
        """Blocks of each cache group's that its write queue may hold in memory."""
        return self.max_inflight


def parse(raw) -> SharedFsSettings | None:
    """The ``shared_fs`` section: a directory on a mount every node shares, a deadline per call. Nothing is
    made here: a missing directory is a mount that is not there."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - KEYS:
        raise ConfigError(f"shared_fs: must be a mapping of {sorted(KEYS)} (path required)")
    path = raw.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ConfigError(f"shared_fs.path: must be an absolute path, got {shown(path)}")
    limits = (("timeout_ms", 2000, 60_000), ("workers", 8, 64), ("max_inflight", 256, 65536))
    numbers = {key: bounded("shared_fs", raw, key, default, top) for key, default, top in limits}
    answer: list[bool] = []  # asked on a thread: a stalled mount must not hang the start (the tier then misses)
    probe = threading.Thread(target=lambda: answer.append(Path(path).is_dir()), daemon=True)
    probe.start()
    probe.join(numbers["timeout_ms"] / 1000)
    if answer == [False]:
        raise ConfigError(f"shared_fs.path: {shown(path)} is not a directory (is the shared filesystem mounted?)")
    return SharedFsSettings(path, numbers["timeout_ms"] / 1000, numbers["workers"], numbers["max_inflight"],
                            secret("shared_fs", raw))
