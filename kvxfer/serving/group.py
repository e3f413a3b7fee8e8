"""Cache groups: a host tier and its index, shared by pools whose blocks are interchangeable.

An engine that restarts allocates a new pool; if it registers that pool in the same
cache group as before, it finds the blocks its previous process offloaded (the warm
cache outlives the engine). Pools join a group only if their blocks have the same format
byte for byte. Tensor-parallel ranks registered with their ``Sharding`` share one group of
canonical blocks (every head, one order), which engines of any TP size and layout store
and restore (``kvxfer.serving.assembly``); ranks registered without one need a group each.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from kvxfer.core.errors import FailedPrecondition
from kvxfer.core.records import HintAction, Outcome, TierKind, TierStats
from kvxfer.events.event_hub import EventHub, ScopedEvents
from kvxfer.events.event_records import EngineBlocks, Reason
from kvxfer.geometry.block_checksum import FORMAT as CHECKSUM_FORMAT
from kvxfer.geometry.layout import PoolLayout, dtype_name
from kvxfer.geometry.sharding import Manifest
from kvxfer.index.admission import Admission, AdmissionSettings
from kvxfer.index.block_index import BlockIndex, Evicted, Plan
from kvxfer.index.hintbook import DEFAULT_SHARE, HintStats
from kvxfer.index.tenancy import Tenant
from kvxfer.serving.assembly import Assembly, Verified
from kvxfer.serving.promotion import Held, InFlight, promote
from kvxfer.tiers.host import HostTier
from kvxfer.tiers.lower import GroupContext, LowerTier, LowerTierFactory
from kvxfer.tiers.reach import SHARED, Reach
from kvxfer.transfer import native


class Reservations(Protocol):
    """Peers' reservations of host slots for blocks they push here (``kvxfer.peering.leases.LeaseTable``)."""

    def yield_to_engine(self, group: CacheGroup, namespace: str, keys: list[bytes]) -> None:
        """The local engine stores ``keys``: a peer's reservation of any of them gives it up."""


@dataclass(frozen=True)
class BlockFormat:
    """What makes two pools' blocks interchangeable: everything but the number of blocks."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    layout: str  # the general form, outermost first
    kv_parts: int = 2
    manifest: str = ""  # canonical blocks: the hex digest of their manifest (kvxfer.geometry.sharding)

    @classmethod
    def of(cls, layout: PoolLayout, manifest: Manifest | None = None) -> BlockFormat:
        s = layout.spec
        return cls(s.num_layers, s.block_size, s.num_kv_heads, s.head_size, dtype_name(s.dtype), layout.layout.spelled,
                   s.kv_parts, manifest.digest.hex() if manifest is not None else "")

    @property
    def fingerprint(self) -> bytes:
        """Stored with every block below host memory, and what peers match groups by: a block of another
        format is never served or exchanged. It covers the block checksum's format
        (``kvxfer.geometry.block_checksum.FORMAT``): blocks stored with another (the whole-span XXH3 before
        2026-12) are dropped once, as foreign."""
        text = repr(self).replace(", manifest='')", ")")
        text = text if self.kv_parts != 2 else text.replace(", kv_parts=2)", ")")
        return hashlib.sha256(f"{text}\0{CHECKSUM_FORMAT}".encode()).digest()

    def bound_to(self, group: str) -> bytes:
        """The fingerprint of this format in cache group ``group``: a block another group wrote (a file
        or value copied across by someone who can write the tier) is never served here."""
        return hashlib.sha256(b"kvxfer-group\0" + self.fingerprint + group.encode()).digest()


PROMOTION_WAIT_S = 10.0  # how long a request without a deadline waits for another's promotion or an index's load


class CacheGroup:
    """One host tier and the index over it, and the lower tiers below it (``LowerTier``), top down."""

    def __init__(self, name: str, layout: PoolLayout, capacity_blocks: int, pin_device: int | None = None,
                 lower: LowerTierFactory | None = None, kv_events: EventHub | ScopedEvents | None = None,
                 manifest: Manifest | None = None, reservations: Reservations | None = None,
                 admission: AdmissionSettings | None = None, tenants: Sequence[Tenant] = (),
                 hash_threads: int = 1, hint_share: float = DEFAULT_SHARE, reach: Reach = SHARED) -> None:
        """``lower``: makes the group's lower tiers, top down (``kvxfer.tiers.registry.lower_tiers``).
        ``kv_events``: where every tier of the group announces blocks becoming restorable and going.
        ``manifest``: the group holds canonical blocks (``layout`` is theirs), assembled from rank pools.
        ``reservations``: peers' pushes into this group, which the local engine's stores come before.
        ``admission``: which new blocks engines' offloads store (``kvxfer.index.admission``; none: all).
        ``tenants``: their guaranteed shares of the host tier and of the disk tier (``kvxfer.index.tenancy``).
        ``hash_threads``: threads that checksum host slots (what peers and lower tiers read into them).
        ``hint_share``: of the host tier, per tenant, what retained and prefetched blocks may hold.
        ``reach``: who may find its blocks on the tiers other nodes read (``kvxfer.tiers.reach``)."""
        self.name = name
        self.event_scope = kv_events.scope if kv_events is not None else 0  # who sees its events (EventHub.scoped)
        self.format = BlockFormat.of(layout, manifest)
        self.assembly = Assembly(layout.spec.num_kv_heads) if manifest is not None else None
        self.verified = Verified(capacity_blocks) if manifest is not None else None  # ranks verify a block once
        self.host = HostTier(capacity_blocks, layout.block_bytes, pin_device=pin_device, hasher=native.load(),
                             hash_threads=hash_threads)
        self.index = BlockIndex(self.host.kind, self.host.slots,
                                events=kv_events.tier(self.host.kind, name) if kv_events else None, tenants=tenants,
                                hint_share=hint_share)
        self.closed = False
        self.hints = dict.fromkeys(HintAction, 0)  # hints taken, by action (RPCs and offloads)
        if self.verified is not None:
            self.index.track_pin_runs()
        # Held from a batch's slot reservation until the blocks it evicted are copied out of
        # their slots (demotion): no other batch may write those slots before.
        self.store_lock = threading.Lock()
        self.admission = Admission(admission) if admission is not None and admission.active else None
        self._promoting = InFlight()  # keys being promoted: restores of one key at once share one promotion
        self._reservations = reservations
        #: what the group's lower tiers are told of it
        self.context = GroupContext(name, layout.block_bytes, self.format.bound_to(name), self.format.fingerprint,
                                    (self.host.buffer.data_ptr(), self.host.buffer.numel()), kv_events,
                                    self.host.checksums, tuple(tenants), reach)
        self.lower_tiers: list[LowerTier] = lower(self.context) if lower is not None else []

    def tier(self, kind: TierKind) -> LowerTier | None:
        """The group's lower tier of this kind, if it has one."""
        return next((t for t in self.lower_tiers if t.kind is kind), None)

    def reading_from(self, source: str, router: bool = False) -> list[LowerTier]:
        """The group's peer tier reading from the one peer ``source`` names alone (``router``: a router's word,
        which may name it by address too); none where the group has no peer tier or no peer is named so."""
        tier = self.tier(TierKind.PEER)
        view = tier.only(source, by_address=router) if tier is not None else None  # (PeerTier.only)
        return [view] if view is not None else []

    @property
    def lower(self) -> bool:
        return bool(self.lower_tiers)

    @property
    def restart_warm(self) -> bool:
        """Whether a tier keeps the host tier's blocks across a restart (``demote_all`` writes them there)."""
        return any(t.restart_warm for t in self.lower_tiers)

    # -- the host tier's blocks, for those who serve them directly (peers' leases, pushes) ---------------
    @property
    def slot_bytes(self) -> int:
        return self.host.slot_bytes

    @property
    def capacity(self) -> int:
        """Host tier slots."""
        return self.host.capacity

    def slot_address(self, slot: int) -> int:
        return self.host.buffer[slot].data_ptr()

    def slot_view(self, slot: int) -> torch.Tensor:
        """A host slot's bytes (a view: a lower tier's fetch reads a block into it)."""
        return self.host.buffer[slot]

    def slot_checksums(self, slots: list[int]) -> list[int]:
        """The checksum of each host slot's bytes as they are now."""
        return self.host.checksums(slots)

    def holds(self, namespace: str, keys: list[bytes]) -> list[bool]:
        """Which keys the host tier holds (the lower tiers are not asked)."""
        return [tier is not None for tier in self.index.tiers_of(namespace, keys)]

    def pin(self, namespace: str, keys: list[bytes]) -> Plan:
        """The host slots of the keys it holds, pinned (neither evicted nor overwritten) until ``unpin``."""
        return self.index.prepare_load(namespace, keys)

    def unpin(self, slots: Sequence[int], corrupt: set[int] = frozenset()) -> None:
        """End a ``pin``; ``slots[j]`` for j in ``corrupt`` is dropped, never served again."""
        self.index.complete_load(slots, corrupt)

    def publish(self, slots: Sequence[int], checksums: list[int | None], engine: EngineBlocks | None = None,
                formats: Sequence[int] | None = None) -> None:
        """End a ``prepare_store``: the slots whose checksum is given become visible; the others are freed.
        ``engine``, ``formats``: what the events name the blocks by (``BlockIndex.complete_store``)."""
        self.index.complete_store(slots, checksums, engine, formats)

    def pin_runs(self, slots: np.ndarray) -> np.ndarray:
        """Each pinned slot's pin run (canonical groups: ranks verify a block once a run)."""
        return self.index.pin_runs(slots)

    def give_up(self, slots: Sequence[int]) -> None:
        """Reserved or stored slots' keys become free now (their slots are freed once unpinned)."""
        self.index.drop_slots(slots)

    def key_indexes(self) -> list[BlockIndex]:
        """The indexes that name the group's keys: the host tier's, and those of lower tiers that keep one (the
        disk's): a Snapshot lists them all."""
        return [self.index] + [t.index for t in self.lower_tiers if t.index is not None]

    def prepare_store(self, namespace: str, keys: list[bytes], engine: bool = True, admit: bool = False) -> Plan:
        """Host slots for new keys; the blocks evicted to make room go to the lower tiers. ``engine``: the local
        engine stores them, which comes first: a peer's reservation of the same keys gives them up. ``admit``:
        the group's admission rules decide which new keys are stored (the others: NOT_ADMITTED)."""
        with self.store_lock:
            if engine and self._reservations is not None:
                self._reservations.yield_to_engine(self, namespace, keys)
            admitted = None
            if admit and self.admission is not None:
                admitted = self.admission.admit(namespace, keys, self.index.contains(namespace, keys))
                if all(admitted):
                    admitted = None
            plan = self.index.prepare_store(namespace, keys if admitted is None else
                                            [k for k, ok in zip(keys, admitted) if ok])
            if plan.evicted:
                self._demote(plan.evicted)
            return plan if admitted is None else _widened(plan, admitted)

    def _demote(self, victims: Evicted) -> None:
        """(store lock held) Copy evicted blocks out of their host slots before those are reused."""
        for tier in self.lower_tiers:
            if tier.takes_evictions:
                for namespace, code in dict.fromkeys((v.namespace, v.key_format) for v in victims):
                    tier.stage(namespace, [(v.key, v.checksum, self.host.buffer[v.slot]) for v in victims
                                           if (v.namespace, v.key_format) == (namespace, code)], code)

    def write_through(self, namespace: str, keys: list[bytes], slots: Sequence[int], checksums: list[int | None],
                      key_format: int = 0) -> None:
        """Send blocks just stored (still pinned) to the write-through tiers as well."""
        for tier in self.lower_tiers:
            if tier.takes_stores:
                tier.stage(namespace, [(k, c, self.host.buffer[s]) for k, s, c in zip(keys, slots, checksums)
                                       if c is not None], key_format)

    def promote(self, namespace: str, keys: list[bytes], tiers: list[LowerTier] | None = None,
                deadline: float | None = None, held: Held | None = None) -> dict[bytes, Outcome]:
        """Bring the named keys up from the lower tiers (or ``tiers``), top down; returns those that failed
        (DATA_LOSS, FAILED; RESOURCE_EXHAUSTED: held below, but the host tier had no room for them). Keys another
        restore is promoting now are waited for (until ``deadline``, ``time.monotonic()``; else
        ``PROMOTION_WAIT_S``), not promoted twice. ``held``: blocks a tier lets the caller's copy check are left
        there, unpublished (``kvxfer.serving.promotion.Held``); their promotion ends once it settles them."""
        until = deadline if deadline is not None else time.monotonic() + PROMOTION_WAIT_S
        mine, waits = self._promoting.claim(namespace, keys)
        try:
            failed = self._promote(namespace, mine, tiers, until, held) if mine else {}
        except BaseException:
            self._promoting.release(namespace, mine)
            raise
        if held is None:
            self._promoting.release(namespace, mine)
        else:
            held.when_done(lambda: self._promoting.release(namespace, mine))
        for event in waits:
            event.wait(max(0.0, until - time.monotonic()))
        return failed

    def _promote(self, namespace: str, keys: list[bytes], tiers: list[LowerTier] | None, until: float,
                 held: Held | None) -> dict[bytes, Outcome]:
        failed: dict[bytes, Outcome] = {}
        for tier in self.lower_tiers if tiers is None else tiers:
            tier.wait_ready(until)
            missing = [k for k, t in zip(keys, self.index.tiers_of(namespace, keys))
                       if t is None and k not in failed and (held is None or k not in held.keys)]
            if missing:
                failed.update(promote(tier, self, namespace, missing, held))
        return failed

    def tiers_of(self, namespace: str, keys: list[bytes], deadline: float | None = None) -> list[TierKind | None]:
        """Where each key is, top down. A lower tier still loading its index is waited for (until ``deadline``,
        else ``PROMOTION_WAIT_S``): a restarted daemon answers for what its disk holds from the first request."""
        tiers = self.index.tiers_of(namespace, keys)
        until = deadline if deadline is not None else time.monotonic() + PROMOTION_WAIT_S
        for tier in self.lower_tiers:
            missing = [i for i, t in enumerate(tiers) if t is None]
            if not missing:
                break
            tier.wait_ready(until)
            for i, there in zip(missing, tier.contains(namespace, [keys[i] for i in missing], until)):
                tiers[i] = tier.kind if there else None
        return tiers

    def hint(self, namespace: str, keys: list[bytes], action: HintAction, until: float = 0.0,
             counted: bool = True) -> int:
        """RETAIN (until ``until``, ``time.monotonic()``) or RELEASE these keys' blocks in every tier that keeps an
        eviction order of its own (host, disk); how many blocks it changed. ``counted``: a hint someone sent (not
        a prefetch's retention of what it brought up), counted in ``hints``."""
        if counted:
            self.hints[action] += 1  # (a statistic: a lost increment between threads is harmless)
        return sum(index.hints.hint(namespace, keys, action, until) for index in self.key_indexes())

    def prefetch_room(self, namespace: str, want: int) -> int:
        """How many blocks (up to ``want``) a prefetch may bring up to the host tier within the tenant's share."""
        return self.index.hints.room(namespace, want)

    def prefetched(self, namespace: str, keys: list[bytes]) -> int:
        """The host tier's blocks of these keys came up by a prefetch; how many it holds."""
        return self.index.hints.mark_prefetched(namespace, keys)

    def hint_stats(self) -> list[tuple[TierKind, HintStats]]:
        """Each tier's hinted blocks (host, disk)."""
        return [(index.tier, index.hints.stats()) for index in self.key_indexes()]

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        return self.index.delete(namespace, keys) + sum(t.delete(namespace, keys) for t in self.lower_tiers)

    def _declined(self) -> dict[str, int]:
        """New blocks admission declined, by rule (none without admission)."""
        a = self.admission
        return {} if a is None else {"declined_store_threshold": a.declined_threshold,
                                     "declined_request_cap": a.declined_cap}

    def tier_stats(self) -> list[TierStats]:
        i = self.index.stats()
        host = TierStats(i.tier, i.capacity, i.used, i.ready, i.pinned, i.evictions, self.host.slot_bytes,
                         events={"refaults": i.refaults, **self._declined()}, tenants=i.tenants,
                         warming=not self.host.populated.is_set())
        return [host] + [t.stats() for t in self.lower_tiers]

    def demote_all(self, timeout: float) -> int:
        """Write the host tier's blocks down to the tiers that keep them across restarts, most recent
        first, for up to ``timeout`` seconds (a rolling restart keeps the cache warm); returns how many."""
        warm = [t for t in self.lower_tiers if t.restart_warm]
        if not warm:
            return 0
        deadline = time.monotonic() + timeout
        written = 0
        pending = list(reversed(self.index.entries()))
        for first in range(0, len(pending), 64):
            if time.monotonic() >= deadline:
                break
            by_ns: dict[tuple[str, int], list] = {}
            for namespace, key, slot, checksum, code in pending[first:first + 64]:
                by_ns.setdefault((namespace, code), []).append((key, slot, checksum))
            for (namespace, code), items in by_ns.items():
                keys = [k for k, _, _ in items]
                plan = self.index.prepare_load(namespace, keys)  # pinned: not reused meanwhile
                try:
                    blocks = [(keys[i], checksum, self.host.buffer[slot])
                              for i, slot, checksum in zip(plan.positions, plan.slots, plan.checksums)]
                    written += sum(tier.write_now(namespace, blocks, code) for tier in warm)
                finally:
                    self.index.complete_load(plan.slots)
        return written

    def close(self, timeout: float = 0.0, announce: bool = True) -> None:
        """Stop serving. ``announce``: the host tier's blocks (freed with the group) and the disk's (not
        served until the group is made again) are announced removed (not when the daemon stops: its
        event stream ends with it); shared tiers keep theirs."""
        self.closed = True  # (queued prefetches of it are dropped)
        for tier in self.lower_tiers:
            tier.close(timeout)
        if announce:
            for index in self.key_indexes():
                index.announce_all(Reason.CLEARED)

    def check_joins(self, layout: PoolLayout, manifest: Manifest | None = None) -> None:
        """Refuse a pool whose blocks are not byte-compatible with this group's (``layout``, ``manifest``:
        of the blocks it stores, canonical for a rank pool)."""
        fmt = BlockFormat.of(layout, manifest)
        if fmt != self.format:
            raise FailedPrecondition(f"cache group {self.name!r} holds blocks of {self.format}; a pool of {fmt} "
                                     "cannot join it (use another cache group)")


def _widened(plan: Plan, admitted: list[bool]) -> Plan:
    """A plan for the admitted keys, as one for the whole batch: the others NOT_ADMITTED."""
    at = [i for i, ok in enumerate(admitted) if ok]
    outcomes = [Outcome.NOT_ADMITTED] * len(admitted)
    for j, outcome in enumerate(plan.outcomes):
        outcomes[at[j]] = outcome
    return replace(plan, outcomes=outcomes, positions=[at[p] for p in plan.positions])
