"""The hint envelope (vLLM's KvHintsEnvelope, KVCR's kv.fetch) read as kvxfer's actions: what is understood,
what is set aside and why, how block hashes name a request's keys; whatever JSON arrives, parsing either
refuses a non-envelope with InvalidArgument or sets actions aside, never anything else."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.core import envelope as env
from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import HintAction

HASH_A, HASH_B = bytes(range(32)), bytes(range(32, 64))
KEYS = [HASH_A + b"\0\0\0\0", HASH_B + b"\0\0\0\0", HASH_A + b"\0\0\0\1"]  # two blocks; A in two cache groups


def action(action_type: str, payload, version: str = "1.0", action_id: str = "a1") -> dict:
    return {"action_id": action_id, "action_type": action_type, "action_version": version, "payload": payload}


def envelope(*actions: dict, message_id: str = "m1") -> dict:
    return {"protocol_version": "0.1", "message_id": message_id, "actions": list(actions)}


def parse(*actions: dict) -> env.Envelope:
    return env.parse(envelope(*actions), max_ttl_s=3600, max_names=8)


def test_each_understood_action_and_its_hint():
    got = parse(action("kv.fetch", {"source_control_endpoint": "node-b", "block_hashes": [1, 2]}, action_id="f"),
                action("kv.prefetch", {"ttl_s": 30}, action_id="p"),
                action("kv.retain", {"ttl_s": 600, "block_hashes": [HASH_B.hex()]}, action_id="r"),
                action("kv.release", {}, version="1.2", action_id="x"))
    assert got.message_id == "m1" and got.set_aside == ()
    assert [(a.action_id, a.kind.hint, a.names, a.ttl_s, a.source) for a in got.actions] == [
        ("f", HintAction.PREFETCH, (1, 2), 0, "node-b"), ("p", HintAction.PREFETCH, None, 30, ""),
        ("r", HintAction.RETAIN, (HASH_B,), 600, ""), ("x", HintAction.RELEASE, None, 0, "")]
    # KVCR's field name, or the shorter one
    assert parse(action("kv.fetch", {"source_endpoint": "b", "block_hashes": [3]})).actions[0].source == "b"


@pytest.mark.parametrize("raw, reason", [
    (action("kv.pin", {"ttl_s": 5}), "unknown_type"),
    ("not an object", "unknown_type"),
    (action("kv.retain", {"ttl_s": 5}, version="2.0"), "unknown_version"),
    (action("kv.retain", {"ttl_s": 5}, version=None), "unknown_version"),
    (action("kv.retain", "payload"), "malformed"),
    (action("kv.retain", {}), "malformed"),  # a retain without its TTL
    (action("kv.retain", {"ttl_s": 3601}), "malformed"),  # past hints.max_ttl_s
    (action("kv.retain", {"ttl_s": True}), "malformed"),
    (action("kv.release", {"ttl_s": 5}), "malformed"),
    (action("kv.prefetch", {"ttl_s": -1}), "malformed"),
    (action("kv.fetch", {"block_hashes": [1]}), "malformed"),  # no source
    (action("kv.fetch", {"source_control_endpoint": "b"}), "malformed"),  # no blocks
    (action("kv.fetch", {"source_control_endpoint": "b", "block_hashes": [1], "mode": "move"}), "malformed"),
    (action("kv.fetch", {"source_control_endpoint": "", "block_hashes": [1]}), "malformed"),
    (action("kv.retain", {"ttl_s": 5, "block_hashes": [1 << 64]}), "malformed"),
    (action("kv.retain", {"ttl_s": 5, "block_hashes": [-1]}), "malformed"),
    (action("kv.retain", {"ttl_s": 5, "block_hashes": [True]}), "malformed"),
    (action("kv.retain", {"ttl_s": 5, "block_hashes": ["xyz0"]}), "malformed"),
    (action("kv.retain", {"ttl_s": 5, "block_hashes": "00ff"}), "malformed"),
    (action("kv.retain", {"ttl_s": 5, "block_hashes": list(range(9))}), "oversized"),
])
def test_an_action_kvxfer_cannot_take_is_set_aside_with_its_reason_and_the_others_still_count(raw, reason):
    got = parse(raw, action("kv.release", {}, action_id="ok"))
    assert [a.reason.value for a in got.set_aside] == [reason]
    assert [a.action_id for a in got.actions] == ["ok"]


def test_actions_past_the_bound_are_set_aside_as_oversized():
    got = parse(*(action("kv.release", {}, action_id=f"a{i}") for i in range(env.MAX_ACTIONS + 3)))
    assert len(got.actions) == env.MAX_ACTIONS
    assert [a.reason for a in got.set_aside] == [env.Reason.OVERSIZED] * 3


@pytest.mark.parametrize("raw", [None, [], "x", 5, {"actions": "all"}, {"message_id": "m"}])
def test_what_is_no_envelope_at_all_is_invalid(raw):
    with pytest.raises(InvalidArgument, match="list of actions"):
        env.parse(raw, 3600, 8)


def test_bytes_that_are_not_json_or_too_large_or_too_deep_are_invalid():
    with pytest.raises(InvalidArgument, match="not JSON"):
        env.loads(b"{not json")
    with pytest.raises(InvalidArgument, match="not JSON"):
        env.loads(b"[" * 100_000 + b"]" * 100_000)  # past what Python's decoder recurses
    with pytest.raises(InvalidArgument, match="at most"):
        env.loads(b" " * (env.MAX_ENVELOPE_BYTES + 1))


def test_ids_are_kept_printable_and_short_for_the_log():
    got = parse(action("kv.release", {}, action_id="x" * 500), action("kv.pin", {}, action_id="\x1b[31mred"))
    assert len(got.actions[0].action_id) <= 128 and got.set_aside[0].action_id.isprintable()
    assert got.set_aside[0].label == "other" and parse(action("kv.retain", {})).set_aside[0].label == "kv.retain"


def test_block_hashes_name_the_requests_keys_by_their_64_bit_event_hash_in_every_cache_group():
    low_a = int.from_bytes(HASH_A[-8:], "big")
    assert env.event_hash(KEYS[0], vllm_keys=True) == low_a == env.event_hash(KEYS[2], vllm_keys=True)
    assert env.resolve((low_a,), KEYS, vllm_keys=True) == [KEYS[0], KEYS[2]]  # the request's order
    assert env.resolve(None, KEYS, vllm_keys=True) == KEYS
    assert env.resolve(None, KEYS + KEYS[:1], vllm_keys=True) == KEYS  # a key named twice is one block
    assert env.resolve((12345,), KEYS, vllm_keys=True) == []  # none of the request's
    assert env.resolve((b"full-key",), KEYS, vllm_keys=True) == [b"full-key"]
    opaque = [b"key-one", b"key-two"]
    assert env.resolve((int.from_bytes(b"key-two", "big"),), opaque, vllm_keys=False) == [b"key-two"]


def test_the_store_hint_is_the_last_retention_of_the_requests_own_blocks():
    both = envelope(action("kv.retain", {"ttl_s": 60}), action("kv.release", {"block_hashes": [1]}))
    assert env.store_hint(both, 3600) == (HintAction.RETAIN, 60)  # (the release names other blocks)
    assert env.store_hint(envelope(action("kv.release", {})), 3600) == (HintAction.RELEASE, 0)
    assert env.store_hint(envelope(action("kv.fetch", {"source_endpoint": "b", "block_hashes": [1]})), 60) is None
    assert env.store_hint({"no": "envelope"}, 60) is None


JSON = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=4), max_leaves=20)
ACTIONS = st.fixed_dictionaries({"action_id": JSON, "action_type": st.sampled_from([*env.KNOWN, "kv.pin"]) | JSON,
                                 "action_version": st.sampled_from(["1.0", "1.1", "2.0"]) | JSON,
                                 "payload": st.dictionaries(st.sampled_from(
                                     ["ttl_s", "block_hashes", "source_endpoint", "mode", "no_retain"]),
                                     JSON | st.lists(st.integers(0, 1 << 64), max_size=4), max_size=4) | JSON})


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({"protocol_version": JSON, "message_id": JSON, "actions": st.lists(ACTIONS | JSON,
                                                                                                 max_size=6)}) | JSON)
def test_any_json_is_refused_whole_or_read_action_by_action(raw):
    data = json.dumps(raw).encode()
    try:
        got = env.parse(env.loads(data), 3600, 8)
    except InvalidArgument:
        return
    assert len(got.actions) + len(got.set_aside) == len(raw["actions"])
    for a in got.actions:
        assert a.names is None or 0 < len(a.names) <= 8 or a.kind is not env.Kind.FETCH
        assert 0 <= a.ttl_s <= 3600 and (a.kind is not env.Kind.FETCH or a.source)
        assert isinstance(a.action_id, str) and len(a.action_id) <= 130
