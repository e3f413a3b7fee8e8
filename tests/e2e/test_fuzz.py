"""A property test of the whole RPC surface against a running daemon.

Hypothesis builds every request field by field (out-of-range numbers, long and
newline-ended names, invalid UTF-8, long repeated fields, made-up tokens) and
sends the bytes as they are. Every answer must be a proper status, never INTERNAL
or UNKNOWN; afterwards the pool's bytes and the reference keys' Lookup are as before.
Every block of the pool holds the same bytes, so that even a well-formed request
that moves blocks cannot change them: only corruption could.
"""

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.client import Client
from kvxfer.v1 import kvxfer_pb2 as pb
from tests.e2e.conftest import SMALL_POOL, start_daemon

pytestmark = pytest.mark.e2e
ALLOWED = {"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED",
           "ALREADY_EXISTS"}
U32, U64 = 2**32 - 1, 2**64 - 1


@pytest.fixture(scope="module")
def target():
    daemon = start_daemon({"pools": [{**SMALL_POOL, "host_capacity_mib": 128},
                                     {**SMALL_POOL, "id": "lbhnc", "layout": "LBHNC", "host_capacity_mib": 128}],
                           "log_level": "warning", "max_batch_blocks": 4096})
    with Client(daemon.target, "ref") as client:
        block_bytes = client.pool_info("rank0").pool_layout.block_bytes
        block = torch.randint(0, 255, (block_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        pools = {}
        for pool_id in ("rank0", "lbhnc"):
            pool = client.map_pool(pool_id)
            storage = pool.storage.view(-1)
            storage.copy_(block.repeat(storage.numel() // block.numel()))  # every block the same bytes
            pools[pool_id] = storage
        keys = client.block_keys(list(range(64)), 16)
        for pool_id in pools:
            client.offload([(1 + i, k) for i, k in enumerate(keys)], pool_id=pool_id)
        epochs = {p: client.pool_info(p).epoch for p in pools}
        snapshot = {p: s.clone() for p, s in pools.items()}
        yield daemon, client, epochs, keys
        for pool_id, storage in pools.items():
            assert torch.equal(storage, snapshot[pool_id]), f"pool {pool_id} bytes changed"
            assert client.lookup(keys, pool_ids=[pool_id]).hits == 4
        assert client.health() == "SERVING"
    daemon.cleanup()


def _names(good: str):
    return st.one_of(st.just(good), st.just(good), st.just(good), st.just(""), st.just(good + "\n"), st.text(max_size=20),
                     st.text(alphabet="ab", min_size=200, max_size=300), st.just("x" * 70_000))


def _ref(epochs):
    return st.builds(lambda p, e: pb.PoolRef(pool_id=p, epoch=e),
                     st.one_of(st.sampled_from(sorted(epochs)), _names("rank0")),
                     st.one_of(st.sampled_from(sorted(epochs.values())), st.integers(0, U64)))


def _keys():
    return st.lists(st.one_of(st.binary(max_size=300), st.binary(min_size=1, max_size=8)), max_size=40)


def _slots():
    return st.one_of(st.lists(st.integers(0, 70), max_size=40), st.lists(st.integers(0, U32), max_size=10),
                     st.lists(st.integers(1, 63), min_size=5000, max_size=5000))


def _transfer(cls, epochs):
    return st.builds(lambda ref, ns, slots, keys, wait, lease, cid: cls(
        pool=ref, namespace=ns, slots=slots, keys=keys, lease_ms=lease, client_id=cid,
        **({} if wait is None else {"wait": wait})),
        _ref(epochs), _names("fuzz"), _slots(), _keys(), st.sampled_from([None, True, False]),
        st.integers(0, U32), _names("fuzzer"))


def requests(epochs):
    spec = st.builds(lambda v: pb.KVSpec(num_layers=v[0], num_blocks=v[1], block_size=v[2], num_kv_heads=v[3],
                                         head_size=v[4], dtype=v[5]),
                     st.tuples(*[st.integers(0, U32)] * 5, st.sampled_from(["float16", "bf", "", "float32"])))
    handle = st.builds(lambda m, path, off: pb.PoolHandle(medium=m, path=path, offset=off),
                       st.integers(0, 5), st.sampled_from(["", "/dev/shm", "/etc/passwd", "\x00", "a" * 5000]),
                       st.integers(0, U64))
    return st.one_of(
        st.tuples(st.just("Offload"), _transfer(pb.OffloadRequest, epochs)),
        st.tuples(st.just("Restore"), _transfer(pb.RestoreRequest, epochs)),
        st.tuples(st.just("Lookup"), st.builds(lambda refs, ns, keys: pb.LookupRequest(pools=refs, namespace=ns,
                                                                                       keys=keys),
                                               st.lists(_ref(epochs), max_size=12), _names("fuzz"), _keys())),
        st.tuples(st.just("Delete"), st.builds(lambda ref, ns, keys: pb.DeleteRequest(pool=ref, namespace=ns,
                                                                                      keys=keys),
                                               _ref(epochs), _names("fuzz"), _keys())),
        st.tuples(st.just("WaitJobs"), st.builds(lambda ref, cid, ids, t, a: pb.WaitJobsRequest(
            pool=ref, client_id=cid, job_ids=ids, timeout_ms=t, wait_all=a),
            _ref(epochs), _names("fuzzer"), st.lists(st.integers(0, U64), max_size=300), st.integers(0, 50),
            st.booleans())),
        st.tuples(st.just("GetPoolInfo"), st.builds(lambda p: pb.GetPoolInfoRequest(pool_id=p), _names("rank0"))),
        st.tuples(st.just("Stats"), st.builds(lambda p: pb.StatsRequest(pool_id=p), _names("rank0"))),
        st.tuples(st.just("RegisterPool"), st.builds(
            lambda p, s, lay, h, cap, g, tok: pb.RegisterPoolRequest(pool_id=p, spec=s, layout=lay, handle=h,
                                                                     host_capacity_mib=cap, cache_group=g,
                                                                     registration_token=tok),
            _names("fz"), spec, st.sampled_from(["BLHNC", "B,L,KV,N,H,D", "", "Q" * 300]), handle,
            st.integers(0, U64), _names("rank0"), st.binary(max_size=20))),
        st.tuples(st.just("UnregisterPool"), st.builds(
            lambda ref, ms, tok: pb.UnregisterPoolRequest(pool=ref, drain_timeout_ms=ms, registration_token=tok),
            _ref(epochs), st.integers(0, 100), st.binary(max_size=20))),
    )


#: Field number of the first string field of each request: where invalid UTF-8 goes.
STRING_FIELD = {"Offload": 2, "Restore": 2, "Lookup": 2, "Delete": 2, "WaitJobs": 2, "GetPoolInfo": 1, "Stats": 1,
                "RegisterPool": 1, "UnregisterPool": None}


def test_any_request_gets_a_proper_status_and_changes_nothing(target):
    daemon, _, epochs, _ = target
    channel = grpc.insecure_channel(daemon.target, options=[("grpc.max_send_message_length", 64 << 20)])
    seen: dict[str, int] = {}

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=requests(epochs), utf8=st.sampled_from([False, False, False, True]))
    def check(request, utf8):
        method, message = request
        data = message.SerializeToString()
        field = STRING_FIELD[method]
        if utf8 and field is not None:  # a later occurrence of a string field wins: make it invalid UTF-8
            data += bytes([field << 3 | 2, 3]) + b"\xff\xfe\xfd"
        call = channel.unary_unary(f"/kvxfer.v1.KVTransfer/{method}", request_serializer=None,
                                   response_deserializer=None)
        try:
            call(data, timeout=30)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
            assert "Traceback" not in (exc.details() or ""), exc.details()
            assert len(exc.details() or "") < 600
        assert code in ALLOWED, (method, code, message)
        seen[f"{method}:{code}"] = seen.get(f"{method}:{code}", 0) + 1

    check()
    channel.close()
    print(sorted(seen.items()))
    assert any(k.endswith(":OK") for k in seen) and any(k.endswith(":INVALID_ARGUMENT") for k in seen)


def test_any_descriptor_request_gets_a_proper_answer_and_changes_nothing(target, tmp_path):
    """The descriptor socket (``<socket>.fd``): any message, with none or one descriptor of any kind."""
    import os
    import socket

    from kvxfer.client import fdpass

    daemon, client, epochs, _ = target
    path = fdpass.socket_path_for(daemon.target)
    regular = tmp_path / "file"
    regular.write_bytes(bytes(4096))
    os.mkfifo(tmp_path / "fifo")
    kinds = {"none": lambda: None, "file": lambda: os.open(regular, os.O_RDWR),
             "read-only": lambda: os.open(regular, os.O_RDONLY),
             "append": lambda: os.open(regular, os.O_RDWR | os.O_APPEND),
             "fifo": lambda: os.open(tmp_path / "fifo", os.O_RDWR | os.O_NONBLOCK),
             "dir": lambda: os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), "socket": lambda: socket.socket().detach(),
             "memfd": lambda: os.memfd_create("fz")}
    messages = st.one_of(st.binary(max_size=600), st.sampled_from([b"REGISTER", b"MAP rank0", b"MAP rank0 x"]),
                         st.builds(lambda p, e: b"MAP %s %d" % (p, e), st.sampled_from([b"rank0", b"lbhnc", b"zz"]),
                                   st.sampled_from([epochs["rank0"], 0, 2**63])),
                         st.builds(lambda t, m: b"AUTH " + t + b"\n" + m, st.binary(max_size=40),
                                   st.sampled_from([b"REGISTER", b"MAP"])))
    answers: dict[str, int] = {}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(message=messages, kind=st.sampled_from(sorted(kinds)))
    def check(message, kind):
        fd = kinds[kind]()
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(5)
            sock.connect(path)
            try:
                socket.send_fds(sock, [message or b" "], [] if fd is None else [fd])
            finally:
                if fd is not None:
                    os.close(fd)
            answer, fds, _, _ = socket.recv_fds(sock, fdpass.MAX_MESSAGE, 1)
        for received in fds:
            os.close(received)
        assert answer.startswith((b"OK", b"ERR ")) and b"Traceback" not in answer, answer
        code = answer.split()[1].decode() if answer.startswith(b"ERR ") else "OK"
        assert code in ALLOWED | {"UNAUTHENTICATED"}, (message, kind, answer)
        answers[code] = answers.get(code, 0) + 1

    check()
    assert client.health() == "SERVING" and daemon.proc.poll() is None
    assert answers.get("OK") and answers.get("INVALID_ARGUMENT"), answers
