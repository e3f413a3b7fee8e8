"""The local lane (kvxfer.client.lane_client, service/lane_server.py) against real daemons: the same answers as
gRPC, bit-exact bytes, its bounds, and every malformed message answered with a precise status while the daemon
serves on."""

import os
import signal
import socket
import time
import urllib.request

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.client import Client
from kvxfer.client import lane_client as lane
from kvxfer.core.errors import DeadlineExceeded, InvalidArgument, Unauthenticated, Unavailable
from kvxfer.core.records import Outcome, TierKind
from kvxfer.v1 import kvxfer_pb2 as pb
from tests.e2e.redis_server import free_port

pytestmark = pytest.mark.e2e


def _connect(daemon, token: bytes = b"") -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(20)
    conn.connect(daemon.socket + lane.SUFFIX)
    conn.send(lane.HEADER.pack(lane.Method.AUTH, 0) + token)
    assert conn.recv(1024) == b"\x00"
    return conn


def _ask(conn: socket.socket, message: bytes) -> tuple[str, bytes]:
    conn.send(message)
    answer = conn.recv(1 << 20)
    return lane.CODES[answer[0]], answer[1:]


def _lane_calls(port: int) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20).read().decode()
    calls = {}
    for line in text.splitlines():
        if line.startswith("kvxfer_lane_handled_total{"):
            labels, value = line[len("kvxfer_lane_handled_total{"):].split("} ")
            parts = dict(p.split("=") for p in labels.split(","))
            calls[parts["method"].strip('"'), parts["code"].strip('"')] = float(value)
    return calls


def _grpc_handled(port: int, method: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("grpc_server_handled_total{") and f'grpc_method="{method}"' in line)


def test_the_lane_answers_as_grpc_does_and_moves_the_same_bytes(make_daemon):
    port = free_port()
    daemon = make_daemon({"metrics_listen": f"127.0.0.1:{port}"})
    with Client(daemon.target, namespace="lane") as fast, Client(daemon.target, namespace="lane", lane=False) as slow:
        pool = fast.map_pool()
        pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, dtype=torch.uint8))
        keys = fast.block_keys(list(range(16 * 8)), block_size=16)
        size = pool.layout.block_bytes  # BLHNC: block b is one span

        def block(b: int) -> torch.Tensor:
            return pool.storage[b * size:(b + 1) * size]

        expected = [block(b).clone() for b in range(1, 9)]
        stored = fast.offload(list(zip(range(1, 9), keys)))
        assert stored.outcomes == [Outcome.DONE] * 8 and stored.bytes == 8 * pool.layout.block_bytes
        assert fast.lookup(keys).hits == slow.lookup(keys).hits == 8
        assert fast.lookup(keys).tiers == slow.lookup(keys).tiers == [TierKind.HOST] * 8
        again = fast.offload(list(zip(range(1, 9), keys)), partial=True)
        assert again.outcomes == slow.offload(list(zip(range(1, 9), keys)), partial=True).outcomes
        restored = fast.restore(list(zip(keys, range(20, 28))))
        assert restored.outcomes == [Outcome.DONE] * 8
        for i, b in enumerate(range(20, 28)):
            assert torch.equal(block(b), expected[i])
        # Errors carry the same codes and messages either way.
        for client in (fast, slow):
            with pytest.raises(InvalidArgument, match="same length"):
                client._call(client._stub.Offload, pb.OffloadRequest(pool=client._ref(None), namespace="lane",
                                                                     slots=[1, 2], keys=keys[:1]))
        # An asynchronous job submitted over the lane is collected over gRPC.
        job = fast.submit_restore(list(zip(keys[:2], [40, 41])))
        done = fast.wait_jobs([job], wait_s=20, wait_all=True)
        assert done[job].outcomes == [Outcome.DONE] * 2
    calls = _lane_calls(port)
    assert calls[("Offload", "OK")] >= 2 and calls[("Restore", "OK")] >= 2 and calls[("Lookup", "OK")] >= 2
    assert calls[("Offload", "INVALID_ARGUMENT")] == 1
    assert _grpc_handled(port, "Offload") == 2  # the gRPC-only client's two
    assert _grpc_handled(port, "Restore") == 0


def test_a_request_too_large_for_the_lane_goes_over_grpc(make_daemon):
    port = free_port()
    daemon = make_daemon({"metrics_listen": f"127.0.0.1:{port}"})
    with Client(daemon.target, namespace="big") as client:
        keys = [bytes([i % 256]) * 60 + i.to_bytes(4, "little") for i in range(3000)]  # about 200 KB of keys
        result = client.lookup(keys)
        assert result.hits == 0
    assert _grpc_handled(port, "Lookup") == 1
    assert ("Lookup", "OK") not in _lane_calls(port)


def test_malformed_messages_get_a_precise_status_and_the_connection_serves_on(make_daemon):
    daemon = make_daemon()
    with Client(daemon.target, namespace="m") as client:
        ref = client._ref(None)
    conn = _connect(daemon)
    header = lane.HEADER.pack
    cases = [
        (b"\x01", "INVALID_ARGUMENT", "starts with its method"),
        (header(9, 0), "INVALID_ARGUMENT", "method 9"),
        (header(lane.Method.AUTH, 0), "INVALID_ARGUMENT", "method 0"),
        (header(lane.Method.OFFLOAD, 0) + b"\xff\xff\xff", "INVALID_ARGUMENT", "not a valid kvxfer.v1.OffloadRequest"),
        (header(lane.Method.OFFLOAD, 0) + b"x" * (lane.MAX_MESSAGE + 10), "INVALID_ARGUMENT", "at most"),
        (header(lane.Method.RESTORE, 0) + pb.RestoreRequest(pool=ref, namespace="m", keys=[b"k"], slots=[10 ** 6])
         .SerializeToString(), "INVALID_ARGUMENT", "slot"),
        (header(lane.Method.LOOKUP, 0) + pb.LookupRequest(namespace="m", keys=[b"k"]).SerializeToString(),
         "INVALID_ARGUMENT", "at least one pool"),
        (header(lane.Method.OFFLOAD, 0) + pb.OffloadRequest(pool=pb.PoolRef(pool_id="nope"), namespace="m")
         .SerializeToString(), "FAILED_PRECONDITION", "unknown pool"),
    ]
    for message, code, text in cases:
        got, details = _ask(conn, message)
        assert (got, text in details.decode()) == (code, True), (message[:16], got, details)
    got, body = _ask(conn, header(lane.Method.LOOKUP, 0) + pb.LookupRequest(pools=[ref], namespace="m",
                                                                            keys=[b"k"]).SerializeToString())
    assert got == "OK" and pb.LookupResponse.FromString(body).hits == 0
    huge = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # a first message too large is no AUTH
    huge.settimeout(20)
    huge.connect(daemon.socket + lane.SUFFIX)
    huge.send(lane.HEADER.pack(lane.Method.AUTH, 0) + bytes(lane.MAX_MESSAGE))
    assert lane.CODES[huge.recv(1024)[0]] == "INVALID_ARGUMENT" and huge.recv(1024) == b""
    assert "Traceback" not in daemon.log_text()


@settings(max_examples=80, deadline=None)
@given(message=st.binary(min_size=1, max_size=300))
def test_any_bytes_get_a_status_and_never_a_crash(daemon, message):
    conn = _connect(daemon)
    try:
        code, _ = _ask(conn, message)
    finally:
        conn.close()
    assert code not in ("INTERNAL", "UNKNOWN")
    assert daemon.proc.poll() is None


def test_a_connection_must_authenticate_first_and_a_wrong_token_is_refused(make_daemon, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    daemon = make_daemon({"token_file": str(token_file)})
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(20)
    conn.connect(daemon.socket + lane.SUFFIX)
    conn.send(lane.HEADER.pack(lane.Method.LOOKUP, 0))  # no AUTH first
    assert lane.CODES[conn.recv(1024)[0]] == "INVALID_ARGUMENT"
    assert conn.recv(1024) == b""  # and closed
    with pytest.raises(Unauthenticated):
        Client(daemon.target, namespace="t", token="wrong").lookup([b"k"], pool_ids=["rank0"])
    with Client(daemon.target, namespace="t", token="s3cret") as client:
        assert client.lookup([b"k"]).hits == 0
        assert client._lane._idle  # the call went over the lane, whose connection it keeps


def test_connections_are_bounded_per_uid_and_a_full_lane_sends_clients_to_grpc(make_daemon):
    port = free_port()
    daemon = make_daemon({"max_concurrent_rpcs": 4, "metrics_listen": f"127.0.0.1:{port}"})  # 2 for one uid
    held = [_connect(daemon), _connect(daemon)]
    refused = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    refused.settimeout(20)
    refused.connect(daemon.socket + lane.SUFFIX)
    answer = refused.recv(1024)
    assert lane.CODES[answer[0]] == "RESOURCE_EXHAUSTED" and b"at most 2" in answer
    with Client(daemon.target, namespace="full") as client:
        assert client.lookup([b"k"]).hits == 0  # over gRPC
        assert client.health() == "SERVING"
    assert _grpc_handled(port, "Lookup") == 1
    for conn in held:
        conn.close()


def test_a_stopped_daemon_is_unavailable_and_a_restarted_one_is_reached_again(make_daemon):
    daemon = make_daemon()
    client = Client(daemon.target, namespace="r", timeout=5)
    keys = client.block_keys(list(range(16)), block_size=16)
    client.offload([(1, keys[0])])
    daemon.stop()
    with pytest.raises((Unavailable, DeadlineExceeded)):
        client.lookup(keys)
    client.close()
    restarted = make_daemon({"socket": daemon.socket})
    with Client(restarted.target, namespace="r") as again:
        assert again.lookup(keys).hits == 0  # a fresh daemon, reached over a fresh lane
        assert again._lane._idle


def test_every_call_ends_by_its_deadline_whichever_way_it_goes(make_daemon):
    """A stopped daemon (SIGSTOP): a new lane connection's handshake gets no answer, and the gRPC call after it gets
    what is left of the call's deadline, not a deadline of its own (a 2 s call took 1 s + 2 s before)."""
    daemon = make_daemon()
    offloader, looker = (Client(daemon.target, namespace="r", pool_id="rank0", timeout=2) for _ in range(2))
    for client in (offloader, looker):
        client.pool_info()  # the pool's epoch, learnt before the stop (over gRPC: no lane connection yet)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert offloader.offload([(1, b"k")], best_effort=True) is None
        offload_s = time.monotonic() - start
        start = time.monotonic()
        with pytest.raises((Unavailable, DeadlineExceeded)):
            looker.lookup([b"k"])
        lookup_s = time.monotonic() - start
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        offloader.close()
        looker.close()
    assert offload_s < 2 + 0.8 and lookup_s < 2 + 0.8, (offload_s, lookup_s)  # the deadline, and room for a busy CI
