"""The lower tiers there are, in one table: how each is configured and made for a cache group.

``LOWER_TIERS`` lists them top down (a restore asks them in this order). A row names the
tier's kind, its config section, parses it, and makes the tier for one group from what the
section gave (its settings, or what the daemon built: peering is the daemon's NIXL agent and
links); it says how the tier's KV events name its medium and locality. A new tier is one package
under ``kvxfer.tiers``, a row here and its value in the proto's ``Tier`` enum (``TierKind`` is made
from it); the config, the daemon, ``serve --check``, the chart's schema, the wire, the events and
every cache group take it from this table. A row marked ``shared`` (other nodes read the medium) is
made for a group as the group's reach says (``kvxfer.tiers.reach``): under the group's name, under
its token's, or not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvxfer.core.errors import Internal
from kvxfer.core.records import TierKind
from kvxfer.tiers import peer
from kvxfer.tiers.disk import settings as disk
from kvxfer.tiers.disk.store import DiskStore
from kvxfer.tiers.lower import GroupContext, LowerTier, LowerTierFactory
from kvxfer.tiers.mooncake import reachable as mooncake_reach
from kvxfer.tiers.mooncake import settings as mooncake
from kvxfer.tiers.object import settings as object_settings
from kvxfer.tiers.reach import ReachKind
from kvxfer.tiers.remote import settings as remote
from kvxfer.tiers.remote.store import RemoteStore
from kvxfer.tiers.shared_fs import settings as shared_fs
from kvxfer.tiers.shared_fs.store import SharedFsStore


@dataclass(frozen=True)
class TierRow:
    """One lower tier: its config section, how the section is read, how the tier is made."""

    kind: TierKind  # where its blocks live, as the API names it
    section: str  # its config section, and its name among ``lower_tiers``' sources
    make: Callable[[Any, GroupContext], LowerTier]  # (what the section gave, the group) -> the group's tier
    parse: Callable[[object], Any] | None = None  # the section's raw value -> its settings (None: absent);
    # None here: the daemon makes the source itself (peering)
    keys: frozenset[str] = frozenset()  # the section's keys (documented in docs/storage.md; a test checks it)
    medium: str = "REMOTE"  # what its vLLM-format KV events call its medium (vLLM's names: CPU, DISK, STORAGE...)
    locality: str = "REMOTE"  # LOCAL (this node's own) or REMOTE, in the same events
    #: what ``kvxfer serve --check`` asks before a start (settings -> why it would not work now, or None)
    ask: Callable[[Any], str | None] | None = None
    shared: bool = False  # other nodes read it: a group reaches it as its ``Reach`` says (``kvxfer.tiers.reach``)


def _store(cls: type) -> Callable[[Any, GroupContext], LowerTier]:
    return lambda settings, group: cls(settings, group.name, group.fingerprint, group.block_bytes, group.events)


def _disk(settings: Any, group: GroupContext) -> LowerTier:
    return DiskStore(settings, group.name, group.fingerprint, group.block_bytes, group.events, group.tenants)


def _object(settings: Any, group: GroupContext) -> LowerTier:
    from kvxfer.tiers.object.store import ObjectTier  # (the object-store client: only when configured)

    return ObjectTier(settings, group.name, group.fingerprint, group.block_bytes, group.events)


def _mooncake(settings: Any, group: GroupContext) -> LowerTier:
    from kvxfer.tiers.mooncake.store import MooncakeTier  # (the Mooncake wheel: only when configured)

    return MooncakeTier(settings, group.name, group.fingerprint, group.block_bytes, group.events, group.host_memory)


LOWER_TIERS: list[TierRow] = [
    # this node's own: divided between tenants as the host tier
    TierRow(TierKind.DISK, "disk", _disk, disk.parse, disk.KEYS, "DISK", "LOCAL"),
    TierRow(TierKind.SHARED_FS, "shared_fs", _store(SharedFsStore), shared_fs.parse, shared_fs.KEYS, "SHARED_FS",
            shared=True),
    TierRow(TierKind.PEER, "peering", peer.PeerTier),  # other nodes' daemons: after the local tiers, before Redis
    # the cluster's pooled memory: "CPU", as vLLM's own Mooncake Store connector names it
    TierRow(TierKind.MOONCAKE, "mooncake", _mooncake, mooncake.parse, mooncake.KEYS, "CPU",
            ask=mooncake_reach.unreachable, shared=True),
    TierRow(TierKind.REMOTE, "remote", _store(RemoteStore), remote.parse, remote.KEYS, shared=True),
    # the bucket: shared, slowest, last ("STORAGE": what vLLM 0.33's own object tier publishes)
    TierRow(TierKind.OBJECT, "object", _object, object_settings.parse, object_settings.KEYS, "STORAGE", shared=True),
]


class _Named:
    """A group's events under its own name, whatever the tier calls the group (a token's group: its digest)."""

    def __init__(self, events: Any, name: str) -> None:
        self._events, self._name = events, name

    def tier(self, kind: TierKind, cache_group: str) -> Any:
        return self._events.tier(kind, self._name)


def _reached(settings: Any, group: GroupContext) -> tuple[Any, GroupContext]:
    """A shared tier's settings and group context with the group's reach applied: its name there, its MAC key."""
    reach = group.reach
    if reach.kind is ReachKind.SHARED:
        return settings, group
    events = _Named(group.events, group.name) if group.events is not None else None
    return (replace(settings, secret=reach.secret(settings.secret)),
            replace(group, name=reach.name(group.name), events=events))


def placements() -> dict[TierKind, tuple[str, str]]:
    """Each tier's (medium, locality) as vLLM's KV events name them: the host tier's, then the rows'."""
    return {TierKind.HOST: ("CPU", "LOCAL")} | {row.kind: (row.medium, row.locality) for row in LOWER_TIERS}


def staged_blocks(sources: Mapping[str, object]) -> int:
    """Blocks of each cache group's that its lower tiers may hold in memory on their way down (the settings
    of a tier with a write queue say how many: ``staged_blocks``)."""
    return sum(int(getattr(source, "staged_blocks", 0)) for source in sources.values())


def client_bytes(sources: Mapping[str, object]) -> int:
    """Host memory each cache group's lower tiers take beside their write queues (a Mooncake client's segment and
    transfer buffer: the settings of such a tier say how much, ``client_bytes``)."""
    return sum(int(getattr(source, "client_bytes", 0)) for source in sources.values())


def unanswered(sources: Mapping[str, object]) -> list[str]:
    """What a start would find: for each configured tier that can be asked before it is made, why it would not
    work now (its server not answering, a device missing), one line naming the setting."""
    lines = []
    for row in LOWER_TIERS:
        source = sources.get(row.section)
        if source is not None and row.ask is not None:
            why = row.ask(source)
            if why is not None:
                lines.append(why)
    return lines


def lower_tiers(sources: Mapping[str, object] | None = None, /, **named: object) -> LowerTierFactory:
    """The factory a cache group is given: the tiers whose source is given (settings by config section,
    ``peering``: the daemon's ``Peering``), top down. ``lower_tiers(disk=DiskSettings(...))`` for one."""
    given = {**(sources or {}), **named}
    unknown = set(given) - {r.section for r in LOWER_TIERS}
    if unknown:
        raise Internal(f"no lower tier has the config section {sorted(unknown)}")
    present = [(r, given[r.section]) for r in LOWER_TIERS if given.get(r.section) is not None]

    def make(group: GroupContext) -> list[LowerTier]:
        made: list[LowerTier] = []
        try:
            for r, source in present:
                if not r.shared:
                    made.append(r.make(source, group))
                elif group.reach.kind is not ReachKind.NODE:  # (a group kept to this node has no shared tier)
                    made.append(r.make(*_reached(source, group)))
        except BaseException:  # a tier that cannot start: those made before it stop (threads, locks)
            for tier in made:
                tier.close()
            raise
        return made

    return make
