"""Hostile clients the hardening tests run as processes of other Unix users.

``python -m tests.e2e.attacker --user NAME FUNCTION '[args...]'`` imports everything
as root, then drops to NAME (its groups included) before doing anything, and prints
the function's JSON result as its last line.
"""

import asyncio
import json
import os
import pwd
import socket
import sys
import threading

import grpc

from kvxfer.client import Client, fdpass
from kvxfer.core.errors import KvxferError
from kvxfer.core.records import Medium
from kvxfer.geometry.layout import Layout
from kvxfer.memory.pool import PoolHandle
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire.messages import spec_from_pb

SPEC = pb.KVSpec(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_size=8, dtype="float16")
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # L * KV * N * H * D * 2 bytes = 512
POOL_BYTES = 8 * BLOCK_BYTES


def _code(call) -> str:
    """The status name a call ends with ("OK" when it returns)."""
    try:
        call()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name
    except KvxferError as exc:
        return exc.code
    except OSError as exc:
        return f"OSError:{exc.errno}"


def _register(stub, pool_id: str, path: str, token: bytes, group: str = "") -> pb.RegisterPoolResponse:
    return stub.RegisterPool(pb.RegisterPoolRequest(
        pool_id=pool_id, spec=SPEC, layout="BLHNC", handle=pb.PoolHandle(medium=pb.MEDIUM_SHM, path=path),
        registration_token=token, cache_group=group, host_capacity_mib=1), timeout=10)


def _own_file(directory: str, name: str, fill: int) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(bytes([fill]) * POOL_BYTES)
    return path


def confused_deputy(target: str, secret: str, readable: str, own_dir: str) -> dict:
    """Every way of making the daemon serve memory this user cannot read and write."""
    fds = fdpass.socket_path_for(target)
    results = {}
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.KVTransferStub(channel)
        results["path_without_token"] = _code(lambda: _register(stub, "a1", secret, b""))
        results["made_up_token"] = _code(lambda: _register(stub, "a1", secret, os.urandom(16)))
        results["open_secret"] = _code(lambda: os.open(secret, os.O_RDWR))
        ro = os.open(readable, os.O_RDONLY)
        results["read_only_descriptor"] = _code(lambda: fdpass.hand_over(fds, ro))
        d = os.open(own_dir, os.O_RDONLY)
        results["directory_descriptor"] = _code(lambda: fdpass.hand_over(fds, d))
        info = stub.GetPoolInfo(pb.GetPoolInfoRequest(pool_id="rank0"), timeout=10).pools[0]
        served = fdpass.receive_pool(fds, "rank0", info.epoch)  # allowed: socket access is pool access
        results["served_pool_descriptor"] = _code(lambda: fdpass.hand_over(fds, served))
        own = os.open(_own_file(own_dir, "own", 1), os.O_RDWR)
        token = fdpass.hand_over(fds, own)
        results["own_file_named_as_secret"] = _code(lambda: _register(stub, "a1", secret, token))
        token = fdpass.hand_over(fds, own)
        results["own_file"] = _code(lambda: _register(stub, "a1", "", token))
        results["replayed_token"] = _code(lambda: _register(stub, "a2", "", token))
    return results


def link_race(target: str, secret: str, own_dir: str, tries: int) -> dict:
    """Swap a path between our file and a link to a secret file while registering through it."""
    fds = fdpass.socket_path_for(target)
    own = _own_file(own_dir, "race-own", 7)
    link = os.path.join(own_dir, "race-link")
    to_own, to_secret = link + ".own", link + ".secret"
    os.symlink(own, to_own)
    os.symlink(secret, to_secret)
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for prepared in (to_own, to_secret):
                os.link(prepared, link + ".tmp", follow_symlinks=False)
                os.replace(link + ".tmp", link)

    threading.Thread(target=swap, daemon=True).start()
    counts = {"registered": 0, "refused": 0, "open_failed": 0, "secret_bytes_seen": 0, "checked": 0}
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.KVTransferStub(channel)
        for i in range(tries):
            try:
                fd = os.open(link, os.O_RDWR)  # our own credentials decide what opens
            except OSError:
                counts["open_failed"] += 1
                continue
            try:
                token = fdpass.hand_over(fds, fd)
            finally:
                os.close(fd)
            try:
                reply = _register(stub, "race", link, token, group="race")
            except grpc.RpcError:
                counts["refused"] += 1
                continue
            counts["registered"] += 1
            ref = pb.PoolRef(pool_id="race", epoch=reply.pool.epoch, registration_token=reply.registration_token)
            if counts["registered"] % 50 == 1:  # what does the daemon's pool hold? ours, never the secret
                key = f"k{i}".encode()
                stub.Offload(pb.OffloadRequest(pool=ref, namespace="race", slots=[1], keys=[key]), timeout=10)
                stub.Restore(pb.RestoreRequest(pool=ref, namespace="race", slots=[2], keys=[key]), timeout=10)
                with open(own, "rb") as f:
                    block = f.read()[2 * BLOCK_BYTES:3 * BLOCK_BYTES]
                counts["checked"] += 1
                counts["secret_bytes_seen"] += block != bytes([7]) * BLOCK_BYTES
            stub.UnregisterPool(pb.UnregisterPoolRequest(pool=ref, registration_token=reply.registration_token),
                                timeout=10)
    stop.set()
    return counts


def join_and_unregister(target: str, own_dir: str, victim_pool: str, victim_group: str) -> dict:
    """Join another party's cache group; unregister another party's pool."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.KVTransferStub(channel)
        fds = fdpass.socket_path_for(target)
        own = os.open(_own_file(own_dir, "joiner", 3), os.O_RDWR)
        results = {"join_victims_group": _code(lambda: _register(stub, "j1", "", fdpass.hand_over(fds, own),
                                                                 victim_group)),
                   "join_daemon_group": _code(lambda: _register(stub, "j2", "", fdpass.hand_over(fds, own),
                                                                "rank0"))}
        info = stub.GetPoolInfo(pb.GetPoolInfoRequest(pool_id=victim_pool), timeout=10).pools[0]
        results["victims_path_shown"] = bool(info.handle.path)
        ref = pb.PoolRef(pool_id=victim_pool, epoch=info.epoch)
        for name, call in (("offload_victims_pool", lambda: stub.Offload(pb.OffloadRequest(
                               pool=ref, namespace="x", slots=[1], keys=[b"k"]), timeout=10)),
                           ("restore_into_victims_pool", lambda: stub.Restore(pb.RestoreRequest(
                               pool=ref, namespace="x", slots=[2], keys=[b"k"]), timeout=10)),
                           ("delete_in_victims_group", lambda: stub.Delete(pb.DeleteRequest(
                               pool=ref, namespace="x", keys=[b"k"]), timeout=10))):
            results[name] = _code(call)
        results["unregister_without_token"] = _code(lambda: stub.UnregisterPool(
            pb.UnregisterPoolRequest(pool=ref), timeout=10))
        results["unregister_wrong_token"] = _code(lambda: stub.UnregisterPool(
            pb.UnregisterPoolRequest(pool=ref, registration_token=os.urandom(16)), timeout=10))
        results["own_group"] = _code(lambda: _register(stub, "j3", "", fdpass.hand_over(fds, own), "attacker-g"))
    return results


def lane_squat(target: str, victim_pool: str, hold_s: float) -> dict:
    """Take every local-lane connection this uid may have, move another party's pool through one of them, then
    hold them all for ``hold_s`` while the victim works (it must still have the lane)."""
    from kvxfer.client import lane_client as lane

    with grpc.insecure_channel(target) as channel:
        epoch = pb_grpc.KVTransferStub(channel).GetPoolInfo(pb.GetPoolInfoRequest(pool_id=victim_pool),
                                                              timeout=10).pools[0].epoch
    ref = pb.PoolRef(pool_id=victim_pool, epoch=epoch)
    held, refusal = [], ""
    while len(held) < 100 and not refusal:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(10)
        conn.connect(lane.path_for(target))
        try:
            conn.send(lane.HEADER.pack(lane.Method.AUTH, 0))
        except BrokenPipeError:  # refused at once: the refusal waits to be read
            pass
        answer = conn.recv(1024)
        if answer == b"\x00":
            held.append(conn)
        else:
            refusal = lane.CODES[answer[0]]
            conn.close()
    results = {"connections": len(held), "then": refusal}
    for name, method, request in (
            ("offload_victims_pool", lane.Method.OFFLOAD, pb.OffloadRequest(pool=ref, namespace="x", slots=[1],
                                                                            keys=[b"k"])),
            ("restore_into_victims_pool", lane.Method.RESTORE, pb.RestoreRequest(pool=ref, namespace="x", slots=[2],
                                                                                 keys=[b"k"]))):
        held[0].send(lane.HEADER.pack(method, 10_000) + request.SerializeToString())
        results[name] = lane.CODES[held[0].recv(1 << 16)[0]]
    print(json.dumps({"holding": len(held), **results}), flush=True)  # then held until killed or ``hold_s``
    threading.Event().wait(hold_s)
    for conn in held:
        conn.close()
    return results


def register_and_hold(target: str, own_dir: str, pool_id: str, group: str) -> dict:
    """A victim engine: registers its own file, says so, and stays until its stdin closes."""
    path = _own_file(own_dir, pool_id, 9)
    with Client(target, "victim") as client:
        desc = client.register_pool(pool_id, spec_from_pb(SPEC), Layout.parse("BLHNC"), PoolHandle(Medium.SHM, path),
                                    cache_group=group, host_capacity_mib=1)
        print(json.dumps({"registered": desc.pool_id, "epoch": desc.epoch}), flush=True)
        sys.stdin.read()
        alive = [p.pool_id for p in client.pools()]
        client.unregister_pool(pool_id)
        return {"still_served_before_unregister": pool_id in alive, "unregistered": True}


def long_polls(target: str, count: int, wait_ms: int) -> dict:
    """``count`` WaitJobs calls that each wait ``wait_ms`` for jobs that never come (all at once)."""
    async def main() -> list[str]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.KVTransferStub(channel)
            epoch = (await stub.GetPoolInfo(pb.GetPoolInfoRequest(pool_id="rank0"))).pools[0].epoch
            request = pb.WaitJobsRequest(pool=pb.PoolRef(pool_id="rank0", epoch=epoch), client_id="poller",
                                         timeout_ms=wait_ms)
            calls = [asyncio.ensure_future(stub.WaitJobs(request, timeout=wait_ms / 1000 + 30)) for _ in range(count)]
            await asyncio.sleep(0.5)
            print(json.dumps({"started": count}), flush=True)
            done = await asyncio.gather(*calls, return_exceptions=True)
            return [type(d).__name__ for d in done]

    kinds = asyncio.run(main())
    return {"answered": kinds.count("WaitJobsResponse"), "kinds": sorted(set(kinds))}


def stale_socket(path: str) -> dict:
    """Leave a socket file behind, as a killed daemon of this user would."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.close()
    return {"left": path}


def drop_to(user: str) -> None:
    pw = pwd.getpwnam(user)
    os.setgroups(os.getgrouplist(user, pw.pw_gid))
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    os.environ["HOME"] = "/tmp"


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[0] == "--user":
        drop_to(args[1])
        args = args[2:]
    print(json.dumps(globals()[args[0]](*json.loads(args[1]))), flush=True)
