"""WatchEvents and Snapshot: the tiers' KV events streamed to subscribers, and what the tiers hold.

A subscriber reads the hub's replay buffer from its own position, on the event loop, never
holding a thread: it waits for the next event, takes up to ``BATCH_EVENTS`` of them, keeps
those of the namespaces it watches (and CLEARED) and yields them; gRPC's flow control holds
it while the client is slow. A client that falls behind the buffer, or names a position the
daemon no longer holds (or another daemon's stream), is told ``resync``, never shown a gap.
A subscriber costs no memory of its own: the buffer is the hub's. Each event is serialized once
for every subscriber (``Encoded``), and a response is those bytes joined: a hundred subscribers
cost a hundred joins, not a hundred encodings. A subscriber's responses go out at its own phase of
each ``linger`` period (``flush_phase``): a hundred subscribers woken by one event send across the
period, not in one burst that holds the event loop from every other RPC.

Both show a caller only the cache groups it may see: the daemon's own, those registered with
``share_events``, and those of the registered pools it names with their registration tokens.

A Snapshot reads the host and disk indexes of every such cache group a batch at a time on a worker
thread, after taking the hub's position: applying the events that follow that position on
top of it gives the tiers as they are (an event the snapshot already reflects changes nothing).
Redis and the shared filesystem are shared by every node: their contents are not this
daemon's to list (their STORED and REMOVED events are those of this daemon's own writes).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

from kvxfer.core.errors import InvalidArgument, ResourceExhausted
from kvxfer.core.records import TIER_TO_PB
from kvxfer.core.validate import check_count, check_namespace
from kvxfer.events.event_hub import EventHub
from kvxfer.events.event_records import EventKind, TierEvent
from kvxfer.events.event_wire import event_to_pb
from kvxfer.serving.pool_registry import PoolRegistry
from kvxfer.v1 import kvxfer_pb2 as pb

MAX_WATCHED = 16  # namespaces one call names
BATCH_EVENTS = 256  # events a response carries at most
GOLDEN = 0.6180339887498949  # phases n * GOLDEN mod 1 stay evenly spread however many subscribers join
IDLE_S = 5.0  # a watch with nothing new for it says where it stands this often
SNAPSHOT_KEYS = 4096  # keys a Snapshot response carries at most


class Encoded:
    """Each event of one hub as field 2 of a WatchEventsResponse, serialized once (the latest ``size``
    kept). Used on the event loop only."""

    def __init__(self, size: int = 1 << 13) -> None:
        self._size = size
        self._cache: OrderedDict[int, bytes] = OrderedDict()

    def of(self, event: TierEvent) -> bytes:
        data = self._cache.get(event.sequence)
        if data is None:
            body = event_to_pb(event).SerializeToString()
            data = self._cache[event.sequence] = _EVENTS_TAG + _varint(len(body)) + body
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return data


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_EVENTS_TAG = bytes([2 << 3 | 2])  # field 2 (events), length-delimited


def flush_phase(ordinal: int, linger: float) -> float:
    """Seconds into each ``linger`` period at which the ``ordinal``-th subscriber's responses go out."""
    return (ordinal * GOLDEN) % 1.0 * linger


def serialize(response: bytes) -> bytes:
    """WatchEvents' response serializer: its responses are serialized already."""
    return response


def watched(names) -> frozenset[str]:
    """The namespaces a call names: 1 to ``MAX_WATCHED`` valid names."""
    check_count(len(names), MAX_WATCHED, "namespaces")
    if not names:
        raise InvalidArgument(f"name the namespaces to watch (1 to {MAX_WATCHED})")
    for name in names:
        check_namespace(name)
    return frozenset(names)


async def watch(hub: EventHub, encoded: Encoded, request: pb.WatchEventsRequest, scopes: frozenset[int],
                linger: float = 0.05, idle_s: float = IDLE_S, clock=None, sleep=asyncio.sleep
                ) -> AsyncIterator[bytes]:
    """``scopes``: the event scopes the caller may see (``PoolRegistry.event_scopes``). ``linger``: seconds a
    response waits for more events (fewer, larger responses: a hundred subscribers of a busy daemon cost
    it a hundred sends every ``linger``, not a hundred an event), until this subscriber's phase of the period.
    ``idle_s``: a watch with nothing for it says where the stream stands at least this often (``clock``: the
    loop's unless given, and ``sleep`` waits on it)."""
    namespaces = watched(request.namespaces)
    last, stream = hub.last_sequence, hub.stream_id
    foreign = bool(request.stream_id) and request.stream_id != stream  # a position in another daemon's stream
    if request.from_sequence > last + 1 and not foreign:  # (another stream's positions say nothing of this one)
        raise InvalidArgument(f"from_sequence {request.from_sequence} is past the next event ({last + 1})")
    if hub.subscribers >= hub.max_subscribers:
        raise ResourceExhausted(f"{hub.subscribers} WatchEvents streams are open; at most {hub.max_subscribers}")
    hub.subscribers += 1
    phase = flush_phase(hub.joined, linger) if linger else 0.0
    hub.joined += 1
    try:
        after = last if request.from_sequence == 0 else request.from_sequence - 1
        if foreign:
            yield pb.WatchEventsResponse(stream_id=stream, resync=True, next_sequence=last + 1).SerializeToString()
            after = last
        clock = clock or asyncio.get_running_loop().time
        said = clock()  # when the client last heard where the stream stands
        while not hub.closed:
            events, gap = hub.read(after, BATCH_EVENTS)
            if not events:
                left = said + idle_s - clock()  # the time left, not a new period: other events do not reset it
                if left > 0:
                    await hub.wait(after, left)
                    continue
                said = clock()
                yield pb.WatchEventsResponse(stream_id=stream, next_sequence=after + 1).SerializeToString()
                continue
            if len(events) < BATCH_EVENTS and linger:  # a few more arrive meanwhile: one response, not many
                await sleep((phase - clock()) % linger)  # (at most ``linger``: the wait it always was, bounded)
                more, lost = hub.read(events[-1].sequence, BATCH_EVENTS - len(events))
                if not lost:  # (else the next read says resync: a response never spans a gap)
                    events += more
            after = events[-1].sequence
            mine = [encoded.of(e) for e in events
                    if e.scope in scopes and (e.namespace in namespaces or e.kind is EventKind.CLEARED)]
            if mine or gap or clock() - said >= idle_s:  # (other namespaces' events: the position, now and then)
                said = clock()
                head = pb.WatchEventsResponse(stream_id=stream, resync=gap, next_sequence=after + 1).SerializeToString()
                yield head + b"".join(mine)  # (a message's fields may come in any order: the events follow)
    finally:
        hub.subscribers -= 1


async def snapshot(hub: EventHub, registry: PoolRegistry, executor: ThreadPoolExecutor,
                   request: pb.SnapshotRequest, scopes: frozenset[int]) -> AsyncIterator[pb.SnapshotResponse]:
    """``scopes``: as for ``watch``: the groups of other scopes are not listed."""
    namespaces = sorted(watched(request.namespaces))
    sequence = hub.last_sequence  # first: every event up to here is reflected by what follows
    loop = asyncio.get_running_loop()
    for group in registry.groups():
        if group.event_scope not in scopes:
            continue
        for index in group.key_indexes():
            for namespace in namespaces:
                batches: Iterator[list[bytes]] = index.namespace_keys(namespace, SNAPSHOT_KEYS)
                while (keys := await loop.run_in_executor(executor, next, batches, None)) is not None:
                    yield pb.SnapshotResponse(stream_id=hub.stream_id, sequence=sequence, tier=TIER_TO_PB[index.tier],
                                              cache_group=group.name, namespace=namespace, keys=keys)
    yield pb.SnapshotResponse(stream_id=hub.stream_id, sequence=sequence)  # the end: no tier, no keys


__all__ = ["Encoded", "serialize", "snapshot", "watch", "watched"]
