"""Promotion, written once for every lower tier: a restore's keys brought up into host slots.

The tier finds what it holds and holds it (``LowerTier.fetch``); host slots are reserved
under the group's store lock (evicting, and so demoting, others: the caller's
``on_evicted``); the tier copies each block's verified bytes into its slot; good blocks
are published in the host index, the rest are dropped there, and the tier is told which
were corrupt (it removes them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvxfer.index.block_index import BlockIndex, Evicted
from kvxfer.records import Outcome
from kvxfer.tiers.host import HostTier
from kvxfer.tiers.lower import LowerTier

#: The verdicts that fail a key (NOT_FOUND leaves it to the host tier and the next lower tier).
FAILURES = (Outcome.DATA_LOSS, Outcome.FAILED)


def promote(tier: LowerTier, namespace: str, keys: list[bytes], host: HostTier, host_index: BlockIndex,
            store_lock: threading.Lock, on_evicted: Callable[[Evicted], None]) -> dict[bytes, Outcome]:
    """Move the named blocks ``tier`` holds into the host tier; returns the keys that failed."""
    fetch = tier.fetch(namespace, keys)
    corrupt: set[int] = set()
    try:
        if not fetch.keys:
            return {}
        with store_lock:
            plan = host_index.prepare_store(namespace, fetch.keys)
            on_evicted(plan.evicted)
        checksums: dict[int, int] = {}  # host slot -> checksum of what landed there
        failed: dict[bytes, Outcome] = {}
        try:
            targets = [(j, host.buffer[slot]) for j, slot in zip(plan.positions, plan.slots)]
            for (j, _), slot, (verdict, checksum) in zip(targets, plan.slots, fetch.read(targets)):
                if verdict is Outcome.DONE:
                    checksums[slot] = checksum
                elif verdict in FAILURES:
                    failed[fetch.keys[j]] = verdict
                    if verdict is Outcome.DATA_LOSS:
                        corrupt.add(j)
        finally:  # whatever happens, the reserved slots are completed (else they stay pinned, unseen)
            host_index.complete_store(plan.slots, [checksums.get(s) for s in plan.slots])
        return failed
    finally:
        fetch.end(corrupt)
