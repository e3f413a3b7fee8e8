"""Promotion, written once for every lower tier: a restore's keys brought up into host slots.

The tier finds what it holds and holds it (``LowerTier.fetch``); the group reserves host slots
(``prepare_store``: evicting, and so demoting, others); the tier copies each block's verified
bytes into its slot; the group publishes the good blocks and drops the rest, and the tier is
told which were corrupt (it removes them). A tier whose check is a pass of its own (a peer's
blocks, read by NIXL) may leave it to the restore's copy into the engine's pool (``Held``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvxfer.core.records import Outcome
from kvxfer.index.block_index import Plan
from kvxfer.tiers.lower import CheckedLater, LowerTier

if TYPE_CHECKING:
    from kvxfer.serving.group import CacheGroup

#: The verdicts that fail a key (NOT_FOUND leaves it to the host tier and the next lower tier).
FAILURES = (Outcome.DATA_LOSS, Outcome.FAILED)


class InFlight:
    """The keys being promoted now, so that restores asking for one key at once (the ranks of a TP engine
    after a restart) share one promotion: the first promotes it, the others wait for it to end. (Without
    this the others found the key's host entry pending, stored nothing and loaded nothing: NOT_FOUND.)"""

    def __init__(self) -> None:
        self._busy: dict[tuple[str, bytes], threading.Event] = {}
        self._lock = threading.Lock()

    def claim(self, namespace: str, keys: list[bytes]) -> tuple[list[bytes], list[threading.Event]]:
        """The keys this caller promotes (``release`` must follow), and the promotions of the others to wait for."""
        mine: list[bytes] = []
        waits: dict[int, threading.Event] = {}
        ours = threading.Event()  # one for all of this caller's keys
        with self._lock:
            for key in keys:
                event = self._busy.setdefault((namespace, key), ours)
                if event is ours:
                    mine.append(key)
                else:
                    waits[id(event)] = event
        return mine, list(waits.values())

    def release(self, namespace: str, keys: list[bytes]) -> None:
        """The caller's promotion of ``keys`` ended (whatever came of it): whoever waits for it goes on."""
        with self._lock:
            events = {id(e): e for e in (self._busy.pop((namespace, key)) for key in keys)}
        for event in events.values():
            event.set()


class Held:
    """Blocks promotions read into host slots and left unpublished, for the restore that copies them into the
    engine's pool to check in that copy (it hashes as it copies): one pass over the bytes fewer than checking
    them first. The restore ``settle``s each slot: checked good, it is published (others may read it then);
    else it is dropped, never seen. Once every slot is settled each tier is told what was corrupt and the
    keys' promotion ends (restores waiting for it go on)."""

    def __init__(self, group: CacheGroup, namespace: str) -> None:
        self.group, self.namespace = group, namespace
        self.keys: dict[bytes, int] = {}  # key -> its host slot
        self._by_slot: dict[int, tuple[CheckedLater, int, int, int]] = {}  # slot -> (fetch, j, checksum, format)
        self._fetches: dict[int, tuple[CheckedLater, dict[int, bool]]] = {}  # id -> (fetch, j -> checked good)
        self._when_done: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def add(self, fetch: CheckedLater, j: int, slot: int, checksum: int) -> None:
        self.keys[fetch.keys[j]] = slot
        self._by_slot[slot] = (fetch, j, checksum, fetch.formats[j])
        self._fetches.setdefault(id(fetch), (fetch, {}))

    def expected(self, slot: int) -> int:
        """The checksum the block in ``slot`` must have: the one its tier gave."""
        return self._by_slot[slot][2]

    def when_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once every slot is settled (now, if none is held)."""
        with self._lock:
            if self._by_slot:
                self._when_done.append(fn)
                return
        fn()

    def settle(self, good: Iterable[int], bad: Iterable[int] = ()) -> dict[int, Outcome]:
        """Publish the held slots in ``good`` (their copy's checksum matched) and drop those in ``bad`` (it did
        not, or they were not copied: unchecked). Returns the outcome each slot of ``bad`` gets if its copy found
        it wrong: DATA_LOSS, or NOT_FOUND where its tier says the block could have changed under the read."""
        good, bad = [s for s in good if s in self._by_slot], [s for s in bad if s in self._by_slot]
        outcomes = {s: self._by_slot[s][0].mismatch(self._by_slot[s][1]) for s in bad}
        slots = good + bad
        if not slots:
            return outcomes
        self.group.publish(slots, [self._by_slot[s][2] for s in good] + [None] * len(bad),
                           formats=[self._by_slot[s][3] for s in slots])
        with self._lock:
            for s, ok in [(s, True) for s in good] + [(s, False) for s in bad]:
                fetch, j, _, _ = self._by_slot.pop(s)
                self._fetches[id(fetch)][1][j] = ok
            if self._by_slot:
                return outcomes
            finished, self._when_done = self._when_done, []
            ends, self._fetches = list(self._fetches.values()), {}
        for fetch, checked in ends:
            fetch.end(fetch.checked(checked))
        for fn in finished:
            fn()
        return outcomes

    def drop(self) -> None:
        """Drop every slot not settled yet (the restore failed before its copy)."""
        self.settle((), list(self._by_slot))

    def endings(self, plan: Plan, corrupt: set[int], copied: int
                ) -> tuple[Callable[[list[int]], None], Callable[[], None]]:
        """How a restore of ``plan`` ends (``PoolManager._complete``'s ``release`` and ``complete``) when some of
        its slots are held here: its copy checked ``plan.slots[:copied]``, ``corrupt`` among them wrong. Held
        slots it checked good are published, the other held ones dropped (a wrong one's outcome is this
        tier's verdict: DATA_LOSS, or NOT_FOUND); the pinned ones are unpinned as any restore's."""
        slots, group, kept = plan.slots, self.group, set(self.keys.values())

        def release(some: list[int]) -> None:  # not checked: unpinned, or dropped
            group.unpin([s for s in some if s not in kept])
            self.settle((), [s for s in some if s in kept])

        def complete() -> None:
            pinned = [j for j in range(len(slots)) if slots[j] not in kept]
            group.unpin([slots[j] for j in pinned], {n for n, j in enumerate(pinned) if j in corrupt})
            ok = {slots[j] for j in range(copied) if slots[j] in kept and j not in corrupt}
            verdicts = self.settle(ok, [s for s in slots if s in kept and s not in ok])
            for j in corrupt:
                if slots[j] in verdicts:
                    plan.outcomes[plan.positions[j]] = verdicts[slots[j]]

        return release, complete


def promote(tier: LowerTier, group: CacheGroup, namespace: str, keys: list[bytes], held: Held | None = None
            ) -> dict[bytes, Outcome]:
    """Move the named blocks ``tier`` holds into ``group``'s host tier; returns the keys that failed (DATA_LOSS,
    FAILED, or RESOURCE_EXHAUSTED: held there, but the host tier had no room for them). ``held``: where the
    tier's fetch can leave its check to whoever copies the blocks next (``CheckedLater``), the blocks read
    are left unpublished there, for the restore's copy to check."""
    fetch = tier.fetch(namespace, keys)
    later = held is not None and getattr(fetch, "checks_later", False)
    corrupt: set[int] = set()
    kept: set[int] = set()  # slots left to ``held``, which then ends the fetch
    try:
        if not fetch.keys:
            return {}
        plan = group.prepare_store(namespace, fetch.keys, engine=False)
        checksums: dict[int, int] = {}  # host slot -> checksum of what landed there
        # No host slot for it (the tier full of blocks pinned, this restore's own among them): the block is there,
        # and the restore says the tier had no room, never NOT_FOUND.
        failed: dict[bytes, Outcome] = {fetch.keys[j]: o for j, o in enumerate(plan.outcomes)
                                        if o is Outcome.RESOURCE_EXHAUSTED}
        try:
            targets = [(j, group.slot_view(slot)) for j, slot in zip(plan.positions, plan.slots)]
            read = fetch.read(targets, check=False) if later else fetch.read(targets)
            for (j, _), slot, (verdict, checksum) in zip(targets, plan.slots, read):
                if verdict is Outcome.DONE and later:
                    held.add(fetch, j, slot, checksum)
                    kept.add(slot)
                elif verdict is Outcome.DONE:
                    checksums[slot] = checksum
                elif verdict in FAILURES:
                    failed[fetch.keys[j]] = verdict
                    if verdict is Outcome.DATA_LOSS:
                        corrupt.add(j)
        finally:  # whatever happens, the reserved slots are completed (else they stay pinned, unseen)
            done = [(j, s) for j, s in zip(plan.positions, plan.slots) if s not in kept]
            group.publish([s for _, s in done], [checksums.get(s) for _, s in done],
                          formats=[fetch.formats[j] for j, _ in done])
        return failed
    finally:
        if not kept:
            fetch.end(corrupt)
