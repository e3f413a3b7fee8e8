"""The descriptor socket and registered files under attack (issue 26, items 1, 3, 4), against real daemons."""

import fcntl
import os
import socket
import time

import pytest
import torch

from kvxfer.client import Client, fdpass
from kvxfer.core.c_modules import ENV_DISABLE
from kvxfer.core.errors import InvalidArgument, Unauthenticated
from kvxfer.core.records import Medium, Outcome
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import PoolHandle

pytestmark = pytest.mark.e2e
SPEC = KVSpec(2, 16, 4, 2, 8, torch.float16)


def test_the_descriptor_socket_asks_for_the_token_the_grpc_socket_asks_for(make_daemon, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    daemon = make_daemon({"token_file": str(token)})
    path = fdpass.socket_path_for(daemon.target)
    with Client(daemon.target, token="s3cret-token") as client:
        epoch = client.pool_info("rank0").epoch
        for wrong in (None, "guess"):  # a pool's memory is not handed out without the credential
            with pytest.raises(Unauthenticated, match="token"):
                fdpass.receive_pool(path, "rank0", epoch, wrong)
            with pytest.raises(Unauthenticated):
                fdpass.hand_over(path, None, wrong)
        pool = client.map_pool("rank0")  # the client presents it on both sockets
        pool.views()[0][0][3].fill_(7)
        assert client.offload([(3, b"k")], pool_id="rank0").outcomes == [Outcome.DONE]
        engine = daemon.shm_dir / "engine"
        engine.write_bytes(bytes(SPEC.nbytes))
        client.register_pool("eng", SPEC, Layout.parse("BLHNC"), PoolHandle(Medium.SHM, str(engine)))


def test_silent_connections_never_stop_another_clients_hand_off(make_daemon):
    daemon = make_daemon()
    path = fdpass.socket_path_for(daemon.target)
    silent = []
    try:
        for _ in range(200):  # more than any backlog of old; none of them ever sends
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                pass
            silent.append(s)
        with Client(daemon.target) as client:
            for _ in range(5):
                start = time.monotonic()
                pool = client.map_pool("rank0")
                assert time.monotonic() - start < 60  # a hang guard: served one at a time, 200 silent ones cost 400 s
                client._mapped.clear()  # map again: a fresh hand-off each time
                pool.close()
            assert client.health() == "SERVING"
    finally:
        for s in silent:
            s.close()


@pytest.mark.parametrize("c_loop", [True, False])
def test_a_registered_file_in_append_mode_is_refused_and_never_grows(make_daemon, monkeypatch, c_loop):
    """Switched to O_APPEND after registering: with the C loop, the daemon maps the file (guarded copies)
    and its restores land in place; without it, it copies through the descriptor and refuses them (each
    pwrite would land at the end). Either way the file never grows."""
    if not c_loop:
        monkeypatch.setenv(ENV_DISABLE, "0")  # the daemon inherits it
    daemon = make_daemon()
    engine = daemon.shm_dir / "engine"
    engine.write_bytes(bytes(SPEC.nbytes))
    with Client(daemon.target, "append") as client:
        appending = os.open(engine, os.O_RDWR | os.O_APPEND)
        with pytest.raises(InvalidArgument, match="O_APPEND"):
            client.register_pool("eng", SPEC, Layout.parse("BLHNC"), PoolHandle(Medium.SHM, str(engine)),
                                 fd=appending)
        os.close(appending)
        fd = os.open(engine, os.O_RDWR)
        client.register_pool("eng", SPEC, Layout.parse("BLHNC"), PoolHandle(Medium.SHM, str(engine)), fd=fd)
        assert client.offload([(1, b"a")], pool_id="eng").outcomes == [Outcome.DONE]
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)  # the shared description
        for slot in (2, 3, 4):
            outcome = Outcome.DONE if c_loop else Outcome.FAILED
            assert client.restore([(b"a", slot)], pool_id="eng", partial=True).outcomes == [outcome]
        assert engine.stat().st_size == SPEC.nbytes  # never a byte at the end
        assert client.health() == "SERVING"
        os.close(fd)


REGISTER_ELSEWHERE = """
import os, sys
from kvxfer.client import Client
from kvxfer.core.errors import KvxferError
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import PoolHandle
from kvxfer.core.records import Medium
import torch
spec = KVSpec(2, 16, 4, 2, 8, torch.float16)
theirs = os.open(sys.argv[2], os.O_RDWR)
own = os.memfd_create("own")
os.ftruncate(own, spec.nbytes)
with Client(sys.argv[1]) as client:
    for what, pool_id, fd in (("their memory", "other", theirs), ("their pool id", "eng", own)):
        try:
            client.register_pool(pool_id, spec, Layout.parse("BLHNC"), PoolHandle(Medium.SHM), fd=fd)
            print(what, "OK")
        except KvxferError as exc:
            print(what, exc.code)
"""


def test_a_registration_whose_answer_was_lost_is_replaced_by_its_registrant_only(make_daemon):
    """A registration can succeed at the daemon after the engine's deadline: the engine never got the
    token, and registering again must not find its own memory "already served" for ever."""
    import subprocess

    from tests.conftest import PYTHON, python_env

    daemon = make_daemon()
    engine = daemon.shm_dir / "engine"
    engine.write_bytes(bytes(SPEC.nbytes))
    fd = os.open(engine, os.O_RDWR)
    lost = Client(daemon.target, "lost")  # registers, and its answer is "lost" (never used again)
    first = lost.register_pool("eng", SPEC, Layout.parse("BLHNC"), PoolHandle(Medium.SHM), fd=fd)
    with Client(daemon.target, "retry") as client:  # the same process tries again
        again = client.register_pool("eng", SPEC, Layout.parse("BLHNC"), PoolHandle(Medium.SHM), fd=fd)
        assert again.epoch != first.epoch
        assert client.offload([(1, b"a")], pool_id="eng").outcomes == [Outcome.DONE]
        with pytest.raises(Exception, match="registered by another client|stale epoch"):
            lost.unregister_pool("eng")  # the lost registration's token is dead
        other = subprocess.run([PYTHON, "-c", REGISTER_ELSEWHERE, daemon.target, str(engine)], env=python_env(),
                               capture_output=True, text=True, timeout=60)
        assert other.stdout.split("\n")[:2] == ["their memory PERMISSION_DENIED", "their pool id ALREADY_EXISTS"], \
            other.stdout + other.stderr
        client.unregister_pool("eng")
    lost.close()
    os.close(fd)
