"""A cache group's tier in a Mooncake Store cluster: blocks every daemon (and node) joined to it shares.

One value per block under ``<key_prefix><group>/<namespace>/<key hex>``: the sealed record the
Redis and object tiers keep (``kvxfer.tiers.record``: its header with the block format's
fingerprint, namespace, key and checksum, the bytes and, with ``secret``, an HMAC-SHA256 under the
value's full name, prefix included), so a value written by anyone else, moved to another name or
prefix, truncated or forged is DATA_LOSS (and removed), never served.

Bytes move without copies the API can spare: blocks leaving the host tier are copied once into
staging buffers registered with the store, the header before them and the MAC where the seal
puts it (BLAKE3: after the header; HMAC-SHA256: after the block) written in place,
and put from there in batches (``batch_put_from``). A restore reads each value in its parts
(``batch_get_into_multi_buffers``): the block straight into its host slot (the group's host tier
is registered with the store, as SGLang's and vLLM's Mooncake connectors register their host
buffers), the header and MAC beside it, and checks them there; a block that fails its checks is
never published in the host tier. (Into memory that is not the host tier's, values go through a
registered bounce buffer and are copied.)

Mooncake evicts on its own: a value gone is a miss, never an error, and its eviction is announced
by the audit (``kvxfer.tiers.mooncake.audit``) since the store tells no one. Every call is
bounded (``kvxfer.tiers.mooncake.client``): a master stopped, stalled or restarting turns
lookups and restores into misses and stores into drops, and marks the tier degraded until a
probe finds it back; the host and other tiers never wait on it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from kvxfer.core.records import Outcome, TierKind, TierStats
from kvxfer.events.event_hub import EventHub
from kvxfer.events.event_records import Reason
from kvxfer.tiers.lower import Nothing, StagedBlock
from kvxfer.tiers.mooncake.audit import EvictionAudit
from kvxfer.tiers.mooncake.client import ABSENT, Code, MooncakeClient, NotSent, Unanswered
from kvxfer.tiers.mooncake.settings import MooncakeSettings
from kvxfer.tiers.record import (MAC_BYTES, MAX_HEADER, DiskCorrupt, header, header_length, mac, seal_of, unpack,
                                 unpack_parts)
from kvxfer.tiers.write_queue import EventCounts, Staged, WriteQueue, announce_corrupt, announce_stored, to_send

BATCH = 32  # blocks a put, or a get through the bounce buffer, moves at once (the bounce buffer holds one batch)
READ_BATCH = 256  # blocks a get straight into host slots moves at once


class MooncakeTier:
    """One cache group's blocks in a Mooncake Store cluster (a ``LowerTier``)."""

    kind = TierKind.MOONCAKE
    restart_warm = False  # the cluster outlives the daemon (its own segment aside)
    index = None  # (the store is asked: it evicts on its own)

    def __init__(self, settings: MooncakeSettings, group: str, fingerprint: bytes, slot_bytes: int,
                 kv_events: EventHub | None = None, host_memory: tuple[int, int] = (0, 0)) -> None:
        """``host_memory``: (address, bytes) of the group's host tier, registered with the store: blocks are read
        straight into their host slots there (anywhere else, through the bounce buffer)."""
        self.settings, self.group, self.fingerprint, self.slot_bytes = settings, group, fingerprint, slot_bytes
        self.kv_events = kv_events.tier(TierKind.MOONCAKE, group) if kv_events else None
        self.takes_stores, self.takes_evictions = settings.write_through, not settings.write_through
        self.value_bytes = MAX_HEADER + slot_bytes + MAC_BYTES  # the most any value of ours holds
        self.events = EventCounts()
        self.queue = WriteQueue(f"kvxfer-mooncake-{group}", settings.max_inflight, slot_bytes, self._write, BATCH,
                                headroom=MAX_HEADER + MAC_BYTES, tailroom=MAC_BYTES)
        self.tombstones = self.queue.tombstones
        self._bounce = np.ones((BATCH, self.value_bytes), dtype=np.uint8)  # touched now
        self._bounce_lock = threading.Lock()
        self._host = host_memory
        self._parts = np.ones((READ_BATCH, MAX_HEADER + MAC_BYTES), dtype=np.uint8)  # each value's header and MAC
        self._parts_lock = threading.Lock()
        registered = [self.queue.staging.memory, (self._bounce.ctypes.data, self._bounce.nbytes),
                      (self._parts.ctypes.data, self._parts.nbytes)]
        self.client = MooncakeClient(settings, group, registered + ([host_memory] if host_memory[1] else []))
        self.audit = EvictionAudit(self.client, self.kv_events, settings.audit_s) if self.kv_events is not None \
            else None

    def name(self, namespace: str, key: bytes) -> str:
        return f"{self.settings.key_prefix}{self.group}/{namespace}/{key.hex()}"

    # -- stores ------------------------------------------------------------------
    def write_now(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> int:
        """Queued like any store (the cluster keeps what it holds across this daemon's restarts)."""
        self.stage(namespace, blocks, key_format)
        return 0

    def stage(self, namespace: str, blocks: list[StagedBlock], key_format: int = 0) -> None:
        for key, checksum, data in blocks:
            if not (self.client.breaker.allows()
                    and self.queue.stage(namespace, key, checksum, data.numpy(), key_format)):
                self.events.add("stores_dropped")

    def _value(self, s: Staged) -> np.ndarray:
        """The block's value in its staging buffer, in place: header, bytes, and with a secret the MAC where the
        seal puts it (BLAKE3: between header and bytes; HMAC-SHA256: after them)."""
        seal, staging = self.settings.seal, self.queue.staging
        head = header(self.fingerprint, s.namespace, s.key, s.checksum, self.slot_bytes, s.key_format, seal)
        secret, name = self.settings.secret, self.name(s.namespace, s.key).encode()
        if secret and seal.tag_first:
            tag = mac(secret, name, head, staging.block(s.buffer), seal=seal)
            return np.frombuffer(staging.with_header(s.buffer, head + tag), dtype=np.uint8)
        return staging.with_trailer(s.buffer, head, lambda v: mac(secret, name, v, seal=seal) if secret else b"")

    def _write(self, batch: list[Staged]) -> None:
        # Decided and sent under ``publishing``: a Delete of a key either comes after the put (and removes it)
        # or before the decision (and the write is dropped). A deleted key never comes back.
        with self.tombstones.publishing:
            alive = to_send(batch, self.tombstones, self.client.breaker.allows(), self.events)
            if not alive:
                return
            values = [self._value(s) for s in alive]
            names = [self.name(s.namespace, s.key) for s in alive]
            try:
                codes = self.client.call(lambda store: store.batch_put_from(
                    names, [v.ctypes.data for v in values], [v.nbytes for v in values]))
            except NotSent:
                self.events.add("stores_dropped", len(alive))
                return
            except Unanswered:
                self.events.add("stores_unconfirmed", len(alive))  # sent, not answered: it may land yet
                return
        written = [s for s, code in zip(alive, codes) if code == 0]
        for code in codes:
            self.events.add({0: "stored", Code.OBJECT_ALREADY_EXISTS: "already_present",
                             Code.NO_AVAILABLE_HANDLE: "stores_no_space"}.get(code, "stores_dropped"))
        failing = [c for c in codes if c in (Code.RPC_FAIL, Code.RPC_TIMEOUT)]
        if failing:
            self.client.failed(failing[0], "put")
        else:
            self.client.succeeded()
        announce_stored(self.kv_events, written)
        if self.audit is not None:
            self.audit.put([(self.name(s.namespace, s.key), s.namespace, s.key, s.key_format) for s in written])

    # -- lookups and restores ---------------------------------------------------------
    def wait_ready(self, until: float) -> bool:
        return True  # (nothing to load: it asks the store)

    def _exist(self, names: list[str], timeout: float | None = None) -> list[bool]:
        codes = self.client.call(lambda store: store.batch_is_exist(names), timeout=timeout)
        failing = [c for c in codes if c not in (0, 1)]
        if failing:
            raise self.client.failed(failing[0], "lookup")
        self.client.succeeded()
        return [c == 1 for c in codes]

    def contains(self, namespace: str, keys: list[bytes], until: float | None = None) -> list[bool]:
        """Which keys the store holds now (one batched question), ended by ``until``; all False when it does
        not answer. Asked every time: what Mooncake evicted is not advertised from here."""
        if not keys or not self.client.breaker.allows():
            return [False] * len(keys)
        timeout = None if until is None else max(0.0, min(self.settings.timeout_s, until - time.monotonic()))
        try:
            return self._exist([self.name(namespace, k) for k in keys], timeout)
        except Unanswered:
            return [False] * len(keys)

    def fetch(self, namespace: str, keys: list[bytes]) -> _MooncakeFetch | Nothing:
        """The named blocks the store holds now; read (and checked) into host slots by ``read``."""
        if not keys or not self.client.breaker.allows():
            return Nothing()
        try:
            there = self._exist([self.name(namespace, k) for k in keys])
        except Unanswered:
            return Nothing()
        return _MooncakeFetch(self, namespace, [k for k, present in zip(keys, there) if present])

    def read_into(self, namespace: str, keys: list[bytes], targets: list[torch.Tensor]
                  ) -> list[tuple[Outcome, int, int]]:
        """(verdict, checksum, key format) of each key read into its host slot, a batch at a time: straight into
        the slots where they are the host tier's (registered), else through the bounce buffer."""
        start, end = self._host[0], self._host[0] + self._host[1]
        if all(start <= t.data_ptr() and t.data_ptr() + self.slot_bytes <= end for t in targets):
            return [v for first in range(0, len(keys), READ_BATCH)
                    for v in self._read_parts(namespace, keys[first:first + READ_BATCH],
                                              targets[first:first + READ_BATCH])]
        return self._read_bounced(namespace, keys, targets)

    def _read_bounced(self, namespace: str, keys: list[bytes], targets: list[torch.Tensor]
                      ) -> list[tuple[Outcome, int, int]]:
        """Values read whole into the bounce buffer, a batch at a time, checked there and copied into the slots."""
        out: list[tuple[Outcome, int, int]] = []
        for first in range(0, len(keys), BATCH):
            out += self._read_batch(namespace, keys[first:first + BATCH], targets[first:first + BATCH])
        return out

    def _read_parts(self, namespace: str, keys: list[bytes], targets: list[torch.Tensor]):
        """One call reads each value in its parts: the header and MAC into a row of ``_parts``, the block into its
        host slot; then each is checked there. Parts are laid out as this tier seals (BLAKE3: header and MAC as
        one part before the block; HMAC-SHA256: the MAC a part of its own after it). A value sealed the other way,
        or of another length (not ours, or the call failed for it: the store says -800 for either), is read again
        through the bounce buffer, which tells which."""
        names = [self.name(namespace, k) for k in keys]
        mac_bytes = MAC_BYTES if self.settings.secret else 0
        seal = self.settings.seal
        first = seal.tag_first
        heads = [header_length(namespace, k) for k in keys]
        with self._parts_lock:
            rows = [self._parts[i] for i in range(len(keys))]
            if first or not mac_bytes:
                ptrs = [[r.ctypes.data, t.data_ptr()] for r, t in zip(rows, targets)]
                sizes = [[h + mac_bytes, self.slot_bytes] for h in heads]
            else:
                ptrs = [[r.ctypes.data, t.data_ptr(), r.ctypes.data + MAX_HEADER] for r, t in zip(rows, targets)]
                sizes = [[h, self.slot_bytes, mac_bytes] for h in heads]
            try:
                codes = self.client.call(lambda store: store.batch_get_into_multi_buffers(names, ptrs, sizes))
            except Unanswered:
                return [(Outcome.FAILED, 0, 0)] * len(keys)  # there (it said), not read: the medium failed
            out: list[tuple[Outcome, int, int] | None] = [None] * len(keys)
            read = []  # (position, its check) of the values read whole
            for i, (key, name, row, target, head, code) in enumerate(zip(keys, names, rows, targets, heads, codes)):
                if code in ABSENT:
                    out[i] = (Outcome.NOT_FOUND, 0, 0)  # evicted since it was asked: a miss
                elif code == head + self.slot_bytes + mac_bytes and (not mac_bytes or seal_of(row) is seal):
                    tag = row[head:head + mac_bytes] if first else row[MAX_HEADER:MAX_HEADER + mac_bytes]
                    read.append((i, (namespace, key, name, row[:head], target.numpy(), tag)))
                # (else asked again below)
            for i, entry in read:  # (on this thread: checks spread over threads cost more CPU, measured)
                out[i] = self._checked(*entry)
        again = [i for i, verdict in enumerate(out) if verdict is None]
        if again:
            redone = self._read_bounced(namespace, [keys[i] for i in again], [targets[i] for i in again])
            for i, verdict in zip(again, redone):
                out[i] = verdict
        return out

    def _checked(self, namespace: str, key: bytes, name: str, head, data, tag) -> tuple[Outcome, int, int]:
        """The verdict on a value read in its parts (the block in its host slot already)."""
        try:
            checksum, key_format = unpack_parts(head, data, tag, name.encode(), namespace, key, self.fingerprint,
                                                self.slot_bytes, self.settings.secret)
        except DiskCorrupt as bad:
            if str(bad) == "foreign_format":
                return Outcome.NOT_FOUND, 0, 0  # another format's block under this name: not ours to judge
            self._corrupt(namespace, key, name)
            return Outcome.DATA_LOSS, 0, 0
        self.events.add("promoted")
        return Outcome.DONE, checksum, key_format

    def _read_batch(self, namespace: str, keys: list[bytes], targets: list[torch.Tensor]):
        names = [self.name(namespace, k) for k in keys]
        with self._bounce_lock:
            rows = [self._bounce[i] for i in range(len(keys))]
            try:
                sizes = self.client.call(lambda store: store.batch_get_into(
                    names, [r.ctypes.data for r in rows], [r.nbytes for r in rows]))
            except Unanswered:
                return [(Outcome.FAILED, 0, 0)] * len(keys)  # there (it said), not read: the medium failed
            return [self._landed(namespace, key, name, row, size, target)
                    for key, name, row, size, target in zip(keys, names, rows, sizes, targets)]

    def _landed(self, namespace: str, key: bytes, name: str, row: np.ndarray, size: int, target: torch.Tensor):
        if size < 0:
            if size in ABSENT:
                return Outcome.NOT_FOUND, 0, 0  # evicted since it was asked: a miss
            if size == Code.INVALID_PARAMS:  # larger than any value of ours: not one of ours
                self._corrupt(namespace, key, name)
                return Outcome.DATA_LOSS, 0, 0
            self.client.failed(size, "get")  # the master or the segment's node failed
            return Outcome.FAILED, 0, 0
        try:
            checksum, data, key_format = unpack(memoryview(row[:size]), name.encode(), namespace, key,
                                                self.fingerprint, self.slot_bytes, self.settings.secret)
        except DiskCorrupt as bad:
            if str(bad) == "foreign_format":
                return Outcome.NOT_FOUND, 0, 0  # another format's block under this name: not ours to judge
            self._corrupt(namespace, key, name)
            return Outcome.DATA_LOSS, 0, 0
        target.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        self.events.add("promoted")
        return Outcome.DONE, checksum, key_format

    def _corrupt(self, namespace: str, key: bytes, name: str) -> None:
        announce_corrupt(self.events, self.kv_events, namespace, key)
        if self.audit is not None:
            self.audit.forget([name])
        try:
            self.client.call(lambda store: store.remove(name, True))  # (forced: a reader's lease does not keep it)
        except Unanswered:
            pass  # the breaker counted it; the value fails its checks again when next read

    def delete(self, namespace: str, keys: list[bytes]) -> int:
        """Remove the keys' values (forced: a reader's lease does not keep them), and drop their queued writes."""
        if not keys:
            return 0
        names = [self.name(namespace, k) for k in keys]
        with self.tombstones.publishing:
            self.tombstones.delete(namespace, keys)
            if self.audit is not None:
                self.audit.forget(names)
            if self.kv_events is not None:
                self.kv_events.removed(namespace, keys, Reason.DELETED)
            try:  # (sent even while the breaker is open: a Delete left undone would serve the keys again)
                codes = self.client.call(lambda store: store.batch_remove(names, True), always=True)
            except Unanswered:
                self.events.add("deletes_failed", len(keys))
                return 0
        return sum(code == 0 for code in codes)

    # -- the rest ------------------------------------------------------------------
    def stats(self) -> TierStats:
        """The cluster holds what it holds (shared, evicting on its own): no capacity or occupancy of ours."""
        return TierStats(TierKind.MOONCAKE, 0, 0, 0, 0, 0, self.slot_bytes, self.client.breaker.open,
                         self.events.snapshot())

    def flush(self, timeout: float) -> bool:
        return self.queue.flush(timeout)

    def close(self, timeout: float = 0.0) -> None:
        if self.audit is not None:
            self.audit.close()
        self.queue.close(timeout)
        self.client.close()


class _MooncakeFetch:
    """A restore's blocks the store held when asked: read, checked and copied into host slots by ``read``."""

    def __init__(self, tier: MooncakeTier, namespace: str, keys: list[bytes]) -> None:
        self._tier, self._namespace = tier, namespace
        self.keys = keys
        self.formats = [0] * len(keys)

    def read(self, targets: list[tuple[int, torch.Tensor]]) -> list[tuple[Outcome, int]]:
        got = self._tier.read_into(self._namespace, [self.keys[j] for j, _ in targets], [t for _, t in targets])
        out = []
        for (j, _), (verdict, checksum, key_format) in zip(targets, got):
            self.formats[j] = key_format
            out.append((verdict, checksum))
        return out

    def end(self, corrupt: set[int]) -> None:
        return None  # (corrupt values were removed when found)
