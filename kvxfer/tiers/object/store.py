"""A cache group's object-storage tier: blocks every daemon pointed at a bucket shares.

One object per block (``kvxfer.tiers.object.client.object_name``: a shard, the cache group, a
digest of namespace and key), its value sealed as Redis's are (``kvxfer.tiers.record``: the
header binding it to its group's block format, namespace and key, its checksum, and with
``secret`` an HMAC under its full name). A value that fails any check is DATA_LOSS, deleted
(where the credentials permit) and announced CORRUPTED; another format's block is a miss.

Writes are write-once: a conditional put (``If-None-Match: *``), so nodes storing one key at
once never clobber each other (the loser counts ``already_present``). They run from a bounded
queue (``max_inflight``; full: dropped and counted), ``workers`` calls at once, each within
``timeout_s``; a Delete overtakes queued writes of its keys (tombstones). Lookups ask only for
keys this node has not seen absent lately (a bounded negative cache), with concurrent HEADs
that all end by ``timeout_s``. A failing server opens the circuit breaker: for its backoff no
call is made (lookups miss, stores drop, restores find nothing). With ``max_bytes`` the tier
deletes the oldest objects this daemon wrote (its own index, since it started) past the bound;
a bucket lifecycle rule bounds the rest (docs/storage.md).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import obstore
import torch
from obstore.exceptions import AlreadyExistsError, PermissionDeniedError

from kvxfer.core.breaker import Breaker
from kvxfer.core.records import Outcome, TierKind, TierStats
from kvxfer.events.event_hub import EventHub
from kvxfer.events.event_records import Reason
from kvxfer.tiers.lower import Nothing, StagedBlock
from kvxfer.tiers.object.client import FAILURES, MISSING, may_have_landed, object_name, open_store
from kvxfer.tiers.object.settings import ObjectSettings
from kvxfer.tiers.record import MAX_HEADER, DiskCorrupt, header, sealed, unpack
from kvxfer.tiers.write_queue import EventCounts, Staged, WriteQueue, announce_corrupt, announce_stored, to_send

ABSENT_KEYS = 65536  # names the negative cache remembers at most


class Absent:
    """Names found absent lately (a bounded negative cache): not asked again until ``ttl_s`` passes."""

    def __init__(self, ttl_s: float, capacity: int = ABSENT_KEYS) -> None:
        self.ttl_s, self.capacity = ttl_s, capacity
        self._until: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def known(self, name: str, now: float) -> bool:
        with self._lock:
            until = self._until.get(name)
            if until is not None and until <= now:
                del self._until[name]
            return until is not None and until > now

    def add(self, names: list[str], now: float) -> None:
        if self.ttl_s <= 0:
            return
        with self._lock:
            for name in names:
                self._until[name] = now + self.ttl_s
                self._until.move_to_end(name)
            while len(self._until) > self.capacity:
                self._until.popitem(last=False)

    def forget(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                self._until.pop(name, None)


class ObjectTier:
    """One cache group's objects in the bucket (a ``LowerTier``)."""

    kind = TierKind.OBJECT
    restart_warm = False  # the bucket outlives the daemon on its own
    index = None  # (the bucket is asked: other nodes change it)

    def __init__(self, settings: ObjectSettings, group: str, fingerprint: bytes, slot_bytes: int,
                 kv_events: EventHub | None = None) -> None:
        self.kv_events = kv_events.tier(TierKind.OBJECT, group) if kv_events else None
        self.settings, self.group, self.fingerprint, self.slot_bytes = settings, group, fingerprint, slot_bytes
        self.takes_stores = settings.write_through
        self.takes_evictions = not settings.write_through
        self.store = open_store(settings)
        self.breaker = Breaker(settings.url, tier="object tier", probe=self._probe)
        self.events = EventCounts()
        self.absent = Absent(settings.negative_cache_s)
        self._written: OrderedDict[str, int] = OrderedDict()  # name -> bytes, oldest first (``max_bytes``)
        self._written_bytes = 0
        self._written_lock = threading.Lock()
        self._inflight: Counter[str] = Counter()  # names with a put in flight (a Delete waits for them)
        self._settled = threading.Condition()
        self.calls = ThreadPoolExecutor(settings.workers, thread_name_prefix=f"kvxfer-object-{group}")
        self.queue = WriteQueue(f"kvxfer-object-{group}", settings.max_inflight, slot_bytes, self._write, 1,
                                headroom=MAX_HEADER, writers=settings.workers)
        self.tombstones = self.queue.tombstones

    def name(self, namespace: str, key: bytes) -> str:
        return object_name(self.group, namespace, key)

    def _probe(self) -> None:
        """The breaker's question while the bucket failed: a GET of a name no block has (absent: it answers)."""
        try:
            obstore.get(self.store, "kvxfer-probe/absent")
        except MISSING:
            pass

    def full_name(self, name: str) -> bytes:
        """What an object's MAC covers: its whole name, bucket and prefix included (``object.url``/name), so that a
        value is valid only where it was written: not under another prefix that shares the secret."""
        return f"{self.settings.url.rstrip('/')}/{name}".encode()

    def _all(self, call, items: list, until: float | None = None) -> list[tuple[object, BaseException | None]]:
        """``call(item)`` for every item on the tier's threads, each ended (or abandoned) by ``timeout_s`` and
        all by ``until`` (``time.monotonic()``): (result, None) or (None, the exception); an unfinished call
        is a ``TimeoutError``."""
        try:
            futures: list[Future] = [self.calls.submit(call, item) for item in items]
        except RuntimeError:  # closed (the writer's last batch after the group closed): nothing is sent
            return [(None, TimeoutError("the tier is closed")) for _ in items]
        limit = self.settings.timeout_s + 0.5  # (each call has timeout_s; this bounds the queue)
        wait(futures, timeout=limit if until is None else max(0.0, min(limit, until - time.monotonic())))
        out: list[tuple[object, BaseException | None]] = []
        for future in futures:
            if not future.done():
                future.cancel()
                out.append((None, TimeoutError("no answer within the deadline")))
            elif future.exception() is not None:
                out.append((None, future.exception()))
            else:
                out.append((future.result(), None))
        return out

    # -- stores ------------------------------------------------------------------
    def write_now(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> int:
        """Queued like any store (the bucket keeps what it holds across the daemon's restarts)."""
        self.stage(namespace, blocks, key_format)
        return 0

    def stage(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> None:
        for key, checksum, data in blocks:
            if not (self.breaker.allows() and self.queue.stage(namespace, key, checksum, data.numpy(), key_format)):
                self.events.add("stores_dropped")

    def _put(self, staged: Staged) -> str:
        name = self.name(staged.namespace, staged.key)
        head = header(self.fingerprint, staged.namespace, staged.key, staged.checksum, self.slot_bytes,
                      staged.key_format, self.settings.seal)
        value = sealed(self.settings.secret, self.full_name(name), self.queue.staging.with_header(staged.buffer, head),
                       self.settings.seal)
        try:
            obstore.put(self.store, name, value, mode="create", use_multipart=False)
        except AlreadyExistsError:
            return "already_present"  # another node (or an earlier run) wrote this key: write-once
        return "stored"

    def _write(self, batch: list[Staged]) -> None:
        # ``workers`` writers run this at once, a put each. The decision is made under ``publishing`` and the
        # put registered in flight there; a Delete marks its keys under it, then waits for their puts in
        # flight before removing: it either comes after a put (and removes what it wrote) or before the
        # decision (and the write is dropped). A deleted key never comes back.
        with self.tombstones.publishing:
            alive = to_send(batch, self.tombstones, self.breaker.allows(), self.events)
            if not alive:
                return
            names = [self.name(s.namespace, s.key) for s in alive]
            with self._settled:
                self._inflight.update(names)
        written: list[Staged] = []
        try:
            for staged in alive:
                try:
                    verdict = self._put(staged)
                except FAILURES as exc:
                    self.breaker.failed(exc)
                    # Sent and not answered (a stalled server): it may land yet, so it is not counted dropped.
                    self.events.add("stores_unconfirmed" if may_have_landed(exc) else "stores_dropped")
                    continue
                self.breaker.succeeded()
                self.events.add(verdict)
                if verdict == "stored":
                    written.append(staged)
        finally:
            with self._settled:
                for name in names:
                    self._inflight[name] -= 1
                    if not self._inflight[name]:
                        del self._inflight[name]  # (bounded by the writes in flight)
                self._settled.notify_all()
        self.absent.forget(names)
        announce_stored(self.kv_events, written)
        self._account([self.name(s.namespace, s.key) for s in written])

    def _account(self, names: list[str]) -> None:
        """Remember what this daemon wrote (only with ``max_bytes``: else nothing, so that memory stays bounded);
        past ``max_bytes``, delete its oldest."""
        if not self.settings.max_bytes:
            return
        size = self.slot_bytes + MAX_HEADER
        with self._written_lock:
            for name in names:
                self._written_bytes += size - self._written.pop(name, 0)  # (a name written again counts once)
                self._written[name] = size
            oldest: list[str] = []
            while self._written_bytes > self.settings.max_bytes and self._written:
                name, nbytes = self._written.popitem(last=False)
                self._written_bytes -= nbytes
                oldest.append(name)
        if oldest:
            gone = [error is None for _, error in self._all(lambda n: obstore.delete(self.store, n), oldest)]
            self.events.add("evicted", sum(gone))

    # -- lookups and restores ---------------------------------------------------------
    def wait_ready(self, until: float) -> bool:
        return True  # (nothing to load: it asks the bucket)

    def _head(self, name: str) -> bool:
        try:
            obstore.head(self.store, name)
        except MISSING:
            return False
        return True

    def contains(self, namespace: str, keys: list[bytes], until: float | None = None) -> list[bool]:
        """Which keys the bucket holds now: concurrent HEADs, all ended by ``timeout_s`` and by ``until`` (the
        request's deadline), for the keys not found absent lately; all False when the server is unavailable.
        A HEAD not answered by then is a miss (not remembered as absent)."""
        if not keys or not self.breaker.allows():
            return [False] * len(keys)
        now = time.monotonic()
        names = [self.name(namespace, k) for k in keys]
        asked = [i for i, name in enumerate(names) if not self.absent.known(name, now)]
        found = [False] * len(keys)
        results = self._all(self._head, [names[i] for i in asked], until)
        errors = [error for _, error in results if error is not None and not isinstance(error, TimeoutError)]
        for i, (there, error) in zip(asked, results):
            found[i] = bool(there) and error is None
        self.absent.add([names[i] for i, (there, error) in zip(asked, results) if error is None and not there], now)
        self.events.add("lookups_cached", len(keys) - len(asked))
        self._judge(errors)
        return found

    def _get(self, item: tuple[str, bytes]) -> _Checked | None:
        """One object fetched and checked on a worker (so that checking overlaps the other GETs); None: absent."""
        namespace, key = item
        name = self.name(namespace, key)
        try:
            value = obstore.get(self.store, name).bytes()
        except MISSING:
            return None
        try:
            checksum, data, key_format = unpack(memoryview(value), self.full_name(name), namespace, key,
                                                self.fingerprint, self.slot_bytes, self.settings.secret)
        except DiskCorrupt as bad:
            if str(bad) == "foreign_format":
                return None  # another format's block under this name: not ours to judge, a miss
            self._corrupt(namespace, key, name)
            return _Checked(Outcome.DATA_LOSS)
        return _Checked(Outcome.DONE, checksum, data, key_format)

    def _corrupt(self, namespace: str, key: bytes, name: str) -> None:
        announce_corrupt(self.events, self.kv_events, namespace, key)
        try:
            obstore.delete(self.store, name)
        except PermissionDeniedError:
            self.events.add("corrupt_not_deletable")  # (read-only credentials: the bucket's owner must remove it)
        except FAILURES as exc:
            self.breaker.failed(exc)

    def fetch(self, namespace: str, keys: list[bytes]) -> _ObjectFetch | Nothing:
        """The named objects the bucket holds, fetched and checked now (concurrently); nothing while unavailable."""
        if not keys or not self.breaker.allows():
            return Nothing()
        results = self._all(self._get, [(namespace, k) for k in keys])
        self._judge([error for _, error in results if error is not None])
        # A GET that failed (the server erred, or did not answer in time) is FAILED, never NOT_FOUND: the
        # object may well be there (a Lookup said so), and the engine is told the medium failed.
        present = [(k, _Checked(Outcome.FAILED) if error is not None else got)
                   for k, (got, error) in zip(keys, results) if error is not None or got is not None]
        return _ObjectFetch(self, present)

    def _judge(self, errors: list[BaseException]) -> None:
        if errors:
            self.breaker.failed(errors[0])
        else:
            self.breaker.succeeded()

    def _remove(self, name: str) -> int:
        if not self._head(name):
            return 0
        obstore.delete(self.store, name)
        return 1

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        """Remove the keys' objects, and drop the writes of them still queued; returns how many the bucket held."""
        if not keys:
            return 0
        names = [self.name(namespace, k) for k in keys]
        with self.tombstones.publishing:
            self.tombstones.delete(namespace, keys)
        # (Asked even while the breaker is open: a Delete is rare, and one left undone would serve the keys again.)
        with self._settled:  # puts decided before the marks: removed once written (each ends by timeout_s)
            self._settled.wait_for(lambda: not any(self._inflight[n] for n in names), self.settings.timeout_s + 1)
        results = self._all(self._remove, names)
        self._judge([error for _, error in results if error is not None])
        self.events.add("deletes_failed", sum(1 for _, error in results if error is not None))
        removed = [k for k, (n, error) in zip(keys, results) if error is None and n]
        with self._written_lock:
            for name in names:
                self._written_bytes -= self._written.pop(name, 0)
        if self.kv_events is not None and removed:
            self.kv_events.removed(namespace, removed, Reason.DELETED)
        return len(removed)

    # -- the rest ------------------------------------------------------------------
    def stats(self) -> TierStats:
        """The bucket is shared (other nodes write and delete in it): what this daemon did is counted in ``events``;
        capacity and occupancy are not ours to report."""
        return TierStats(TierKind.OBJECT, 0, 0, 0, 0, 0, self.slot_bytes, self.breaker.open, self.events.snapshot())

    def flush(self, timeout: float) -> bool:
        return self.queue.flush(timeout)

    def close(self, timeout: float = 0.0) -> None:
        self.breaker.close()
        self.queue.close(timeout)
        self.calls.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Checked:
    """One fetched object's verdict; for DONE its checksum, bytes (a view of the fetched value) and key format."""

    verdict: Outcome
    checksum: int = 0
    data: memoryview | None = None
    key_format: int = 0


class _ObjectFetch:
    """A restore's objects the bucket held when asked, already checked: copied into host slots."""

    def __init__(self, tier: ObjectTier, present: list[tuple[bytes, _Checked]]) -> None:
        self._tier = tier
        self.keys = [k for k, _ in present]
        self._checked = [c for _, c in present]
        self.formats = [c.key_format for c in self._checked]

    def read(self, targets: list[tuple[int, torch.Tensor]]) -> list[tuple[Outcome, int]]:
        out = []
        for j, target in targets:
            checked = self._checked[j]
            if checked.verdict is Outcome.DONE:
                target.numpy()[:] = np.frombuffer(checked.data, dtype=np.uint8)
                self._tier.events.add("promoted")
            out.append((checked.verdict, checked.checksum))
        return out

    def end(self, corrupt: set[int]) -> None:
        self._checked = []  # (corrupt objects were removed when found)
