"""A router's kv.fetch (the hint envelope) between real peered daemons: the blocks it names are pulled from the
peer it names, and from that peer alone, into the host tier while the request waits; a peer that holds only
some of them gives those (a partial pull: the rest stays for the engine to recompute), every byte as the
source held it; a source that is no configured peer is never dialled."""

import time

import pytest
import torch

from kvxfer.core.envelope import event_hash
from kvxfer.core.records import Outcome, TierKind
from tests.peering.cluster import block, client, fill, keys

pytestmark = pytest.mark.e2e


def fetch(source: str, names: list, action_id: str = "f1") -> dict:
    return {"protocol_version": "0.1", "message_id": "route-1",
            "actions": [{"action_id": action_id, "action_type": "kv.fetch", "action_version": "1.0",
                         "payload": {"source_control_endpoint": source, "block_hashes": names}}]}


def until_host(c, ks: list[bytes]) -> None:
    deadline = time.monotonic() + 60  # a hang guard, not a timing
    while c.lookup(ks).tiers != [TierKind.HOST] * len(ks):
        assert time.monotonic() < deadline, c.lookup(ks).tiers
        time.sleep(0.05)


def test_a_partial_pull_from_the_named_peer_alone_bytes_exact(cluster):
    d = cluster(["a", "b", "c"])
    ks = keys("turn", 12)
    with client(d["a"]) as a, client(d["b"]) as b, client(d["c"]) as c:
        held = fill(a, list(range(1, 9)), seed=3)
        a.offload([(slot, ks[slot - 1]) for slot in range(1, 9)])  # a holds 8 of the 12
        fill(c, [1, 2], seed=4)
        c.offload([(1, ks[8]), (2, ks[9])])  # c holds 2 others
        # b's request: the 12 blocks; the router says a holds them (by 64-bit hash, as routers index them)
        b.hint_envelope(fetch("a", [event_hash(k, vllm_keys=False) for k in ks]), ks, request_id="req-1")
        until_host(b, ks[:8])
        tiers = b.lookup(ks).tiers
        assert tiers[8:10] == [TierKind.PEER] * 2 and tiers[10:] == [None] * 2  # c's not read: not the named one
        result = b.restore([(k, 20 + i) for i, k in enumerate(ks[:8])])
        assert result.outcomes == [Outcome.DONE] * 8
        for i in range(8):
            assert torch.equal(block(b, 20 + i), held[i + 1])
        restored = b.restore([(k, 40 + i) for i, k in enumerate(ks[10:])], partial=True)
        assert restored.outcomes == [Outcome.NOT_FOUND] * 2  # nobody holds them: the engine recomputes them


def test_a_peer_named_by_address_is_read_and_a_stranger_never_dialled(cluster):
    d = cluster(["a", "b"])
    ks = keys("addr", 4)
    with client(d["a"]) as a, client(d["b"]) as b:
        fill(a, [1, 2, 3, 4], seed=5)
        a.offload(list(zip([1, 2, 3, 4], ks)))
        b.hint_envelope(fetch("tcp://127.0.0.1:1", [k.hex() for k in ks]), ks)  # no peer of b's
        b.hint_envelope(fetch("tcp://" + d["a"].config["listen"], [k.hex() for k in ks[:2]]), ks)
        until_host(b, ks[:2])
        assert b.lookup(ks[2:]).tiers == [TierKind.PEER] * 2
    assert "127.0.0.1:1" not in [line for line in d["b"].log_text().splitlines() if "peer connected" in line]
    assert "unknown_peer" in d["b"].log_text()
