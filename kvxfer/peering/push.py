"""The pushing side: blocks this daemon holds, written into slots a peer reserved for them.

A prefill node's daemon hands a decode node's daemon a prefix before its engine asks: the peer
reserves host slots for the keys it lacks and exposes exactly those; one NIXL WRITE fills them
from this daemon's (pinned) host slots; the peer checksums each and publishes the ones that
match. A block the peer found wrong is checked here too and dropped if it is wrong here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvxfer.core.errors import PermissionDenied
from kvxfer.core.records import Outcome
from kvxfer.peering.agent import Agent, XferResult
from kvxfer.peering.counters import PeerCounters
from kvxfer.peering.group_access import PeeredGroup
from kvxfer.peering.link import PeerLink, PeerUnavailable

log = logging.getLogger("kvxfer.peering")
MARGIN_S = 0.05  # the write must end this long before the reservation does


@dataclass
class Pushed:
    outcomes: list[Outcome]  # per key: DONE (the peer holds it), NOT_FOUND (not here), FAILED, DATA_LOSS
    blocks: int = 0  # written and published there
    seconds: float = 0.0  # the WRITE's


def push(agent: Agent, link: PeerLink, counters: PeerCounters, group: PeeredGroup, namespace: str,
         keys: list[bytes], lease_ms: int) -> Pushed:
    outcomes = [Outcome.NOT_FOUND] * len(keys)
    done = Pushed(outcomes)
    plan = group.pin(namespace, keys)  # ours stay put while they are written
    corrupt: set[int] = set()
    try:
        if not plan.slots:
            return done
        held = list(plan.positions)
        for i in held:
            outcomes[i] = Outcome.FAILED
        asked = time.monotonic()
        try:
            answer = link.reserve(group.name, namespace, group.format.fingerprint, [keys[i] for i in held], lease_ms)
        except PeerUnavailable as exc:
            counters.failed(link.name, exc.cause)
            return done
        positions = [b.position for b in answer.blocks]
        every = positions + list(answer.present_positions)
        if (answer.blocks and answer.block_bytes != group.slot_bytes) or len(set(every)) != len(every) \
                or any(p >= len(held) for p in every) or (answer.blocks and not 0 < answer.lease_ms <= lease_ms):
            counters.failed(link.name, "malformed")
            log.error("a peer answered a reservation it could not have made", extra={"peer": link.name})
            return done
        for p in answer.present_positions:
            outcomes[held[p]] = Outcome.DONE
        if not answer.blocks:
            return done
        try:
            agent.learn(link.name, answer.memory_metadata)
        except PermissionDenied as exc:  # the reservation ends there unpublished at its deadline
            counters.failed(link.name, "refused")
            log.error("a peer's reservation was refused", extra={"peer": link.name, "error": str(exc)})
            return done
        pairs = [(group.slot_address(plan.slots[p]), b.address) for p, b in zip(positions, answer.blocks)]
        timeout_at = time.monotonic() + link.timeout_s
        deadline = min(timeout_at, asked + answer.lease_ms / 1000 - MARGIN_S)
        start = time.perf_counter()
        result = agent.write(link.name, pairs, group.slot_bytes, deadline)
        seconds = time.perf_counter() - start
        if result is not XferResult.DONE:  # the reservation ends there unpublished at its deadline
            counters.failed(link.name, "transfer" if result is XferResult.FAILED else "timeout")
            link.disconnect()
            return done
        try:
            stored = link.commit(answer.reservation_id, [plan.checksums[p] for p in positions])
        except PeerUnavailable as exc:
            counters.failed(link.name, exc.cause)
            return done
        for p, ok in zip(positions, stored):
            outcomes[held[p]] = Outcome.DONE if ok else Outcome.DATA_LOSS
        good = sum(stored)
        counters.moved(link.name, "out", good, good * group.slot_bytes, seconds)
        done.blocks, done.seconds = good, seconds
        suspects = [p for p, ok in zip(positions, stored) if not ok]
        if suspects:
            sums = group.slot_checksums([plan.slots[p] for p in suspects])
            corrupt = {p for p, got in zip(suspects, sums) if got != plan.checksums[p]}
            counters.failed(link.name, "corrupt", len(suspects))
        return done
    finally:
        group.unpin(plan.slots, corrupt)  # a block wrong here too is dropped
