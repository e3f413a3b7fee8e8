"""The local lane's client side (kvxfer.client.lane_client) against a small SEQPACKET server in the test: when it
sends a call over gRPC instead, how it reads answers, and which connections it keeps."""

import os
import socket
import threading

import pytest

from kvxfer.client import lane_client as lane
from kvxfer.core.errors import DeadlineExceeded, FailedPrecondition, KvxferError, Unauthenticated, Unavailable
from kvxfer.v1 import kvxfer_pb2 as pb

LOOKUP = pb.LookupRequest(namespace="n", keys=[b"k"])


class Server:
    """Accepts lane connections; answers AUTH with ``auth``, then each call with ``answer(message)``
    (None: no answer, the connection left open; empty: the connection closed)."""

    def __init__(self, path: str, answer, auth: bytes = b"\x00") -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(path)
        self.sock.listen(8)
        self.answer, self.auth = answer, auth
        self.accepted, self.calls, self.conns = 0, [], []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._calls(conn)
        except OSError:  # the client closed its end first (it gave up on a call)
            pass

    def _calls(self, conn: socket.socket) -> None:
        conn.recv(1 << 20)
        conn.send(self.auth)
        while message := conn.recv(1 << 20):
            self.calls.append(message)
            answer = self.answer(message)
            if answer == b"":
                conn.close()
                return
            if answer is not None:
                conn.send(answer)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def close_all(self) -> None:
        """As a daemon that exits: the listener and every connection."""
        self.close()
        for conn in self.conns:
            conn.shutdown(socket.SHUT_RDWR)
            conn.close()


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "d.sock.lane")


def _ok_lookup(message: bytes) -> bytes:
    request = pb.LookupRequest.FromString(message[lane.HEADER.size:])
    return lane.encode_answer("OK", pb.LookupResponse(hits=len(request.keys)).SerializeToString())


def test_the_lane_socket_sits_beside_a_unix_target_only():
    assert lane.path_for("unix:/run/kvxfer/kvxfer.sock") == "/run/kvxfer/kvxfer.sock.lane"
    assert lane.path_for("unix:///tmp/k.sock") == "/tmp/k.sock.lane"
    assert lane.path_for("node-a:50051") is None


def test_calls_reuse_one_connection_and_carry_method_timeout_and_message(path):
    server = Server(path, _ok_lookup)
    client = lane.Lane(path)
    for _ in range(3):
        assert client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 2.5).hits == 1
    assert server.accepted == 1 and len(server.calls) == 3
    method, timeout_ms = lane.HEADER.unpack_from(server.calls[0])
    assert (method, timeout_ms) == (lane.Method.LOOKUP, 2500)
    assert pb.LookupRequest.FromString(server.calls[0][lane.HEADER.size:]) == LOOKUP
    client.close()
    server.close()


def test_a_status_becomes_its_error_and_the_connection_serves_on(path):
    server = Server(path, lambda m: lane.encode_answer("FAILED_PRECONDITION", b"stale epoch"))
    client = lane.Lane(path)
    for _ in range(2):
        with pytest.raises(FailedPrecondition, match="stale epoch"):
            client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 2.0)
    assert server.accepted == 1
    server.close()


def test_no_lane_or_a_request_too_large_goes_over_grpc_and_the_lane_rests(path, monkeypatch):
    client = lane.Lane(path)  # nothing listens there
    with pytest.raises(lane.NoLane):
        client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 1.0)
    tries = []
    monkeypatch.setattr(client, "_connect", lambda timeout: tries.append(timeout))
    with pytest.raises(lane.NoLane):
        client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 1.0)
    assert tries == []  # resting: not even a connect
    server = Server(path, _ok_lookup)
    big = pb.LookupRequest(namespace="n", keys=[i.to_bytes(4, "little") * 64 for i in range(1000)])
    with pytest.raises(lane.NoLane, match="too large"):
        lane.Lane(path).call(lane.Method.LOOKUP, big, pb.LookupResponse, 1.0)
    assert server.accepted == 0
    server.close()


def test_a_full_lane_is_no_lane_but_a_wrong_token_is_unauthenticated(path):
    server = Server(path, _ok_lookup, auth=lane.encode_answer("RESOURCE_EXHAUSTED", b"at most 2"))
    with pytest.raises(lane.NoLane, match="RESOURCE_EXHAUSTED"):
        lane.Lane(path).call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 1.0)
    server.auth = lane.encode_answer("UNAUTHENTICATED", b"missing or wrong token")
    with pytest.raises(Unauthenticated):
        lane.Lane(path, token="wrong").call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 1.0)
    server.close()


def test_an_answer_that_does_not_come_is_a_deadline_and_that_connection_is_dropped(path):
    answers = iter([None, _ok_lookup])
    server = Server(path, lambda m: (lambda f: f and f(m))(next(answers)))
    client = lane.Lane(path)
    with pytest.raises(DeadlineExceeded):
        client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 0.2)
    assert client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 2.0).hits == 1
    assert server.accepted == 2  # the late answer can never be read as the next call's
    server.close()


def test_a_daemon_gone_mid_call_is_unavailable(path):
    server = Server(path, lambda m: b"")  # closes the connection instead of answering
    client = lane.Lane(path)
    with pytest.raises(Unavailable, match="closed during a call"):
        client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 10.0)
    assert client._idle == []
    server.close()


def test_an_idle_connection_older_than_half_the_daemons_idle_bound_is_not_reused(path, monkeypatch):
    server = Server(path, _ok_lookup)
    client = lane.Lane(path)
    now = [1000.0]
    monkeypatch.setattr(lane.time, "monotonic", lambda: now[0])
    client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 2.0)
    now[0] += lane.IDLE_S / 2 - 1
    client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 2.0)
    assert server.accepted == 1
    now[0] += lane.IDLE_S / 2 + 1
    client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 2.0)
    assert server.accepted == 2
    server.close()


def test_idle_connections_a_restarted_daemon_closed_are_replaced_and_the_call_goes_through(path):
    first = Server(path, _ok_lookup)
    client = lane.Lane(path)
    threads = [threading.Thread(target=client.call, args=(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 5.0))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert client._idle
    first.close_all()  # the daemon goes away: its ends of every idle connection close
    os.unlink(path)
    second = Server(path, _ok_lookup)
    assert client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 5.0).hits == 1  # nothing was lost
    assert second.accepted == 1 and len(second.calls) == 1
    second.close()


def _waited(message: bytes) -> bytes:
    return b"\x00" + pb.WaitJobsResponse(unknown_job_ids=[7]).SerializeToString()


def test_a_call_left_in_flight_is_answered_when_the_server_answers(path):
    release = threading.Event()
    server = Server(path, lambda m: release.wait(30) and _waited(m))
    client = lane.Lane(path)
    call = client.send(lane.Method.WAIT_JOBS, pb.WaitJobsRequest(client_id="c"), pb.WaitJobsResponse, 30.0)
    assert not call.done() and not call.wait(0.05)  # nothing yet: and no thread waits for it
    release.set()
    assert call.wait(30)
    assert call.result().unknown_job_ids == [7] and call.result().unknown_job_ids == [7]  # read once, kept
    assert client._idle and not client._calls  # its connection serves the next call
    server.close()


def test_a_call_in_flight_past_its_deadline_is_a_deadline_and_a_closed_lane_cancels_calls(path):
    server = Server(path, lambda m: None)  # never answers
    client = lane.Lane(path)
    late = client.send(lane.Method.WAIT_JOBS, pb.WaitJobsRequest(client_id="c"), pb.WaitJobsResponse, 0.2)
    assert late.wait(30)  # its deadline came: done, and the result says why
    with pytest.raises(DeadlineExceeded):
        late.result()
    assert not client._idle  # that connection is out of step
    waiting = client.send(lane.Method.WAIT_JOBS, pb.WaitJobsRequest(client_id="c"), pb.WaitJobsResponse, 30.0)
    client.close()
    assert waiting.wait(0)
    with pytest.raises(KvxferError, match="cancelled"):
        waiting.result()
    server.close()


def test_wait_all_is_never_sent_over_the_lane(path):
    server = Server(path, _waited)
    stub = type("Stub", (), {"Offload": object(), "Restore": object(), "Lookup": object(), "WaitJobs": object(), "Hint": object()})
    client = lane.Lane(path, stub=stub)
    assert client.start(stub.WaitJobs, pb.WaitJobsRequest(client_id="c", job_ids=[1], wait_all=True), 5.0) is None
    many = pb.WaitJobsRequest(client_id="c", job_ids=range(lane.MAX_WAITED_IDS + 1))
    assert client.start(stub.WaitJobs, many, 5.0) is None  # its unknown ids might not fit an answer
    assert client.start(stub.WaitJobs, pb.WaitJobsRequest(client_id="c"), 5.0).result().unknown_job_ids == [7]
    assert len(server.calls) == 1
    server.close()


def test_an_answer_larger_than_the_lane_carries_is_never_parsed(path):
    # Cut short, a protobuf may still parse (as fewer outcomes): the client must see the cut.
    huge = b"\x00" + pb.LookupResponse(hits=1, tiers=[1] * lane.MAX_ANSWER).SerializeToString()
    server = Server(path, lambda m: huge)
    client = lane.Lane(path)
    with pytest.raises(Unavailable, match="larger than the lane carries"):
        client.call(lane.Method.LOOKUP, LOOKUP, pb.LookupResponse, 10.0)
    assert client._idle == []  # that connection is out of step
    server.close()
