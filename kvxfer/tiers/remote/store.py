"""A cache group's remote tier on Redis or Redis Cluster: blocks every daemon (node) using it shares.

One Redis value per block (``kvxfer.tiers.remote.client``: the medium's connections, circuit
breaker and value encoding): its header (``kvxfer.tiers.record``: format version, block
format fingerprint, checksum, namespace, key) and its bytes, written with one SET, so
that a reader never sees bytes without their checksum. The Redis key is ``key_prefix``,
the cache group, the namespace and the key, NUL-separated (binary-safe; a rank's cache
group keeps tensor-parallel shards of one key apart). The header's fingerprint binds the
value to its cache group and the header names its namespace and key, so a value copied
under another group's or key's name is never served; with ``secret`` (shared by the
daemons of a tier) each value also carries an HMAC-SHA256 under its full key, so that no
one who can write the database but lacks the secret can plant a block (a value that
fails it is DATA_LOSS and deleted). Redis may evict any value
(``maxmemory-policy``): a missing value is a miss, never an error.

Writes run on one thread from a bounded queue (``max_inflight``): when it is full a
block is dropped and counted. Every call has ``timeout_s``; a failure (down, slow,
refusing, resharding) opens a circuit breaker: for a backoff (0.5 s doubling to 30 s)
no call is made at all (lookups miss, stores are dropped, restores find nothing), then
one call tries again. The host and disk paths never wait on Redis.
"""

from __future__ import annotations

import threading

import numpy as np
import redis
import torch
from redis.cluster import RedisCluster

from kvxfer.core.breaker import Breaker
from kvxfer.core.records import Outcome, TierKind, TierStats
from kvxfer.events.event_hub import EventHub
from kvxfer.events.event_records import Reason
from kvxfer.tiers.lower import Nothing, StagedBlock
from kvxfer.tiers.record import MAX_HEADER, DiskCorrupt, header, sealed, unpack
from kvxfer.tiers.remote.client import BATCH, FAILURES, connect
from kvxfer.tiers.remote.keyspace_events import RemovalWatch
from kvxfer.tiers.remote.settings import RemoteSettings
from kvxfer.tiers.write_queue import EventCounts, Staged, WriteQueue, announce_corrupt, announce_stored, to_send

__all__ = ["BATCH", "RemoteStore"]


class RemoteStore:
    """One cache group's blocks in Redis (a ``LowerTier``)."""

    kind = TierKind.REMOTE
    restart_warm = False  # Redis outlives the daemon on its own
    index = None  # (Redis is asked: it evicts on its own)

    def __init__(self, settings: RemoteSettings, group: str, fingerprint: bytes, slot_bytes: int,
                 kv_events: EventHub | None = None) -> None:
        """``fingerprint``: the group's block format (``BlockFormat.fingerprint``), in every value's header;
        ``kv_events``: where this daemon's stores, deletes and corrupt finds are announced, and Redis's own
        evictions and expiries where it publishes them (``kvxfer.tiers.remote.keyspace_events``)."""
        self.kv_events = kv_events.tier(TierKind.REMOTE, group) if kv_events else None
        self.settings = settings
        self.takes_stores = settings.write_through  # else blocks go to Redis when the host tier evicts them
        self.takes_evictions = not settings.write_through
        self.group = group
        self.slot_bytes = slot_bytes
        self.fingerprint = fingerprint
        self._client: redis.Redis | RedisCluster | None = None  # connected on first use: Redis may be down now
        self._connect_lock = threading.Lock()
        # (never the credentials of a URL in its name); while Redis fails, a PING says when it is back
        self.breaker = Breaker(settings.url.split("@")[-1], probe=lambda: self.client.ping())
        self.events = EventCounts()
        self.queue = WriteQueue(f"kvxfer-remote-{group}", settings.max_inflight, slot_bytes, self._write, BATCH,
                                headroom=MAX_HEADER)
        self.tombstones = self.queue.tombstones
        standalone = "+cluster://" not in settings.url
        self.removals = RemovalWatch(lambda: connect(settings), (settings.key_prefix + group).encode(),
                                     self.kv_events) if self.kv_events is not None and standalone else None

    @property
    def client(self) -> redis.Redis | RedisCluster:
        """The client, made on first use (a cluster client asks for the slots as it is made)."""
        with self._connect_lock:
            if self._client is None:
                self._client = connect(self.settings)
            return self._client

    def key(self, namespace: str, key: bytes) -> bytes:
        return b"\0".join([(self.settings.key_prefix + self.group).encode(), namespace.encode(), key])

    # -- stores ------------------------------------------------------------------
    def write_now(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> int:
        """Queued like any store (Redis keeps what it holds across the daemon's restarts)."""
        self.stage(namespace, blocks, key_format)
        return 0

    def stage(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> None:
        """Queue (key, checksum, bytes) blocks for Redis; the bytes are copied now (into staging
        buffers: when none is free, the block is dropped and counted)."""
        for key, checksum, data in blocks:
            if not (self.breaker.allows() and self.queue.stage(namespace, key, checksum, data.numpy(), key_format)):
                self.events.add("stores_dropped")

    def _write(self, batch: list[Staged]) -> None:
        # Decided and sent under ``publishing``: a Delete of a key either comes after the SET (and
        # removes it) or before the decision (and the write is dropped): a deleted key never returns.
        with self.tombstones.publishing:
            alive = to_send(batch, self.tombstones, self.breaker.allows(), self.events)
            if not alive:
                return
            try:
                self._send(alive)
            except FAILURES as exc:
                self.breaker.failed(exc)
                self.events.add("stores_dropped", len(alive))
                return
        self.breaker.succeeded()
        self.events.add("stored", len(alive))
        announce_stored(self.kv_events, alive)

    def _send(self, batch: list[Staged]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for s in batch:
            head = header(self.fingerprint, s.namespace, s.key, s.checksum, self.slot_bytes, s.key_format,
                          self.settings.seal)
            name = self.key(s.namespace, s.key)
            pipe.set(name, sealed(self.settings.secret, name, self.queue.staging.with_header(s.buffer, head),
                                  self.settings.seal))
        pipe.execute()

    # -- lookups and restores ---------------------------------------------------------
    def wait_ready(self, until: float) -> bool:
        return True  # (nothing to load: it asks the medium)

    def contains(self, namespace: str, keys: list[bytes], until: float | None = None) -> list[bool]:
        """Which keys Redis holds now (one pipelined round trip); all False when unavailable."""
        if not keys or not self.breaker.allows():
            return [False] * len(keys)
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.key(namespace, key))
            found = [bool(n) for n in pipe.execute()]
        except FAILURES as exc:
            self.breaker.failed(exc)
            return [False] * len(keys)
        self.breaker.succeeded()
        return found

    def fetch(self, namespace: str, keys: list[bytes]) -> _RemoteFetch | Nothing:
        """The named values Redis holds, fetched now (rounds of ``BATCH``); nothing while unavailable."""
        if not keys or not self.breaker.allows():
            return Nothing()
        try:
            values = []
            for first in range(0, len(keys), BATCH):  # rounds of BATCH: responses stay small
                pipe = self.client.pipeline(transaction=False)
                for key in keys[first:first + BATCH]:
                    pipe.get(self.key(namespace, key))
                values += pipe.execute()
        except FAILURES as exc:
            self.breaker.failed(exc)
            return Nothing()
        self.breaker.succeeded()
        present = [(k, v) for k, v in zip(keys, values) if v is not None]  # None: evicted by Redis, a miss
        return _RemoteFetch(self, namespace, present)

    def _unpack(self, namespace: str, key: bytes, value: bytes, out: torch.Tensor) -> tuple[Outcome, int, int]:
        """(verdict, checksum, key format code)"""
        name = self.key(namespace, key)
        try:
            checksum, data, key_format = unpack(value, name, namespace, key, self.fingerprint, self.slot_bytes,
                                    self.settings.secret)
        except DiskCorrupt as bad:
            if str(bad) == "foreign_format":
                return Outcome.NOT_FOUND, 0, 0  # another format's block under this name: not ours to judge
            announce_corrupt(self.events, self.kv_events, namespace, key)
            try:
                self.client.delete(name)
            except FAILURES as exc:
                self.breaker.failed(exc)
            return Outcome.DATA_LOSS, 0, 0
        out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        self.events.add("promoted")
        return Outcome.DONE, checksum, key_format

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        """Remove the keys' values, and drop the writes of them still queued."""
        if not keys:
            return 0
        with self.tombstones.publishing:
            self.tombstones.delete(namespace, keys)
            if not self.breaker.allows():
                return 0
            if self.kv_events is not None:  # (which of them Redis held, it does not say)
                self.kv_events.removed(namespace, keys, Reason.DELETED)
            try:
                return int(self.client.delete(*[self.key(namespace, k) for k in keys]))
            except FAILURES as exc:
                self.breaker.failed(exc)
                return 0

    # -- the rest ------------------------------------------------------------------
    def stats(self) -> TierStats:
        """Redis holds what it holds (shared, evicting on its own): no capacity or occupancy of ours."""
        return TierStats(TierKind.REMOTE, 0, 0, 0, 0, 0, self.slot_bytes, self.breaker.open, self.events.snapshot())

    def flush(self, timeout: float) -> bool:
        return self.queue.flush(timeout)

    def close(self, timeout: float = 0.0) -> None:
        self.breaker.close()
        if self.removals is not None:
            self.removals.close()
        self.queue.close(timeout)
        if self._client is not None:
            self._client.close()


class _RemoteFetch:
    """A restore's values Redis held when asked: checked and unpacked into host slots."""

    def __init__(self, store: RemoteStore, namespace: str, present: list[tuple[bytes, bytes]]) -> None:
        self._store, self._namespace = store, namespace
        self.keys = [k for k, _ in present]
        self._values = [v for _, v in present]
        self.formats = [0] * len(self.keys)  # each one's, from its header once read

    def read(self, targets: list[tuple[int, torch.Tensor]]) -> list[tuple[Outcome, int]]:
        out = []
        for j, target in targets:
            verdict, checksum, self.formats[j] = self._store._unpack(self._namespace, self.keys[j], self._values[j],
                                                                     target)
            out.append((verdict, checksum))
        return out

    def end(self, corrupt: set[int]) -> None:
        self._values = []  # the values: gone with the restore
