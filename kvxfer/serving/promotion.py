"""Promotion, written once for every lower tier: a restore's keys brought up into host slots.

The tier finds what it holds and holds it (``LowerTier.fetch``); the group reserves host slots
(``prepare_store``: evicting, and so demoting, others); the tier copies each block's verified
bytes into its slot; the group publishes the good blocks and drops the rest, and the tier is
told which were corrupt (it removes them).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvxfer.core.records import Outcome
from kvxfer.tiers.lower import LowerTier

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


def promote(tier: LowerTier, group: CacheGroup, namespace: str, keys: list[bytes]) -> dict[bytes, Outcome]:
    """Move the named blocks ``tier`` holds into ``group``'s host tier; returns the keys that failed (DATA_LOSS,
    FAILED, or RESOURCE_EXHAUSTED: held there, but the host tier had no room for them)."""
    fetch = tier.fetch(namespace, keys)
    corrupt: set[int] = set()
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
            for (j, _), slot, (verdict, checksum) in zip(targets, plan.slots, fetch.read(targets)):
                if verdict is Outcome.DONE:
                    checksums[slot] = checksum
                elif verdict in FAILURES:
                    failed[fetch.keys[j]] = verdict
                    if verdict is Outcome.DATA_LOSS:
                        corrupt.add(j)
        finally:  # whatever happens, the reserved slots are completed (else they stay pinned, unseen)
            group.publish(plan.slots, [checksums.get(s) for s in plan.slots],
                          formats=[fetch.formats[j] for j in plan.positions])
        return failed
    finally:
        fetch.end(corrupt)
