"""What a client reads from WatchEvents and Snapshot (``Client.watch_events``, ``Client.snapshot``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvxfer.core.records import PB_TO_TIER, TierKind
from kvxfer.events.event_records import TierEvent
from kvxfer.events.event_wire import event_from_pb
from kvxfer.v1 import kvxfer_pb2 as pb


@dataclass(frozen=True)
class EventBatch:
    """Events in order; ``resync``: some before them are gone (take a snapshot); resume from ``next_sequence``."""

    stream_id: str
    events: list[TierEvent]
    resync: bool
    next_sequence: int


@dataclass(frozen=True)
class SnapshotBatch:
    """Keys a tier holds; every event up to ``sequence`` is reflected (watch from ``sequence + 1``).
    The last batch of a snapshot has no tier and no keys."""

    stream_id: str
    sequence: int
    tier: TierKind | None
    cache_group: str
    namespace: str
    keys: list[bytes]


def event_batches(responses: Iterable[pb.WatchEventsResponse]) -> Iterator[EventBatch]:
    for r in responses:
        yield EventBatch(r.stream_id, [event_from_pb(e) for e in r.events], r.resync, r.next_sequence)


def snapshot_batches(responses: Iterable[pb.SnapshotResponse]) -> Iterator[SnapshotBatch]:
    for r in responses:
        yield SnapshotBatch(r.stream_id, r.sequence, PB_TO_TIER.get(r.tier), r.cache_group, r.namespace, list(r.keys))


__all__ = ["EventBatch", "SnapshotBatch", "event_batches", "snapshot_batches"]
