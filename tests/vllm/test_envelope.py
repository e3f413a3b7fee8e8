"""A router's hint envelope (``kv_hints``, vLLM's KvHintsEnvelope) through vLLM's real scheduler and connector,
against real daemons: each action type does what it says (kv.retain and kv.release of the request's blocks as
they are stored, kv.prefetch of the blocks its hashes name from the disk tier, kv.fetch from the peer the
router names, also one that holds only some of them); actions the backend cannot take cost the action, never
the request. Every answer is the token the stand-in model gives for the whole prompt."""

import pytest
import torch
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

from kvxfer import Client
from kvxfer.bench import launch
from kvxfer.bench.peering_local import peering_configs, self_signed
from kvxfer.core.envelope import event_hash
from kvxfer.core.records import TierKind
from tests.vllm.conftest import DAEMON
from tests.vllm.test_hints import OTHER, PROMPT, metric, on_disk, prefetched, until, where


TOKEN = "vllm-peers-token"


def hints(*actions: tuple, message_id: str = "route-7") -> KvHintsEnvelope:
    return KvHintsEnvelope("0.1", message_id, [KvHintAction(f"a{i}", t, v, p) for i, (t, v, p) in enumerate(actions)])


def hashes(engine, tokens: list[int]) -> list[int]:
    """The request's blocks as a KV-aware router names them: vLLM's 64-bit event hashes."""
    return [event_hash(k, vllm_keys=True) for k in engine.offload_keys(tokens)]


def outcome(port: int, action: str, result: str) -> float:
    return metric(port, "kvxfer_hint_envelope_actions_total", f'action="{action}",outcome="{result}"')


def test_retain_and_release_of_the_requests_blocks_and_what_cannot_be_taken(disk_daemon, make_engine):
    port = disk_daemon.metrics_port
    engine = make_engine(disk_daemon.config["socket"])
    engine.add("kept", PROMPT, kv_hints=hints(("kv.retain", "1.0", {"ttl_s": 600})))
    engine.add("last", OTHER[0], kv_hints=hints(("kv.release", "1.0", {})))
    engine.add("odd", OTHER[1], kv_hints=hints(
        ("kv.pin", "1.0", {"ttl_s": 5}), ("kv.retain", "3.0", {"ttl_s": 5}), ("kv.retain", "1.0", {"ttl_s": "5m"}),
        ("kv.prefetch", "1.0", {"block_hashes": list(range(70_000))}),
        ("kv.fetch", "1.0", {"source_control_endpoint": "tcp://203.0.113.9:5555", "block_hashes": [1]}),
        message_id="odd-one"))
    engine.run({"kept", "last", "odd"})
    for req, tokens in (("kept", PROMPT), ("last", OTHER[0]), ("odd", OTHER[1])):  # every request answered right
        assert engine.outputs[req] == [engine.expected_token(tokens)]
    labels = 'cache_group="{}",state="{}",tier="host"'
    group = engine.worker.spec.names.cache_group(0)
    until(lambda: metric(port, "kvxfer_tier_hinted_blocks", labels.format(group, "released")) == 4, "released")
    assert metric(port, "kvxfer_tier_hinted_blocks", labels.format(group, "retained")) == 4
    until(lambda: outcome(port, "kv.fetch", "unknown_peer") == 1, "the odd envelope counted")
    for action, result in (("kv.retain", "taken"), ("kv.release", "taken"), ("other", "unknown_type"),
                           ("kv.retain", "unknown_version"), ("kv.retain", "malformed"),
                           ("kv.prefetch", "oversized")):
        assert outcome(port, action, result) == 1, (action, result)
    log = disk_daemon.log_text()
    assert "odd-one" in log and "unknown_peer" in log  # the router's ids, to trace what it asked


def test_a_release_of_the_requests_own_blocks_is_sent_when_it_ends_and_takes_the_prefix_it_loaded(disk_daemon,
                                                                                                    make_engine):
    port = disk_daemon.metrics_port
    engine = make_engine(disk_daemon.config["socket"])
    engine.add("turn-1", PROMPT)
    engine.run({"turn-1"})
    until(lambda: where(engine, disk_daemon, PROMPT) == [TierKind.HOST] * 4, "turn 1 stored")
    engine.reset_prefix_cache()
    last = PROMPT + OTHER[2]  # the last turn: the history (4 blocks, loaded) and 4 new blocks
    engine.add("turn-2", last, kv_hints=hints(("kv.release", "1.0", {}), ("kv.retain", "1.0", {"ttl_s": 60,
                                                                          "block_hashes": [7]}), message_id="bye"))
    engine.step()  # the arrival: the retain is sent (and set aside: none of the request's), the release is kept
    until(lambda: outcome(port, "kv.retain", "unresolved") == 1, "the arrival's part")
    assert outcome(port, "kv.release", "taken") == 0
    reports = engine.run({"turn-2"})
    assert sum(r.external_hits.get("turn-2", 0) for r in reports) == 64
    assert engine.outputs["turn-2"] == [engine.expected_token(last)]
    labels = f'cache_group="{engine.worker.spec.names.cache_group(0)}",state="released",tier="host"'
    until(lambda: metric(port, "kvxfer_tier_hinted_blocks", labels) == 8, "the whole session released")
    assert outcome(port, "kv.release", "taken") == 1


def test_a_routers_prefetch_brings_the_named_blocks_up_from_disk_and_they_load_bit_exact(disk_daemon, make_engine):
    engine = make_engine(disk_daemon.config["socket"], settings={"prefetch": False})  # the router's word alone
    stored = on_disk(engine, disk_daemon)
    engine.add("B", PROMPT + [900], kv_hints=hints(("kv.prefetch", "1.0", {"block_hashes": hashes(engine, PROMPT)})))
    engine.step()  # the step that adds B sends the envelope; B waits for its lookup's answer
    until(lambda: where(engine, disk_daemon, PROMPT) == [TierKind.HOST] * 4, "the router's prefetch brought them up")
    reports = engine.run({"B"})
    assert prefetched(disk_daemon.metrics_port) == 4 and outcome(disk_daemon.metrics_port, "kv.prefetch", "taken") == 1
    assert not any(r.load_errors for r in reports)
    assert torch.equal(engine.block_bytes(engine.block_tables["B"][:4]), stored)  # bit-exact, in vLLM's memory
    assert engine.outputs["B"] == [engine.expected_token(PROMPT + [900])]


@pytest.fixture
def peers(tmp_path):
    """Daemons "a" and "b", each the other's peer over loopback (TLS, a token, NIXL over TCP)."""
    pytest.importorskip("nixl_cu13")
    tls = self_signed(tmp_path, TOKEN)
    configs = peering_configs(["a", "b"], tls, "tcp", {n: DAEMON["pools"][0] for n in "ab"})
    started = {}
    try:
        for name in ("a", "b"):
            started[name] = launch.spawn({**DAEMON, **configs[name], "pools": DAEMON["pools"]})
        yield started
    finally:
        for d in started.values():
            d.cleanup()


def test_a_routers_fetch_pulls_what_the_named_peer_holds_and_the_rest_is_recomputed(peers, make_engine, tmp_path):
    token = tmp_path / "daemon-token"  # a daemon with a TCP listener asks for its token on its Unix sockets too
    token.write_text(TOKEN)
    shared = {"share_with_peers": True, "prefetch": False, "daemon_token_file": str(token)}
    source = make_engine(peers["a"].config["socket"], settings=shared)
    source.add("first-half", PROMPT[:32])  # a's engine computed the first 2 of the prompt's 4 blocks
    source.run({"first-half"})
    held = source.block_bytes(source.block_tables["first-half"][:2])
    target = make_engine(peers["b"].config["socket"], settings=shared)
    fetch = hints(("kv.fetch", "1.0", {"source_control_endpoint": "a", "block_hashes": hashes(target, PROMPT)}))
    target.add("turn", PROMPT + [900], kv_hints=fetch)
    target.step()  # the step that adds it sends the envelope; its load is not scheduled before the next
    names = target.worker.spec.names
    with Client(peers["b"].target, token=TOKEN) as b:  # b pulled them into its host tier while the request waited
        keys = target.offload_keys(PROMPT)
        until(lambda: b.lookup(keys, pool_ids=[names.pool_id(0)], namespace=names.namespace(None)).tiers[:2] ==
              [TierKind.HOST] * 2, "the router's fetch pulled a's blocks")
    reports = target.run({"turn"})
    assert target.outputs["turn"] == [target.expected_token(PROMPT + [900])]  # never a wrong token
    assert sum(r.external_hits.get("turn", 0) for r in reports) == 32  # the 2 blocks a held; the rest computed
    assert torch.equal(target.block_bytes(target.block_tables["turn"][:2]), held)
    traced = [line for line in peers["b"].log_text().splitlines() if "route-7" in line]  # (debug: taken whole)
    assert traced and "taken" in traced[0]
