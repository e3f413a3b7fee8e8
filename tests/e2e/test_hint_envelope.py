"""A router's hint envelope through a real daemon's Hint RPC (over the local lane, over gRPC, and from
``kvxfer hint --envelope``): each action kvxfer understands does what its hint does, within the same bounds;
every action it cannot take (unknown type or version, malformed, oversized, an unknown peer, blocks none of
the request's) is counted by reason and logged with the envelope's ids, never an error; what is no envelope
at all gets INVALID_ARGUMENT and changes nothing."""

import json
import subprocess
import time

import pytest

from kvxfer.client import Client
from kvxfer.core.envelope import event_hash
from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import HintAction, TierKind
from kvxfer.events.event_records import EventKind, HintTrace
from kvxfer.v1 import kvxfer_pb2 as pb
from tests.conftest import PYTHON, ROOT, python_env
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.redis_server import free_port
from tests.e2e.test_hints import _fill, _metric, _settled, _until_host, _where

KEYS = [b"k%03d" % i for i in range(128)]


def act(action_type: str, payload: dict, action_id: str, version: str = "1.0") -> dict:
    return {"action_id": action_id, "action_type": action_type, "action_version": version, "payload": payload}


def envelope(*actions: dict, message_id: str = "msg-1") -> dict:
    return {"protocol_version": "0.1", "message_id": message_id, "actions": list(actions)}


def outcome(port: int, action: str, result: str) -> float:
    return _metric(port, "kvxfer_hint_envelope_actions_total", f'action="{action}",outcome="{result}"')


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_retain_and_release_by_scope_and_by_block_hash_and_what_is_set_aside(make_daemon, lane):
    port = free_port()
    daemon = make_daemon({"metrics_listen": f"127.0.0.1:{port}"})
    with Client(daemon.target, "app", pool_id="rank0", lane=lane) as c:
        _fill(c, KEYS)  # the host tier is full: k000 is the least recently used
        request = KEYS[:16] + KEYS[100:]  # the request's blocks: what 64-bit block hashes are matched against
        c.hint_envelope(envelope(
            act("kv.retain", {"ttl_s": 600, "block_hashes": [event_hash(k, False) for k in KEYS[:16]]}, "keep"),
            act("kv.release", {"block_hashes": [event_hash(k, vllm_keys=False) for k in KEYS[100:]]}, "by-hash"),
            act("kv.release", {"block_hashes": [k.hex() for k in KEYS[100:]]}, "by-key"),
            act("kv.pin", {"ttl_s": 5}, "pin"), act("kv.retain", {"ttl_s": 5}, "v2", version="2.0"),
            act("kv.retain", {"ttl_s": 10 ** 9}, "too-long"),
            act("kv.retain", {"ttl_s": 5, "block_hashes": list(range(70_000))}, "too-many"),
            act("kv.fetch", {"source_control_endpoint": "tcp://10.0.0.9:5555", "block_hashes": [1]}, "stranger"),
            act("kv.release", {"block_hashes": [424242]}, "none-of-mine")), request)
        _fill(c, [b"n%03d" % i for i in range(48)])  # 48 more: 28 released go, then 20 by LRU past the retained
        assert _where(c, KEYS[:16]) == [TierKind.HOST] * 16
        assert _where(c, KEYS[16:36]) == [None] * 20
        assert _where(c, KEYS[100:]) == [None] * 28
    assert outcome(port, "kv.retain", "taken") == 1 and outcome(port, "kv.release", "taken") == 2
    for action, reason in (("other", "unknown_type"), ("kv.retain", "unknown_version"), ("kv.retain", "malformed"),
                           ("kv.retain", "oversized"), ("kv.fetch", "unknown_peer"), ("kv.release", "unresolved")):
        assert outcome(port, action, reason) == 1, (action, reason)
    assert _metric(port, "kvxfer_hint_envelopes_total", "") == 1
    assert _metric(port, "kvxfer_hints_total", 'action="envelope",cache_group="rank0"') == 1
    log = daemon.log_text()
    assert "msg-1" in log and "stranger" in log and "unknown_peer" in log  # the router's ids, to trace it
    assert "10.0.0.9" not in [line for line in log.splitlines() if "peer connected" in line]  # never dialled


def test_prefetch_by_block_hash_brings_the_blocks_up_and_retains_them(make_daemon, tmp_path):
    port = free_port()
    disk = {"path": str(tmp_path / "disk"), "capacity_mib": 4}
    daemon = make_daemon({"pools": [{**SMALL_POOL, "host_capacity_mib": 0.5}], "disk": disk,  # 32 host blocks
                          "metrics_listen": f"127.0.0.1:{port}"})
    with Client(daemon.target, "app", pool_id="rank0") as c:
        keys = KEYS[:64]
        _fill(c, keys)  # k000-k031 went down to disk
        _settled(c, 32)
        wanted = keys[:8]
        c.hint_envelope(envelope(act("kv.prefetch", {"block_hashes": [event_hash(k, False) for k in wanted],
                                                     "ttl_s": 600}, "warm")), keys[:32], request_id="req-7")
        _until_host(c, wanted)
        assert outcome(port, "kv.prefetch", "taken") == 1
        assert _metric(port, "kvxfer_tier_hinted_blocks", 'cache_group="rank0",state="retained",tier="host"') == 8
        assert _where(c, keys[8:32]) == [TierKind.DISK] * 24  # only what it named


def test_what_is_no_envelope_gets_invalid_argument_and_changes_nothing(make_daemon):
    port = free_port()
    daemon = make_daemon({"metrics_listen": f"127.0.0.1:{port}"})
    with Client(daemon.target, "app", pool_id="rank0") as c:
        _fill(c, KEYS)
        for data, words in ((b"{not json", "not JSON"), (b"[" * 50_000, "not JSON"), (b'{"actions": 5}', "list of"),
                            (b"x" * ((1 << 20) + 1), "at most")):
            with pytest.raises(InvalidArgument, match=words):
                c.hint_envelope(data, KEYS[:4])
        ref = c._ref("rank0")
        for fields, words in ((dict(action=pb.HINT_ACTION_ENVELOPE), "envelope"),
                              (dict(action=pb.HINT_ACTION_RELEASE, keys=KEYS[:1], envelope=b"{}"), "envelope"),
                              (dict(action=pb.HINT_ACTION_ENVELOPE, envelope=b"{}", ttl_s=5), "takes none")):
            with pytest.raises(InvalidArgument, match=words):
                c._call(c._stub.Hint, pb.HintRequest(pool=ref, namespace="app", **fields))
        with pytest.raises(InvalidArgument, match="namespace"):
            c.hint_envelope(envelope(act("kv.release", {}, "r")), KEYS[:4], namespace="bad namespace")
        with pytest.raises(InvalidArgument, match="not JSON"):  # (refused by the library, before sending)
            c.hint_envelope({"actions": [object()]}, KEYS[:4])
        with pytest.raises(InvalidArgument, match="request_id"):
            c.hint_envelope(envelope(), KEYS[:4], request_id=7)
        _fill(c, [b"n%03d" % i for i in range(8)])
        assert _where(c, KEYS[:8]) == [None] * 8 and _where(c, KEYS[8:16]) == [TierKind.HOST] * 8  # plain LRU
    assert _metric(port, "kvxfer_hint_envelopes_total", "") == 0


def test_a_flood_of_bad_envelopes_logs_a_few_lines_and_counts_them_all(make_daemon):
    port = free_port()
    daemon = make_daemon({"metrics_listen": f"127.0.0.1:{port}"})
    with Client(daemon.target, "app", pool_id="rank0") as c:
        for i in range(200):
            c.hint_envelope(envelope(act("kv.evict", {}, f"a{i}"), message_id=f"flood-{i}"), KEYS[:1])
    assert outcome(port, "other", "unknown_type") == 200
    deadline = time.monotonic() + 30
    while "flood-0" not in daemon.log_text():  # (the log is written as it goes)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert sum("flood-" in line for line in daemon.log_text().splitlines()) < 20  # rate-limited


def test_kvxfer_hint_envelope_sends_a_file_and_refuses_a_bad_one_in_one_line(make_daemon, tmp_path):
    port = free_port()
    daemon = make_daemon({"metrics_listen": f"127.0.0.1:{port}"})
    with Client(daemon.target, "app", pool_id="rank0") as c:
        _fill(c, KEYS)

    def hint(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PYTHON, "-m", "service.program", "hint", *args, "--target", daemon.target,
                               "--pool", "rank0", "--namespace", "app"],
                              env=python_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)

    good = tmp_path / "envelope.json"
    good.write_text(json.dumps(envelope(act("kv.release", {}, "bye"))))
    out = hint("--envelope", str(good), "--keys", *(k.hex() for k in KEYS[:8]))  # the scope of a release naming none
    assert out.returncode == 0 and "envelope: sent" in out.stdout, out.stderr
    assert outcome(port, "kv.release", "taken") == 1
    with Client(daemon.target, "app", pool_id="rank0") as c:
        _fill(c, [b"n%03d" % i for i in range(8)])
        assert _where(c, KEYS[:8]) == [None] * 8 and _where(c, KEYS[8:16]) == [TierKind.HOST] * 8  # released first
    (tmp_path / "bad.json").write_text("{oops")
    for args, words in ((("--envelope", str(tmp_path / "bad.json")), "not JSON"),
                        (("--envelope", str(tmp_path / "missing.json")), "missing.json"),
                        ((HintAction.ENVELOPE.value,), "--envelope"),
                        (("release", "--envelope", str(good)), "its own actions")):
        out = hint(*args)
        assert out.returncode == 2 and words in out.stderr and len(out.stderr.strip().splitlines()) == 1, out


def test_each_action_is_in_the_event_stream_with_the_routers_ids(make_daemon):
    daemon = make_daemon()
    with Client(daemon.target, "app", pool_id="rank0") as c:
        _fill(c, KEYS[:8])
        c.hint_envelope(envelope(act("kv.retain", {"ttl_s": 60}, "keep"), act("kv.pin", {}, "pin"),
                                 message_id="trace-me"), KEYS[:4])
        hinted = []
        for batch in c.watch_events(["app"], from_sequence=1, timeout=60):  # (ends once both are read)
            hinted += [e for e in batch.events if e.kind is EventKind.HINTED]
            if len(hinted) == 2:
                break
    by_id = {e.hint.action_id: e for e in hinted}
    assert by_id["keep"].hint == HintTrace("trace-me", "keep", "kv.retain", "taken")
    assert by_id["keep"].keys == tuple(KEYS[:4]) and by_id["keep"].tier is TierKind.HOST
    assert by_id["pin"].hint.outcome == "unknown_type" and by_id["pin"].keys == ()
