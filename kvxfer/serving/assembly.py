"""Canonical blocks assembled from the ranks of tensor-parallel engines (bookkeeping only).

Each rank offloads its own heads of a block: its own request, on its own pool, behind its
own engine's event. The first rank to offload a key reserves a host slot for it (a
pending, invisible entry of the index); each rank writes its heads' slice; once every
head is written and no rank is still writing, the rank that wrote last hashes the slot
and makes the entry visible. Heads several ranks hold (more ranks than KV heads; an MLA
latent, the same on every rank) are written once: a rank whose heads are in already
copies nothing (ALREADY_PRESENT). Ranks of engines of another TP size fill the same
entries with their own slices.

An entry is never given up while a rank may still write its slot. One that a rank failed
to write, or whose heads are not all in ``timeout_s`` after its reservation (a rank died),
is dropped, never visible.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvxfer.core.records import Outcome
from kvxfer.index.entries import Plan

#: How long an entry may wait for its other ranks' slices (the engine's ranks offload the same step).
ASSEMBLY_TIMEOUT_S = 60.0


@dataclass
class _Pending:
    slot: int
    since: float  # time.monotonic() of the reservation
    heads: int = 0  # bit h: head h is written
    writers: int = 0  # ranks copying into the slot now
    failed: bool = False


@dataclass
class Claim:
    """One rank's share of an offload: the batch positions it copies, into which slots."""

    namespace: str
    mask: int  # the rank's heads
    outcomes: list[Outcome]
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)


@dataclass
class Settled:
    """Entries a settle finished: ``complete`` (slot, key) have every head and are to be published;
    ``dropped`` slots are to be forgotten (never visible)."""

    complete: list[tuple[int, bytes]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)


class Assembly:
    """The pending canonical entries of one cache group. Thread-safe."""

    def __init__(self, num_heads: int, timeout_s: float = ASSEMBLY_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.full = (1 << num_heads) - 1
        self.timeout_s = timeout_s
        self._clock = clock
        self._pending: dict[tuple[str, bytes], _Pending] = {}
        self._next_sweep = 0.0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pending)

    def claim(self, namespace: str, keys: list[bytes], mask: int, prepare: Callable[[str, list[bytes]], Plan]
              ) -> tuple[Claim, list[int]]:
        """The positions of ``keys`` this rank (heads ``mask``) copies; ``prepare`` reserves slots for keys
        not pending (the group's ``prepare_store``). Also returns expired slots to forget."""
        with self._lock:
            expired = self._sweep()
            claim = Claim(namespace, mask, [Outcome.DONE] * len(keys))
            new: list[int] = []
            for i, key in enumerate(keys):
                entry = self._pending.get((namespace, key))
                if entry is None:
                    new.append(i)
                elif entry.failed or entry.heads & mask == mask:
                    claim.outcomes[i] = Outcome.FAILED if entry.failed else Outcome.ALREADY_PRESENT
                else:
                    entry.writers += 1
                    claim.positions.append(i)
                    claim.slots.append(entry.slot)
            if new:
                try:
                    plan = prepare(namespace, [keys[i] for i in new])
                except BaseException:  # nothing claimed: the entries this call joined are not written by it
                    for key in (keys[i] for i in claim.positions):
                        self._pending[(namespace, key)].writers -= 1
                    raise
                now = self._clock()
                for j, i in enumerate(new):
                    claim.outcomes[i] = plan.outcomes[j]
                for j, slot in zip(plan.positions, plan.slots):
                    i = new[j]
                    self._pending[(namespace, keys[i])] = _Pending(slot, now, writers=1)
                    claim.positions.append(i)
                    claim.slots.append(slot)
            order = sorted(range(len(claim.positions)), key=claim.positions.__getitem__)
            claim.positions = [claim.positions[j] for j in order]
            claim.slots = [claim.slots[j] for j in order]
            claim.keys = [keys[i] for i in claim.positions]
            return claim, expired

    def settle(self, claim: Claim, written: int) -> Settled:
        """The rank wrote the first ``written`` of its claim's slots; the others it did not (failed,
        cancelled, late): their entries are dropped once nobody writes them."""
        done = Settled()
        with self._lock:
            for j, (slot, key) in enumerate(zip(claim.slots, claim.keys)):
                entry = self._pending[(claim.namespace, key)]
                entry.writers -= 1
                if j < written:
                    entry.heads |= claim.mask
                else:
                    entry.failed = True
                if entry.writers:
                    continue
                if entry.failed:
                    del self._pending[(claim.namespace, key)]
                    done.dropped.append(slot)
                elif entry.heads == self.full:
                    del self._pending[(claim.namespace, key)]
                    done.complete.append((slot, key))
            done.dropped += self._sweep()
        return done

    def sweep(self) -> list[int]:
        """Slots of entries past their time with nobody writing: to forget."""
        with self._lock:
            return self._sweep(force=True)

    def _sweep(self, force: bool = False) -> list[int]:
        now = self._clock()
        if not self._pending or (now < self._next_sweep and not force):
            return []
        self._next_sweep = now + min(1.0, self.timeout_s / 4)  # a scan of every entry: not on every call
        cutoff = now - self.timeout_s
        gone = [k for k, e in self._pending.items() if e.writers == 0 and (e.failed or e.since < cutoff)]
        return [self._pending.pop(k).slot for k in gone]


class Verified:
    """Stored blocks verified during their current pin run (``BlockIndex.pin_runs``): the ranks restoring a
    block while any of them holds it pinned verify its checksum once, not once a rank (a complete, pinned
    entry's bytes are never rewritten); a rank that finds another verifying a block waits for its answer.
    A new run (the slot unpinned, then pinned again) verifies again."""

    def __init__(self, capacity: int) -> None:
        self._runs = np.zeros(capacity, dtype=np.int64)  # the run in which each slot was verified good (0: none)
        self._busy: dict[int, threading.Event] = {}  # slot -> set once the rank verifying it has its answer
        self._lock = threading.Lock()

    def share(self, slots: np.ndarray, runs: np.ndarray, tried: set[int], limit: int
              ) -> tuple[list[int], list[threading.Event]]:
        """Up to ``limit`` positions of ``slots`` (none in ``tried``) this caller verifies next (now marked as
        being verified: ``done`` must follow), and the answers of other ranks' verifications to wait for.
        Ranks that ask at once take turns, a few blocks each: they verify a batch together."""
        with self._lock:
            mine, waits = [], []
            for j in np.flatnonzero(self._runs[slots] != runs).tolist():
                event = self._busy.get(int(slots[j]))
                if event is not None:
                    waits.append(event)
                elif j not in tried and len(mine) < limit:
                    self._busy[int(slots[j])] = threading.Event()
                    mine.append(j)
            return mine, waits

    def done(self, slots: np.ndarray, runs: np.ndarray, good: list[bool]) -> None:
        """This caller's answers for the slots ``share`` gave it (``good``: each one's checksum matched)."""
        with self._lock:
            ok = np.asarray(good, dtype=bool)
            self._runs[slots[ok]] = runs[ok]
            for slot in slots.tolist():
                self._busy.pop(slot).set()

    def trusted(self, slots: np.ndarray, runs: np.ndarray) -> list[bool]:
        return (self._runs[slots] == runs).tolist()


def heads_mask(first: int, end: int) -> int:
    """The bit mask of heads ``[first, end)``."""
    return ((1 << (end - first)) - 1) << first


__all__ = ["ASSEMBLY_TIMEOUT_S", "Assembly", "Claim", "Settled", "Verified", "heads_mask"]
