"""kvxfer's KV events as vLLM 0.33's own subscriber code reads them: over a real ZeroMQ socket, decoded
by vLLM's msgspec decoder (``KVEventBatch``), in order with no gap, naming blocks by the hashes
vLLM's scheduler computed, each with its tokens and parent (vLLM's own hash of them is the block's);
a replay from a position the publisher no longer holds starts with
``AllBlocksCleared`` (never a silent gap)."""

import time

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens

from kvxfer import Client
from kvxfer.bench import launch
from tests.e2e.redis_server import free_port
from tests.vllm.conftest import DAEMON
from tests.vllm.test_backend import PROMPT, TAIL, run_alone
from tests.tiermem import flip_byte

DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """A SUB socket on the publisher, as vLLM's example subscriber makes one."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.batches: list[tuple[int, KVEventBatch]] = []

    def until(self, done, timeout=20.0) -> list:
        deadline = time.monotonic() + timeout
        while not done(self.events()):
            assert time.monotonic() < deadline, self.events()
            if self.sub.poll(100):
                _topic, seq, payload = self.sub.recv_multipart()
                self.batches.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        return self.events()

    def events(self) -> list:
        return [e for _, b in self.batches for e in b.events]

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def replay(endpoint: str, start: int) -> list[tuple[int, KVEventBatch | None]]:
    """Ask the ROUTER for every batch from ``start`` (vLLM's convention), until the end marker."""
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    finally:
        ctx.destroy(linger=0)


def test_vllm_decodes_every_event_with_its_own_hashes_in_order(make_engine, tmp_path):
    publish, router = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    daemon = launch.spawn({**DAEMON, "events": {"publish": publish, "replay": router, "publish_replay_mib": 4096 / (1 << 20)},
                           "disk": {"path": str(tmp_path / "disk"), "capacity_mib": 51.2}})
    subscriber = Subscriber(publish)
    try:
        time.sleep(0.3)  # a SUB socket misses what is published before it is connected
        engine = make_engine(daemon.config["socket"])
        run_alone(engine, "A", PROMPT)
        expected = [key[:-4] for key in engine.offload_keys(PROMPT)][:4]  # the scheduler's block hashes
        events = subscriber.until(lambda ev: sum(len(e.block_hashes) for e in ev if isinstance(e, BlockStored)) >= 4)
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert [h for e in stored for h in e.block_hashes] == expected
        assert {(e.medium, e.group_idx, e.ownership, e.locality) for e in stored} == {("CPU", 0, "kvxfer", "LOCAL")}
        assert all(isinstance(h, bytes) and len(h) == 32 for h in expected)
        # Self-describing (a router, as llm-d's indexer, recomputes each key from tokens and parent): vLLM's own
        # hash of each block's tokens chained from the event's parent is the block's hash.
        hash_fn = get_hash_fn_by_name(engine.config.cache_config.prefix_caching_hash_algo)
        size = engine.config.cache_config.block_size
        for e in stored:
            assert e.block_size == size and len(e.token_ids) == size * len(e.block_hashes)
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                assert hash_block_tokens(hash_fn, parent, e.token_ids[i * size:(i + 1) * size]) == h
                parent = h
        assert stored[0].parent_block_hash is None  # the prompt's first block starts the chain
        assert [t for e in stored for t in e.token_ids] == list(PROMPT[:4 * size])
        assert all(e.extra_keys in (None, [None] * len(e.block_hashes)) and e.lora_name is None for e in stored)

        # A tenant's request: its cache_salt entered its first block's hash, and the events say so as vLLM's own
        # do (untagged, on that block), so that a router tags it and recomputes every hash.
        other = PROMPT[::-1]  # other bytes too: the corruption below must find its block once
        salted = {h: None for h in (key[:-4] for key in engine.offload_keys(other, cache_salt="tenant-a")[:4])}
        run_alone(engine, "S", other, cache_salt="tenant-a")
        events = subscriber.until(lambda ev: salted.keys() <= {h for e in ev if isinstance(e, BlockStored)
                                                               for h in e.block_hashes})
        mine = [e for e in events if isinstance(e, BlockStored) and set(e.block_hashes) <= salted.keys()]
        extras = [x for e in mine for x in e.extra_keys]
        assert extras == [("tenant-a",), None, None, None]
        parent = None
        for e in mine:
            assert e.parent_block_hash == parent or parent is None
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                tagged = (("cache_salt", e.extra_keys[i][0]),) if e.extra_keys[i] else None
                assert hash_block_tokens(hash_fn, parent, e.token_ids[i * size:(i + 1) * size], tagged) == h
                parent = h

        # Corrupt the last block in the host tier: the restore finds it, drops it, and says so.
        last_block = engine.block_bytes(engine.block_tables["A"][3:4]).contiguous().numpy().tobytes()
        engine.reset_prefix_cache()
        engine.zero_kv()
        assert flip_byte(daemon.proc.pid, last_block) == 1
        run_alone(engine, "B", PROMPT + TAIL)
        events = subscriber.until(lambda ev: any(isinstance(e, BlockRemoved) for e in ev))
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert removed[0] == expected[3] and all(e.medium == "CPU" for e in events if isinstance(e, BlockRemoved))
        seqs = [s for s, _ in subscriber.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # every batch, in order, none missing

        assert [s for s, _ in replay(router, seqs[-1])] == [seqs[-1]]  # a subscriber's last batch, again

        # Through a full host tier (128 blocks): evicted, demoted to disk, deleted from both. Far more
        # than the ROUTER's 4 KiB buffer: a subscriber that missed it all asks from 0.
        with Client(daemon.target, namespace="bulk", pool_id="rank0") as client:
            client.map_pool()
            for i in range(300):
                client.offload([(1, b"bulk%05d" % i)])
            mediums = lambda ev, kind: {e.medium for e in ev if isinstance(e, kind)}  # noqa: E731
            subscriber.until(lambda ev: "DISK" in mediums(ev, BlockStored) and "CPU" in mediums(ev, BlockRemoved))
            assert client.delete([b"bulk00000", b"bulk00299"]) == 2  # one on disk, one in the host tier
        removals = lambda ev, key: sum(key in e.block_hashes for e in ev if isinstance(e, BlockRemoved))  # noqa: E731
        # bulk00000: evicted from the host tier, then deleted from the disk; bulk00299: deleted from the host tier
        subscriber.until(lambda ev: removals(ev, b"bulk00000") >= 2 and removals(ev, b"bulk00299") >= 1)
        seqs = [s for s, _ in subscriber.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # still every batch, in order
        replayed = replay(router, 0)
        assert replayed[0][0] == 0 and isinstance(replayed[0][1].events[0], AllBlocksCleared)  # told: forget me
        tail = [s for s, _ in replayed[1:]]
        assert tail[0] > 0 and tail == list(range(tail[0], tail[0] + len(tail)))
        # The live stream carries what the replay holds (a batch may still be on its way to the SUB socket),
        # and a replay past it holds only batches the live stream carries too.
        subscriber.until(lambda ev: subscriber.batches[-1][0] >= tail[-1])
        later = [s for s, _ in replay(router, tail[-1] + 1)]
        if later:
            subscriber.until(lambda ev: subscriber.batches[-1][0] >= later[-1])
        seqs = [s for s, _ in subscriber.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and set(tail + later) <= set(seqs)
    finally:
        subscriber.close()
        daemon.cleanup()
