"""The cache groups one daemon serves: who made each, who else sees it, and when an idle one goes.

A group is joined only by the party that created it (the daemon for its own pools, else the
registering uid), and with the sharing it was made with. A group whose last pool left stays warm
for ``retention_s`` (an engine that restarts finds it); then, or sooner when a new group needs
its place (the least recently used idle one), it is taken out of the table, written down to the
tiers that keep blocks and freed. A group being written down is not made again meanwhile.
Bookkeeping only: the registry holds the lock; ``close_released`` runs outside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvxfer.core.errors import FailedPrecondition, PermissionDenied, ResourceExhausted, Unavailable
from kvxfer.core.validate import shown
from kvxfer.serving.group import CacheGroup
from kvxfer.tiers.reach import NODE, SHARED, Reach

log = logging.getLogger("kvxfer.serving.pool_registry")
RELEASE_DEMOTE_S = 30.0  # how long a released group's host tier may take to be written down to disk


@dataclass(frozen=True)
class Sharing:
    """Who besides a cache group's creator sees it. The daemon's own groups are shared both ways;
    a registrant's are private unless it asks when it makes the group."""

    peers: bool = False  # other nodes' daemons may read its blocks and push into it (peering)
    events: bool = False  # any WatchEvents / Snapshot caller and the ZeroMQ publisher see its keys

    def reach(self, group: str, chosen: bytes) -> Reach:
        """The group's reach on the tiers other nodes read (``kvxfer.tiers.reach``): any node's group of its name
        if it is shared with peers (the daemon's own are); else its registrant's chosen token's, or this node's."""
        if self.peers:
            return SHARED
        return Reach.of_token(group, chosen) if chosen else NODE


DAEMON_SHARING = Sharing(peers=True, events=True)


@dataclass
class GroupEntry:
    group: CacheGroup
    owner: str
    sharing: Sharing = Sharing()
    idle_since: float | None = None  # when its last pool went away
    pools: set[str] = field(default_factory=set)


class GroupTable:
    """Cache groups by name (every method: the registry's lock held)."""

    def __init__(self, retention_s: float, max_groups: int) -> None:
        self.retention_s = retention_s
        self.max_groups = max_groups
        self.entries: dict[str, GroupEntry] = {}
        self.closing: set[str] = set()  # released and being written down

    def admit(self, name: str, owner: str, sharing: Sharing) -> GroupEntry | None:
        """The group a pool of ``owner`` joins (None: a new one must be made); refuses another party's
        group, other sharing, and a group still being written down."""
        entry = self.entries.get(name)
        if entry is None:
            if name in self.closing:
                raise Unavailable(f"cache group {shown(name)} is being written down after its idle time; "
                                  "register again in a moment")
            return None
        if entry.owner != owner:
            raise PermissionDenied(f"cache group {shown(name)} belongs to another party; a pool joins only a "
                                   "group its own party created (use another cache group)")
        if entry.sharing != sharing:
            raise FailedPrecondition(f"cache group {shown(name)} was made with {entry.sharing}; a pool joining "
                                     f"it asks for the same (got {sharing})")
        return entry

    def check_room(self) -> None:
        """RESOURCE_EXHAUSTED if one more group would be too many (after ``take_expired(force_room=True)``)."""
        if len(self.entries) >= self.max_groups:
            raise ResourceExhausted(f"{len(self.entries)} cache groups exist; at most {self.max_groups}")

    def join(self, name: str, entry: GroupEntry, pool_id: str) -> None:
        self.entries[name] = entry
        entry.pools.add(pool_id)
        entry.idle_since = None

    def leave(self, name: str, pool_id: str, now: float) -> None:
        entry = self.entries.get(name)
        if entry is not None:
            entry.pools.discard(pool_id)
            if not entry.pools:
                entry.idle_since = now

    def take_expired(self, now: float, force_room: bool = False) -> list[CacheGroup]:
        """Take out idle groups past retention; with ``force_room``, when no room is left for a new group,
        also the least recently used idle one (its blocks are the stalest)."""
        idle = sorted((e.idle_since, name) for name, e in self.entries.items() if e.idle_since is not None)
        gone = [name for since, name in idle if now - since >= self.retention_s]
        if force_room and len(self.entries) - len(gone) >= self.max_groups:
            gone += [name for _, name in idle if name not in gone][:1]
        self.closing.update(gone)
        return [self.entries.pop(name).group for name in gone]

    def groups(self, peers_only: bool = False) -> list[CacheGroup]:
        return [e.group for e in self.entries.values() if e.sharing.peers or not peers_only]


def close_released(groups: list[CacheGroup], done: Callable[[str], None]) -> None:
    """Write released groups' host tiers down to the tiers that keep blocks (disk), then free them: their memory
    returns with the last reference, and an engine back later finds its blocks there. ``done(name)`` after each
    (under the registry's lock: the name may be made again)."""
    for group in groups:
        try:
            written = group.demote_all(RELEASE_DEMOTE_S)
            group.close(RELEASE_DEMOTE_S)
            log.info("cache group released", extra={"cache_group": group.name, "written_down": written})
        finally:
            done(group.name)


__all__ = ["DAEMON_SHARING", "GroupEntry", "GroupTable", "Sharing", "close_released"]
