"""A cache group's remote tier on Redis or Redis Cluster: blocks every daemon (node) using it shares.

One Redis value per block: its header (``kvxfer.tiers.record``: format version, block
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

import hashlib
import hmac
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import redis
import torch
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from kvxfer.geometry.checksum import block_checksum
from kvxfer.records import Outcome, TierKind, TierStats
from kvxfer.serving.staging import EventCounts, StagingBuffers, Tombstones, take_batch
from kvxfer.tiers.lower import Nothing, StagedBlock
from kvxfer.tiers.record import DiskCorrupt, decode_header, encode_header, header_length

log = logging.getLogger(__name__)
#: What a failing Redis raises: its errors, the cluster client's own (not a RedisError), the socket's.
FAILURES = (redis.RedisError, RedisClusterException, OSError)
BATCH = 32  # values per pipelined round trip
MAX_HEADER = 48 + 128 * 4 + 256 + 64  # fixed part, a namespace (UTF-8), a key, and room
MAX_BACKOFF_S = 30.0
MAC_BYTES = 32


@dataclass(frozen=True)
class RemoteSettings:
    """Where the remote tier lives and how to reach it (the password never appears in a repr)."""

    url: str  # redis://, rediss:// (TLS), redis+cluster://, rediss+cluster://
    username: str = ""
    password: str = field(default="", repr=False)
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    key_prefix: str = "kvxfer:"
    timeout_s: float = 0.2
    write_through: bool = False  # every stored block goes to Redis too, not only those leaving the host tier
    max_inflight: int = 256
    secret: bytes = field(default=b"", repr=False)  # shared by the daemons of a tier: values carry a MAC under it

    @property
    def cluster(self) -> bool:
        return "+cluster" in self.url.split("://", 1)[0]


def connect(settings: RemoteSettings) -> redis.Redis | RedisCluster:
    """A client that fails fast (no retries: the breaker decides when to try again)."""
    url = settings.url.replace("+cluster", "")
    options = dict(username=settings.username or None, password=settings.password or None,
                   socket_timeout=settings.timeout_s, socket_connect_timeout=settings.timeout_s)
    if url.startswith("rediss://"):
        options.update(ssl_ca_certs=settings.tls_ca or None, ssl_certfile=settings.tls_cert or None,
                       ssl_keyfile=settings.tls_key or None)
    if settings.cluster:
        return RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, retry_on_timeout=False, **options)


class Breaker:
    """Closed: calls go through. A failure opens it for a backoff that doubles while failures last."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.open_until = 0.0
        self.backoff = 0.5
        self.failures = 0
        self._lock = threading.Lock()

    def allows(self) -> bool:
        return time.monotonic() >= self.open_until

    @property
    def open(self) -> bool:
        return self.failures > 0

    def succeeded(self) -> None:
        with self._lock:
            if self.failures:
                log.warning("remote tier reachable again", extra={"remote": self.what})
            self.failures, self.backoff = 0, 0.5

    def failed(self, exc: Exception) -> None:
        with self._lock:
            if not self.failures:
                log.error("remote tier unavailable", extra={"remote": self.what, "error": _said(exc)})
            self.failures += 1
            self.open_until = time.monotonic() + self.backoff
            self.backoff = min(self.backoff * 2, MAX_BACKOFF_S)


def _said(exc: Exception) -> str:
    """What went wrong, for a log line: the class and Redis's message (no secrets are in either)."""
    return f"{type(exc).__name__}: {exc}"[:300]


class RemoteStore:
    """One cache group's blocks in Redis (a ``LowerTier``)."""

    kind = TierKind.REMOTE
    restart_warm = False  # Redis outlives the daemon on its own

    def __init__(self, settings: RemoteSettings, group: str, fingerprint: bytes, slot_bytes: int) -> None:
        """``fingerprint``: the group's block format (``BlockFormat.fingerprint``), in every value's header."""
        self.settings = settings
        self.takes_stores = settings.write_through  # else blocks go to Redis when the host tier evicts them
        self.takes_evictions = not settings.write_through
        self.group = group
        self.slot_bytes = slot_bytes
        self.fingerprint = fingerprint
        self._client: redis.Redis | RedisCluster | None = None  # connected on first use: Redis may be down now
        self._connect_lock = threading.Lock()
        self.breaker = Breaker(settings.url.split("@")[-1])  # never the credentials of a URL
        self.events = EventCounts()
        self.tombstones = Tombstones()
        self._queue: queue.Queue = queue.Queue(settings.max_inflight + 1)  # + the stop mark
        self._staging = StagingBuffers(settings.max_inflight, slot_bytes, headroom=MAX_HEADER)
        self._writer = threading.Thread(target=self._write_loop, name=f"kvxfer-remote-{group}", daemon=True)
        self._writer.start()

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
    def write_now(self, namespace: str, blocks: list[StagedBlock]) -> int:
        """Queued like any store (Redis keeps what it holds across the daemon's restarts)."""
        self.stage(namespace, blocks)
        return 0

    def stage(self, namespace: str, blocks: list[StagedBlock]) -> None:
        """Queue (key, checksum, bytes) blocks for Redis; the bytes are copied now (into staging
        buffers: when none is free, the block is dropped and counted)."""
        for key, checksum, data in blocks:
            index = self._staging.take(data.numpy()) if self.breaker.allows() else None
            if index is None:
                self.events.add("stores_dropped")
                continue
            seq = self.tombstones.staged(namespace, key)
            self._queue.put_nowait((namespace, key, checksum, index, seq))  # never full: one place per buffer

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            self._write(take_batch(self._queue, first, BATCH))

    def _write(self, batch: list) -> None:
        # Decided and sent under ``publishing``: a Delete of a key either comes after the SET (and
        # removes it) or before the decision (and the write is dropped): a deleted key never returns.
        alive: list = []
        try:
            with self.tombstones.publishing:
                alive = [item for item in batch if self.tombstones.alive(item[0], item[1], item[4])]
                self.events.add("deleted_while_queued", len(batch) - len(alive))
                if alive and not self.breaker.allows():
                    self.events.add("stores_dropped", len(alive))
                    return
                if alive:
                    self._send(alive)
        except FAILURES as exc:
            self.breaker.failed(exc)
            self.events.add("stores_dropped", len(alive))
            return
        finally:
            for namespace, key, _, index, _ in batch:
                self._staging.give_back(index)
                self.tombstones.done(namespace, key)
        if alive:
            self.breaker.succeeded()
            self.events.add("stored", len(alive))

    def _send(self, batch: list) -> None:
        pipe = self.client.pipeline(transaction=False)
        for namespace, key, checksum, index, _ in batch:
            header = encode_header(self.fingerprint, namespace, key, checksum, self.slot_bytes)
            name, value = self.key(namespace, key), self._staging.with_header(index, header)
            pipe.set(name, value if not self.settings.secret else bytes(value) + self._mac(name, value))
        pipe.execute()

    # -- lookups and restores ---------------------------------------------------------
    def contains(self, namespace: str, keys: list[bytes]) -> list[bool]:
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

    def _mac(self, name: bytes, value) -> bytes:
        """HMAC-SHA256 of a value under its full Redis key: whoever lacks the secret can neither forge a
        value nor move one to another key."""
        mac = hmac.new(self.settings.secret, name, hashlib.sha256)
        mac.update(value)
        return mac.digest()

    def _unpack(self, namespace: str, key: bytes, value: bytes, out: torch.Tensor) -> tuple[Outcome, int]:
        try:
            if self.settings.secret:
                value, mac = value[:-MAC_BYTES], value[-MAC_BYTES:]
                if not hmac.compare_digest(self._mac(self.key(namespace, key), value), mac):
                    raise DiskCorrupt("forged")
            split = len(value) - self.slot_bytes
            if split != header_length(namespace, key):
                raise DiskCorrupt("truncated")
            got = decode_header(value[:split], self.fingerprint, self.slot_bytes)
            if got[:2] != (namespace, key):
                raise DiskCorrupt("bad_header")
            data = memoryview(value)[split:]
            if block_checksum(data) != got[2]:
                raise DiskCorrupt("checksum")
        except DiskCorrupt as bad:
            if str(bad) == "foreign_format":
                return Outcome.NOT_FOUND, 0  # another format's block under this name: not ours to judge
            self.events.add("corrupt")
            try:
                self.client.delete(self.key(namespace, key))
            except FAILURES as exc:
                self.breaker.failed(exc)
            return Outcome.DATA_LOSS, 0
        out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        self.events.add("promoted")
        return Outcome.DONE, got[2]

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        """Remove the keys' values, and drop the writes of them still queued."""
        if not keys:
            return 0
        with self.tombstones.publishing:
            self.tombstones.delete(namespace, keys)
            if not self.breaker.allows():
                return 0
            try:
                return int(self.client.delete(*[self.key(namespace, k) for k in keys]))
            except FAILURES as exc:
                self.breaker.failed(exc)
                return 0

    # -- the rest ------------------------------------------------------------------
    def stats(self) -> TierStats:
        """Redis holds what it holds (shared, evicting on its own): no capacity or occupancy of ours."""
        return TierStats(TierKind.REMOTE, 0, 0, 0, 0, 0, self.slot_bytes, self.breaker.open, self.events.snapshot())

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self, timeout: float = 0.0) -> None:
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=max(timeout, 0.1))
        except queue.Full:
            pass
        self._writer.join(timeout)
        if self._client is not None:
            self._client.close()


class _RemoteFetch:
    """A restore's values Redis held when asked: checked and unpacked into host slots."""

    def __init__(self, store: RemoteStore, namespace: str, present: list[tuple[bytes, bytes]]) -> None:
        self._store, self._namespace = store, namespace
        self.keys = [k for k, _ in present]
        self._values = [v for _, v in present]

    def read(self, targets: list[tuple[int, torch.Tensor]]) -> list[tuple[Outcome, int]]:
        return [self._store._unpack(self._namespace, self.keys[j], self._values[j], out) for j, out in targets]

    def end(self, corrupt: set[int]) -> None:
        self._values = []  # the values: gone with the restore
