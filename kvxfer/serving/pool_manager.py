"""One pool's offload and restore: the index, the host tier and a copy engine.

The policy lives here (what to copy, what a failure means); the index keeps the
books and the copy engine moves bytes. Requests arrive as validated
``TransferBatch``es. Every prepared entry is completed in a ``finally``, so pins
are released on success, failure and bugs alike.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvxfer.core.errors import InvalidArgument, KvxferError
from kvxfer.core.records import HintAction, LookupResult, LookupStats, Outcome, TierStats, TransferResult, TransferStats
from kvxfer.core.slots import slot_array
from kvxfer.core.validate import check_namespace, checked_keys
from kvxfer.events.event_records import format_code
from kvxfer.geometry.sharding import stored_format
from kvxfer.index.block_index import Plan
from kvxfer.memory.pool import Pool
from kvxfer.serving.assembly import Claim, heads_mask
from kvxfer.serving.batch import TransferBatch, TransferKind
from kvxfer.serving.group import CacheGroup
from kvxfer.serving.promotion import Held
from kvxfer.transfer import CopyEngine, engine_for
from kvxfer.transfer.copy_engine import LateCopies
from kvxfer.transfer.pipeline import CheckedCopier

#: How long a rank's restore waits for another rank's check of the same stored block (then checks it itself).
VERIFY_WAIT_S = 5.0
#: Bytes of stored blocks a rank verifies at a time: ranks restoring a batch at once share its checks.
VERIFY_STEP_BYTES = 8 << 20
#: Keys a Delete handles at a time: its memory is bounded by this, not by the request.
DELETE_CHUNK = 1024
#: The outcomes of an offload's blocks that its hint applies to, by action.
_HINTED = {HintAction.RETAIN: (Outcome.DONE, Outcome.ALREADY_PRESENT), HintAction.RELEASE: (Outcome.DONE,)}
#: Told of each transfer as it ends: its kind and result (bytes, seconds, outcomes).
TransferObserver = Callable[[TransferKind, TransferResult], None]


@dataclass(frozen=True)
class StoreStats:
    """One pool's store: its cache group's tiers, and what this pool moved."""

    tiers: list[TierStats]
    offloaded: TransferStats
    restored: TransferStats
    outcomes: dict[str, int]
    lookups: LookupStats


class PoolManager:
    """Offload, restore, lookup and delete for one pool, over its cache group's tier."""

    def __init__(self, pool: Pool, group: CacheGroup | int, engine: CopyEngine | None = None,
                 checksum_on_device: bool = True, observer: TransferObserver | None = None,
                 copy_threads: int = 2, deadline_s: float = 30.0) -> None:
        """``group``: the cache group the pool joins, or a capacity in blocks for a group of its own.
        ``checksum_on_device``: a GPU pool of a block-major layout has its block checksums computed by
        the device XXH3 behind each copy (else on the host, on ``copy_threads`` threads).
        ``observer``: told of every transfer as it ends (the daemon's metrics).
        ``copy_threads``: threads of a CPU pool's copy engine (the memory bus wants more than one core).
        ``deadline_s``: how long a GPU copy may take before its job fails (DEADLINE_EXCEEDED)."""
        self.pool = pool
        sharding = pool.descriptor.sharding
        stored, manifest = stored_format(pool.layout, sharding)
        if isinstance(group, int):
            group = CacheGroup(pool.descriptor.pool_id, stored, group, pin_device=pool.cuda_device,
                               manifest=manifest)
        group.check_joins(stored, manifest)
        self.group = group
        self.host = group.host  # the tier the copy engine moves this pool's blocks into and out of
        # A rank holding part of the heads writes its slices of canonical blocks (``_offload_shards``); a pool
        # of every head stores whole blocks, as its bytes are when its layout is the canonical one.
        whole = sharding is None or sharding.heads == (0, sharding.total_kv_heads)
        self.heads = 0 if whole else heads_mask(*sharding.heads)
        convert = sharding is not None and (not whole or pool.layout.layout != stored.layout)
        self.engine = engine or engine_for(pool, self.host, checksum_on_device, copy_threads, deadline_s,
                                           stored if convert else None)
        self.copier = CheckedCopier(self.engine, self.host)
        self._totals = {TransferKind.OFFLOAD: TransferStats(), TransferKind.RESTORE: TransferStats()}
        self._outcomes: dict[str, int] = {o.value: 0 for o in Outcome}
        self._lookups = LookupStats()
        self.observer = observer
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return self.pool.layout.spec.num_blocks

    def run(self, batch: TransferBatch, cancelled: Callable[[], bool] | None = None) -> TransferResult:
        """Carry out a validated batch; one outcome per block, in batch order.

        ``cancelled`` (a job's lease) is asked between chunks: once it answers True no
        further block is touched; an offload then publishes none of its keys, a
        restore reports the blocks not done CANCELLED.
        """
        if batch.deadline is not None and time.monotonic() > batch.deadline:  # the engine stopped waiting
            result = TransferResult([Outcome.DEADLINE_EXCEEDED] * len(batch), 0, 0.0)
        else:
            result = _RUN[batch.kind, self.heads != 0](self, batch, cancelled)
        if batch.hint is not None:
            self._hint(batch, result)
        counts = _tally(result.outcomes)
        with self._lock:
            for outcome, n in counts.items():
                self._outcomes[outcome.value] += n
        if self.observer is not None:
            self.observer(batch.kind, result)
        return result

    def _hint(self, batch: TransferBatch, result: TransferResult) -> None:
        """An offload's hint: RETAIN for its blocks now held (DONE or ALREADY_PRESENT); RELEASE for the blocks it
        stored (DONE) only, for one already present was stored by someone else, who may still read it."""
        action, ttl_s = batch.hint
        kept = _HINTED[action]
        held = [k for k, o in zip(batch.keys, result.outcomes) if o in kept]
        if held:
            self.group.hint(batch.namespace, held, action, time.monotonic() + ttl_s)

    def offload(self, namespace: str, pairs: Sequence[tuple[int, bytes]],
                cancelled: Callable[[], bool] | None = None) -> TransferResult:
        """Copy each (block, key) into the host tier under its key (library callers; validates)."""
        return self.run(TransferBatch.offload(namespace, pairs, self.num_blocks), cancelled)

    def restore(self, namespace: str, pairs: Sequence[tuple[bytes, int]],
                cancelled: Callable[[], bool] | None = None) -> TransferResult:
        """Copy each (key, block) into the pool block and verify it (library callers; validates)."""
        return self.run(TransferBatch.restore(namespace, pairs, self.num_blocks), cancelled)

    def _offload(self, batch: TransferBatch, cancelled: Callable[[], bool] | None) -> TransferResult:
        plan = self.group.prepare_store(batch.namespace, batch.keys, admit=True)
        slots = plan.slots
        checksums: list[int | None] = [None] * len(slots)
        moved, seconds = 0, 0.0
        late: LateCopies | None = None
        try:
            if slots:
                start = time.perf_counter()
                done = self.copier.to_host(_at(batch.blocks, plan.positions), slots, cancelled, batch.ready_event,
                                           batch.deadline)
                seconds = time.perf_counter() - start
                if done.cancelled:  # nothing of a cancelled offload becomes visible
                    _set(plan.outcomes, plan.positions, Outcome.CANCELLED)
                else:  # the blocks copied by the deadline (all of them, without one) become visible
                    n = done.completed
                    _set(plan.outcomes, plan.positions[n:], Outcome.DEADLINE_EXCEEDED)
                    checksums = done.checksums + [None] * (len(slots) - n)
                    moved = self._count(TransferKind.OFFLOAD, n, seconds)
                    self.group.write_through(batch.namespace, _at(batch.keys, plan.positions[:n]), slots[:n],
                                             checksums[:n], _format_code(batch))
        except LateCopies as exc:
            late = exc
            _set(plan.outcomes, plan.positions, Outcome.DEADLINE_EXCEEDED)
        except InvalidArgument:  # the engine's event handle: this request's fault, reported as such
            _set(plan.outcomes, plan.positions, Outcome.FAILED)
            raise
        except KvxferError:
            _set(plan.outcomes, plan.positions, Outcome.FAILED)
        finally:
            # None checksums: never visible. Slots a late copy may still write stay reserved until it lands.
            self._complete(slots, late, lambda ready: self.group.publish(ready, [None] * len(ready)),
                           lambda: self.group.publish(slots, checksums, batch.engine), restore=False)
        return TransferResult(plan.outcomes, moved, seconds)

    def _offload_shards(self, batch: TransferBatch, cancelled: Callable[[], bool] | None) -> TransferResult:
        """A rank's offload: its heads' slices of canonical blocks, published once every head is in."""
        assembly = self.group.assembly
        claim, expired = assembly.claim(batch.namespace, batch.keys, self.heads, self.group.prepare_store)
        self._forget(expired)
        moved, seconds, written = 0, 0.0, 0
        late: LateCopies | None = None
        try:
            if claim.slots:
                start = time.perf_counter()
                done = self.copier.to_host(_at(batch.blocks, claim.positions), claim.slots, cancelled,
                                           batch.ready_event, batch.deadline, hashed=False)
                seconds = time.perf_counter() - start
                written = 0 if done.cancelled else done.completed
                _set(claim.outcomes, claim.positions[written:],
                     Outcome.CANCELLED if done.cancelled else Outcome.DEADLINE_EXCEEDED)
                moved = self._count(TransferKind.OFFLOAD, written, seconds)
        except LateCopies as exc:
            late = exc
            _set(claim.outcomes, claim.positions, Outcome.DEADLINE_EXCEEDED)
        except InvalidArgument:
            _set(claim.outcomes, claim.positions, Outcome.FAILED)
            raise
        except KvxferError:
            _set(claim.outcomes, claim.positions, Outcome.FAILED)
        finally:
            if late is None:
                self._settle(claim, written, batch)
            else:  # copies that may still land: the entries stay claimed (never reused) until they have
                self.engine.quarantine(late.handles, lambda: self._settle(claim, 0, batch), restore=False)
        return TransferResult(claim.outcomes, moved, seconds)

    def _settle(self, claim: Claim, written: int, batch: TransferBatch) -> None:
        """This rank is done with its claim: entries now complete are hashed whole and published, those
        that never will be are forgotten."""
        settled = self.group.assembly.settle(claim, written)
        self._forget(settled.dropped)
        if settled.complete:
            slots, keys = [s for s, _ in settled.complete], [k for _, k in settled.complete]
            try:
                checksums: list[int | None] = list(self.copier.tier_checksums(slots))
            except BaseException:  # never visible, and their slots free again
                self._forget(slots)
                raise
            self.group.publish(slots, checksums, batch.engine)
            self.group.write_through(batch.namespace, keys, slots, checksums, _format_code(batch))

    def _forget(self, slots: list[int]) -> None:
        """Canonical entries that will never be complete: never visible, their slots free."""
        if slots:
            self.group.publish(slots, [None] * len(slots))

    def _complete(self, slots: Sequence[int], late: LateCopies | None, release: Callable[[list[int]], None],
                  complete: Callable[[], None], restore: bool) -> None:
        """Complete a transfer's entries: all at once, or, after late copies, those the copies do not
        touch now and the others once the engine says they landed."""
        if late is None:
            complete()
            return
        held = set(late.slots)
        release([s for s in slots if s not in held])
        self.engine.quarantine(late.handles, lambda: release(late.slots), restore)

    def _prepare_load(self, namespace: str, keys: list[bytes], deadline: float | None = None, peer: str = "",
                      held: Held | None = None) -> Plan:
        """Pin the host tier's blocks of the batch, then bring the others up from the lower tiers (``peer``'s first)
        and pin them too. ``held``: blocks a tier lets this restore's copy check stay there, reserved, unpinned."""
        plan = self.group.pin(namespace, keys)
        if len(plan.slots) == len(keys) or not self.group.lower:
            return plan
        missing = [i for i, o in enumerate(plan.outcomes) if o is Outcome.NOT_FOUND]
        tiers = self.group.reading_from(peer) + self.group.lower_tiers if peer else None
        lost = self.group.promote(namespace, [keys[i] for i in missing], tiers, deadline, held)  # may evict: ours pinned
        came = [i for i in missing if held is not None and keys[i] in held.keys]  # read, in reserved slots
        rest = [i for i in missing if held is None or keys[i] not in held.keys]
        more = self.group.pin(namespace, [keys[i] for i in rest])
        for j, i in enumerate(rest):
            plan.outcomes[i] = lost.get(keys[i], more.outcomes[j])
        _set(plan.outcomes, came, Outcome.DONE)  # (unless the copy finds them wrong)
        held_slots = [held.keys[keys[i]] for i in came] if came else []
        # One plan, in batch order (positions ascending, as the index gives them).
        merged = sorted(zip(plan.positions + [rest[j] for j in more.positions] + came,
                            plan.slots + more.slots + held_slots,
                            plan.checksums + more.checksums + [held.expected(s) for s in held_slots]))
        plan.positions, plan.slots, plan.checksums = (list(c) for c in zip(*merged)) if merged else ([], [], [])
        return plan

    def _restore(self, batch: TransferBatch, cancelled: Callable[[], bool] | None) -> TransferResult:
        # Blocks a lower tier lets this copy check (a peer's) are checked in it: one pass over them fewer. (Not in a
        # canonical group, whose ranks may trust a block verified once: those are checked before any copy.)
        held = Held(self.group, batch.namespace) if self.group.verified is None else None
        try:
            plan = self._prepare_load(batch.namespace, batch.keys, batch.deadline, batch.peer, held)
        except BaseException:
            if held is not None:
                held.drop()
            raise
        slots, positions = plan.slots, plan.positions
        corrupt: set[int] = set()
        moved, seconds, checked = 0, 0.0, 0
        late: LateCopies | None = None
        trusted = None
        try:
            if slots:
                start = time.perf_counter()
                if self.group.verified is not None and self.copier.checks_tier_first:
                    trusted = self._verify_once(slots, plan.checksums, batch.deadline)
                done = self.copier.to_pool(slots, plan.checksums, _at(batch.blocks, positions), cancelled,
                                           batch.deadline, trusted)
                corrupt = done.corrupt
                stopped = Outcome.DEADLINE_EXCEEDED if done.expired else Outcome.CANCELLED
                _set(plan.outcomes, positions[done.completed:], stopped)
                seconds = time.perf_counter() - start
                checked = done.completed
                good = checked - sum(1 for j in corrupt if j < checked)
                moved = self._count(TransferKind.RESTORE, good, seconds)
        except LateCopies as exc:
            late = exc
            _set(plan.outcomes, positions, Outcome.DEADLINE_EXCEEDED)
        except KvxferError:
            _set(plan.outcomes, positions, Outcome.FAILED)
        finally:
            # dropped at complete_load; the engine must not read these blocks
            _set(plan.outcomes, [positions[j] for j in corrupt], Outcome.DATA_LOSS)
            if held is None or not held.keys:
                self._complete(slots, late, self.group.unpin, lambda: self.group.unpin(slots, corrupt), restore=True)
            else:  # those it checked good are published, the rest dropped; the others unpinned
                self._complete(slots, late, *held.endings(plan, corrupt, checked), restore=True)
        return TransferResult(plan.outcomes, moved, seconds)

    def _verify_once(self, slots: Sequence[int], expected: list[int], deadline: float | None) -> list[bool]:
        """Which of these pinned canonical blocks are known good in their pin run: verified here now, or by
        another rank's restore (waited for). The others (bad, or not answered in time) the copy checks again."""
        verified, at = self.group.verified, slot_array(slots)
        runs = self.group.pin_runs(at)
        tried: set[int] = set()
        step = max(1, VERIFY_STEP_BYTES // self.group.slot_bytes)
        while True:
            mine, waits = verified.share(at, runs, tried, step)
            if not mine:
                break
            tried.update(mine)
            good: list[bool] = []
            try:
                sums = self.copier.tier_checksums([slots[j] for j in mine])
                good = [got == expected[j] for got, j in zip(sums, mine)]
            finally:
                verified.done(at[mine], runs[mine], good if len(good) == len(mine) else [False] * len(mine))
        until = deadline if deadline is not None else time.monotonic() + VERIFY_WAIT_S  # one bound for all
        for event in waits:
            event.wait(max(0.0, until - time.monotonic()))
        return verified.trusted(at, runs)

    def lookup(self, namespace: str, keys: Sequence[bytes], deadline: float | None = None) -> LookupResult:
        """Keys in prefix order: how many leading ones are present, and each one's tier (``deadline``:
        ``time.monotonic()``, how long a lower tier's index loading at start may be waited for)."""
        check_namespace(namespace)
        keys = checked_keys(keys, unique=False)
        tiers = self.group.tiers_of(namespace, keys, deadline)
        hits = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        with self._lock:
            self._lookups = LookupStats(self._lookups.keys + len(keys), self._lookups.hits + hits)
        return LookupResult(hits, tiers)

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Remove these keys from every tier; a key named twice is removed once. Returns how many were.

        Work is bounded per request: the keys are checked, then deleted, ``DELETE_CHUNK`` at a time
        (a malformed key anywhere changes nothing)."""
        check_namespace(namespace)
        chunks = range(0, len(keys), DELETE_CHUNK)
        for a in chunks:
            checked_keys(keys[a:a + DELETE_CHUNK], unique=False)
        removed = 0
        for a in chunks:  # the tiers' indexes take distinct keys
            removed += self.group.delete(namespace, list(dict.fromkeys(checked_keys(keys[a:a + DELETE_CHUNK],
                                                                                   unique=False))))
        return removed

    def stats(self) -> StoreStats:
        tiers = self.group.tier_stats()
        with self._lock:
            return StoreStats(tiers, self._totals[TransferKind.OFFLOAD], self._totals[TransferKind.RESTORE],
                              dict(self._outcomes), self._lookups)

    def reap(self) -> None:
        """Release what late GPU copies held, if they have landed, and canonical entries whose ranks never
        came (the job runner asks when idle)."""
        self.engine.reap()
        if self.group.assembly is not None:
            self._forget(self.group.assembly.sweep())

    def close(self) -> None:
        """Release the copy engine (its streams); the pool itself is its owner's to close."""
        self.engine.close()

    def _count(self, kind: TransferKind, blocks: int, seconds: float) -> int:
        moved = blocks * self.pool.layout.block_bytes  # a rank pool's share of a canonical block, else all of it
        with self._lock:
            t = self._totals[kind]
            self._totals[kind] = TransferStats(t.blocks + blocks, t.bytes + moved, t.seconds + seconds)
        return moved


def _format_code(batch: TransferBatch) -> int:
    """The key format an offload's blocks are kept with below host memory."""
    return format_code(batch.engine.key_format) if batch.engine is not None else 0


def _at(values: list, positions: Sequence[int]) -> list:
    """``values[i]`` for each i in ``positions`` (ascending): the list itself when that is all of it."""
    return values if len(positions) == len(values) else [values[i] for i in positions]


def _tally(outcomes: list[Outcome]) -> dict[Outcome, int]:
    """How many of each outcome (one pass in C when they are all alike, as usual)."""
    if not outcomes:
        return {}
    first = outcomes[0]
    n = outcomes.count(first)
    return {first: n} if n == len(outcomes) else Counter(outcomes)


def _set(outcomes: list[Outcome], positions: Sequence[int], outcome: Outcome) -> None:
    for i in positions:
        outcomes[i] = outcome


#: The transfer each kind of batch runs (functions, not bound methods: no reference cycle,
#: so a released cache group's memory returns as soon as its last pool is gone).
#: (kind, the pool is a rank's of canonical blocks) -> its transfer.
_RUN = {(TransferKind.OFFLOAD, False): PoolManager._offload, (TransferKind.RESTORE, False): PoolManager._restore,
        (TransferKind.OFFLOAD, True): PoolManager._offload_shards, (TransferKind.RESTORE, True): PoolManager._restore}
