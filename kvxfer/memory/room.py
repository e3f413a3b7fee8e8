"""How much memory this process may still take: the kernel's MemAvailable and its cgroup's room.

Read before anything large is allocated, so that a configuration (or a registration) that
cannot fit is refused in one line instead of reserving pages until the OOM killer comes.
The daemon's own pools are sealed memfds and its host tiers anonymous mappings: both are
charged to the memory cgroup, neither to /dev/shm's size (the engine's pool files are).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvxfer.core.errors import ResourceExhausted

GIB = 1 << 30


def gib(nbytes: int) -> str:
    """A size as people read it: GiB from 1 GiB up, else MiB."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.0f} MiB"


@dataclass(frozen=True)
class Room:
    """Bytes this process may still allocate, and where the bound comes from."""

    available: int  # MemAvailable: free memory plus what the kernel can reclaim
    cgroup_limit: int | None  # memory.max (v2) or memory.limit_in_bytes (v1); None: unlimited
    cgroup_usage: int = 0

    @property
    def usable(self) -> int:
        if self.cgroup_limit is None:
            return self.available
        return min(self.available, max(0, self.cgroup_limit - self.cgroup_usage))

    def describe(self) -> str:
        limit = "no cgroup limit" if self.cgroup_limit is None else \
            f"cgroup limit {gib(self.cgroup_limit)} of which {gib(self.cgroup_usage)} used"
        return f"{gib(self.usable)} free here (MemAvailable {gib(self.available)}, {limit})"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2) is no limit


def _meminfo_available(meminfo: Path) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _own_cgroup(proc_cgroup: Path) -> str:
    """This process's cgroup v2 path ("" when unknown or v1)."""
    try:
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].lstrip("/")
    except OSError:
        pass
    return ""


def measure(root: Path = Path("/sys/fs/cgroup"), meminfo: Path = Path("/proc/meminfo"),
            proc_cgroup: Path = Path("/proc/self/cgroup")) -> Room:
    """The room now. A cgroup limit above the machine's memory (v1's "unlimited") counts as none."""
    available = _meminfo_available(meminfo)
    limit = usage = None
    for base in (root / _own_cgroup(proc_cgroup), root):  # v2: our cgroup, or its root in a container
        limit, usage = _read_int(base / "memory.max"), _read_int(base / "memory.current")
        if limit is not None:
            break
    if limit is None:  # cgroup v1
        limit = _read_int(root / "memory" / "memory.limit_in_bytes")
        usage = _read_int(root / "memory" / "memory.usage_in_bytes")
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if limit is not None and limit >= total:
        limit = None
    return Room(available, limit, usage or 0)


def ensure(nbytes: int, what: str, room: Room | None = None) -> None:
    """ResourceExhausted, in one line naming the figures, when ``nbytes`` more do not fit."""
    room = measure() if room is None else room
    if nbytes > room.usable:
        raise ResourceExhausted(f"{what} needs {gib(nbytes)}; {room.describe()}")


__all__ = ["Room", "ensure", "gib", "measure"]
