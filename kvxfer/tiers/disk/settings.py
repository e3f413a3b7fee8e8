"""The disk tier's settings and its config section (``disk``).

The parser validates every key and changes nothing on the machine: the directory is made
when the tier starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvxfer.core.errors import ConfigError
from kvxfer.core.validate import shown
from kvxfer.tiers.sections import bounded, mapping

KEYS = frozenset({"path", "capacity_mib", "queue_blocks", "workers"})


@dataclass(frozen=True)
class DiskSettings:
    """The disk tier of every cache group: ``<path>/<cache group>/``, ``capacity_bytes`` each."""

    path: str
    capacity_bytes: int  # per cache group, headers included
    queue_blocks: int = 256  # demotions staged in memory (and promotion reads in flight) at most
    workers: int = 4  # threads reading blocks for restores
    load_in_background: bool = False  # the index loaded on a thread while the daemon serves

    @property
    def staged_blocks(self) -> int:
        """Blocks of each cache group's that its write queue may hold in memory."""
        return self.queue_blocks


def parse(raw) -> DiskSettings | None:
    """The ``disk`` section: one directory per cache group under ``path``, ``capacity_mib`` each."""
    raw = mapping("disk", raw, KEYS, "with path and capacity_mib")
    if raw is None:
        return None
    path = raw.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ConfigError(f"disk.path: must be an absolute path, got {shown(path)}")
    capacity = raw.get("capacity_mib")
    if isinstance(capacity, bool) or not isinstance(capacity, int | float) or not 0 < capacity <= 1 << 30:
        raise ConfigError(f"disk.capacity_mib: must be a positive number of MiB (per cache group), got "
                          f"{shown(capacity)}")
    queue_blocks, workers = bounded("disk", raw, "queue_blocks", 256, 65536), bounded("disk", raw, "workers", 4, 64)
    # Validation changes nothing: the directory is made when the tier starts; here its nearest
    # existing ancestor must be a directory this user may write in.
    existing = Path(path)
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"disk.path: {shown(path)} cannot be made or written by this user "
                          f"({existing} is not a writable directory)")
    return DiskSettings(path, int(capacity * (1 << 20)), queue_blocks, workers,
                        load_in_background=True)  # the daemon serves (and answers health) while it loads
