"""KV events at the source: the hub (numbering, the bounded replay buffer, resync, waiting) and the
index that emits them (stored once published, removed before a slot is reused, the reason named)."""

import asyncio
import threading

import numpy as np
import pytest

import kvxfer.index.eviction as eviction
import kvxfer.index.keytable as keytable
from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import TierKind
from kvxfer.events.event_hub import EventHub
from kvxfer.events.event_records import EngineBlocks, EventKind, KeyFormat, Reason
from kvxfer.events.event_wire import engine_from_pb, engine_to_pb, event_from_pb, event_to_pb
from kvxfer.events.vllm_wire import VllmEncoder
from kvxfer.index.block_index import BlockIndex
from kvxfer.serving.batch import TransferBatch, TransferKind
from kvxfer.tiers.registry import placements


@pytest.fixture(params=["c", "python"])
def native(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(keytable, "TABLES", None)
        monkeypatch.setattr(eviction, "USE_ORDER", None)


def index_with_events(capacity=4):
    hub = EventHub()
    return hub, BlockIndex(TierKind.HOST, capacity, events=hub.tier(TierKind.HOST, "g"))


def store(index, keys, engine=None, ok=True):
    plan = index.prepare_store("ns", keys)
    index.complete_store(plan.slots, [7 if ok else None] * len(plan.slots), engine)
    return plan


def summary(hub):
    return [(e.sequence, e.kind, e.keys, e.reason) for e in hub.read(0, 1000)[0]]


def test_stored_when_published_removed_before_reuse_with_the_reason(native):
    hub, index = index_with_events(capacity=3)
    plan = index.prepare_store("ns", [b"a", b"b"])
    assert hub.last_sequence == 0  # reserved is not restorable
    index.complete_store(plan.slots, [1, None])  # b failed: never visible, never announced
    store(index, [b"c", b"d", b"e"])  # full: a is evicted first
    load = index.prepare_load("ns", [b"c"])
    index.complete_load(load.slots, {0})  # corrupt
    index.delete("ns", [b"d", b"zz"])
    assert summary(hub) == [
        (1, EventKind.STORED, (b"a",), None),
        (2, EventKind.REMOVED, (b"a",), Reason.EVICTED),  # before its slot takes a new block
        (3, EventKind.STORED, (b"c", b"d", b"e"), None),
        (4, EventKind.REMOVED, (b"c",), Reason.CORRUPTED),
        (5, EventKind.REMOVED, (b"d",), Reason.DELETED)]
    index.announce_all(Reason.CLEARED)
    assert summary(hub)[5:] == [(6, EventKind.REMOVED, (b"e",), Reason.CLEARED), (7, EventKind.CLEARED, (), None)]


def test_a_pending_entry_deleted_is_never_announced(native):
    hub, index = index_with_events()
    plan = index.prepare_store("ns", [b"a"])
    index.delete("ns", [b"a"])
    index.complete_store(plan.slots, [5])
    assert summary(hub) == []


def test_the_buffer_is_bounded_by_keys_and_a_late_reader_is_told_to_resync():
    hub = EventHub(replay_keys=100)
    for i in range(50):
        hub.emit(EventKind.STORED, TierKind.HOST, "g", "ns", [b"k%d" % i] * 9)
    events, gap = hub.read(0, 1000)
    assert gap and events[0].sequence > 1 and [e.sequence for e in events] == list(range(events[0].sequence, 51))
    assert sum(len(e.keys) + 1 for e in events) <= 100 and hub.dropped == 50 - len(events)
    assert hub.read(49, 10) == ([hub.read(0, 1000)[0][-1]], False)  # within the buffer: no gap
    assert hub.read(50, 10) == ([], False)


def test_the_buffer_is_bounded_by_bytes_whatever_the_namespaces_and_keys():
    """Each event holds its namespace's name and its keys: long ones, or namespaces a client invents, are
    bounded by replay_bytes even when the key count would allow far more."""
    from kvxfer.events.event_hub import event_bytes

    hub = EventHub(replay_keys=1 << 30, replay_bytes=64 << 10)
    for i in range(2000):
        hub.emit(EventKind.STORED, TierKind.HOST, "g", f"invented-{i}-" + "n" * 100, [b"k" * 200])
    events, gap = hub.read(0, 10_000)
    assert gap and sum(event_bytes(e) for e in events) <= 64 << 10 and hub.dropped == 2000 - len(events)
    assert events[-1].namespace.startswith("invented-1999-")
    # ... and by what the offloads said of their blocks: tokens and extra keys a client may make large.
    engine = EngineBlocks(KeyFormat.VLLM, block_size=4096, token_ids=np.zeros(4096, np.uint32), lora_name="l",
                          extra_keys=(("s" * 1024,) * 60,))
    for i in range(100):
        hub.emit(EventKind.STORED, TierKind.HOST, "g", "ns", [b"k%d" % i], engine=engine)
    events, _ = hub.read(0, 10_000)
    assert event_bytes(events[0]) > 64 << 10 and [e.keys for e in events] == [(b"k99",)]  # the newest alone


def test_async_and_thread_waiters_wake_on_an_event_from_another_thread():
    hub = EventHub()

    async def main():
        hub.attach(asyncio.get_running_loop())
        threading.Timer(0.05, lambda: hub.emit(EventKind.STORED, TierKind.HOST, "g", "ns", [b"x"])).start()
        await hub.wait(0, 5)
        return hub.last_sequence

    assert asyncio.run(main()) == 1
    threading.Timer(0.05, lambda: hub.emit(EventKind.STORED, TierKind.HOST, "g", "ns", [b"y"])).start()
    assert hub.wait_blocking(1, 5) and not hub.wait_blocking(2, 0.01)


def test_an_event_wakes_the_loop_only_while_a_coroutine_waits_and_no_wake_is_lost():
    """With nobody waiting, an emit from a copying thread schedules nothing on the loop (a wake took the GIL from
    the copy); with waiters, every event emitted after a wait began wakes it, however the two interleave."""
    hub = EventHub()
    scheduled = []

    async def main():
        loop = asyncio.get_running_loop()
        hub.attach(loop)
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: scheduled.append(a) or real(*a)
        emitter = threading.Thread(target=lambda: [hub.emit(EventKind.STORED, TierKind.HOST, "g", "ns", [b"%d" % i])
                                                   for i in range(200)])
        emitter.start()
        emitter.join()
        idle_wakes = len(scheduled)
        seen = hub.last_sequence
        for round_ in range(50):  # a waiter and an emit from another thread, racing
            thread = threading.Thread(target=hub.emit, args=(EventKind.STORED, TierKind.HOST, "g", "ns", [b"r"]))
            thread.start()
            await hub.wait(seen, 30)  # a lost wake would sit out the 30 s (and the test's timeout)
            assert hub.last_sequence > seen
            thread.join()
            seen = hub.last_sequence
        return idle_wakes

    assert asyncio.run(main()) == 0


def test_an_offload_description_travels_with_the_blocks_it_stored():
    keys = [b"h%d" % i + b"\0\0\0\1" for i in range(3)]
    engine = EngineBlocks(KeyFormat.VLLM, parent_block_hash=b"P", block_size=2, token_ids=[1, 2, 3, 4, 5, 6])
    batch = TransferBatch.build(TransferKind.OFFLOAD, "ns", [1, 2, 3], keys, 10, engine=engine)
    hub, index = index_with_events()
    store(index, [keys[0]])  # held already: not stored again, not announced again
    plan = index.prepare_store("ns", keys)
    index.complete_store(plan.slots, [1] * len(plan.slots), batch.engine)
    event = hub.read(1, 10)[0][0]
    msg = event_to_pb(event)
    assert list(msg.keys) == keys[1:] and list(msg.engine.token_ids) == [3, 4, 5, 6]
    assert msg.engine.parent_block_hash == b"h0" and msg.engine.block_size == 2  # the block before, by its hash
    assert event_from_pb(msg).keys == tuple(keys[1:])
    for bad in (EngineBlocks(token_ids=[1, 2]), EngineBlocks(block_size=2, token_ids=[1, 2, 3, 4, 5, -1]),
                EngineBlocks(block_size=1 << 13), EngineBlocks(parent_block_hash=b"x" * 257),
                EngineBlocks(block_size=2, token_ids=[1.5] * 6)):
        with pytest.raises(InvalidArgument):
            TransferBatch.build(TransferKind.OFFLOAD, "ns", [1, 2, 3], keys, 10, engine=bad)
    with pytest.raises(InvalidArgument):
        TransferBatch.build(TransferKind.RESTORE, "ns", [1, 2, 3], keys, 10, engine=EngineBlocks())


def test_extra_keys_and_lora_travel_per_block_and_a_malformed_one_is_refused():
    keys = [b"h%d" % i + b"\0\0\0\1" for i in range(3)]
    extras = (("tenant", ("img-1", -3), b"\x01" * 32), (), (("img-1", 13),))
    engine = EngineBlocks(KeyFormat.VLLM, block_size=2, token_ids=[1, 2, 3, 4, 5, 6], lora_name="sql", lora_id=7,
                          extra_keys=extras)
    batch = TransferBatch.build(TransferKind.OFFLOAD, "ns", [1, 2, 3], keys, 10, engine=engine_from_pb(
        engine_to_pb(engine)))  # through the request's wire form, as the daemon receives it
    assert batch.engine.extra_keys == extras and (batch.engine.lora_name, batch.engine.lora_id) == ("sql", 7)
    hub, index = index_with_events()
    store(index, [keys[0]])  # held already: the event names the other two, with their own extra keys
    plan = index.prepare_store("ns", keys)
    index.complete_store(plan.slots, [1] * len(plan.slots), batch.engine)
    event = event_from_pb(event_to_pb(hub.read(1, 10)[0][0]))
    assert [event.engine.extras_of(k) for k in event.keys] == [(), (("img-1", 13),)]
    assert event.engine.lora_name == "sql" and event.engine.lora_id == 7
    # vLLM's BlockStored, as its own publisher fills it
    published = VllmEncoder(placement=placements()).convert(hub.read(1, 10)[0][0])[0]
    assert (published.lora_name, published.lora_id, published.extra_keys) == ("sql", 7, [None, (("img-1", 13),)])
    for bad in (dict(extra_keys=((),)), dict(extra_keys=(("",), (), ())), dict(extra_keys=((b"",), (), ())),
                dict(extra_keys=((1,), (), ())), dict(extra_keys=((("m", "0"),), (), ())),
                dict(extra_keys=(("x" * 1025,), (), ())), dict(extra_keys=((b"d" * 65,), (), ())),
                dict(lora_name="a\nb"), dict(lora_id=-1), dict(lora_id=True), dict(extra_keys=5),
                dict(extra_keys=(5, (), ())),
                dict(extra_keys=(("t",) * 30_000, ("t",) * 30_000, ("t",) * 30_000))):
        with pytest.raises(InvalidArgument):
            TransferBatch.build(TransferKind.OFFLOAD, "ns", [1, 2, 3], keys, 10, engine=EngineBlocks(**bad))


def test_namespace_keys_lists_complete_entries_of_one_namespace(native):
    hub, index = index_with_events(capacity=64)
    store(index, [b"a%d" % i for i in range(20)])
    plan = index.prepare_store("other", [b"o1"])
    index.complete_store(plan.slots, [1])
    index.prepare_store("ns", [b"pending"])
    got = [k for batch in index.namespace_keys("ns", 7) for k in batch]
    assert sorted(got) == sorted(b"a%d" % i for i in range(20)) and max(map(len, index.namespace_keys("ns", 7))) == 7
    assert list(index.namespace_keys("nobody")) == []
