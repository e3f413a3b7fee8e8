"""End to end: a real daemon subprocess, clients in other processes, real shared memory."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvxfer.client import BlockFailures, Client
from kvxfer.core.errors import InvalidArgument, NotFound, Unavailable
from kvxfer.core.records import Medium, Outcome
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from tests.e2e.conftest import SMALL_POOL, run_worker, start_worker

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("pool_id", ["rank0", "lbhnc"])
def test_roundtrip_into_other_slots_is_bit_exact(daemon, pool_id):
    result = run_worker("roundtrip", daemon.target, pool_id, f"rt-{pool_id}", 7, [3, 17, 2, 40, 9], [11, 5, 33, 12, 6])
    assert result["same"]
    block_bytes = 4 * 2 * 2 * 16 * 32 * 2
    assert result["offload_bytes"] == result["restore_bytes"] == 5 * block_bytes  # measured, per request
    # This process maps the same pool and sees the restored bytes too.
    with Client(daemon.target, f"rt-{pool_id}", pool_id=pool_id) as client:
        assert client.lookup([bytes.fromhex(k) for k in result["keys"]]).hits == 5
        assert client.map_pool().descriptor.layout.name == ("BLHNC" if pool_id == "rank0" else "LBHNC")


def test_concurrent_clients_and_namespace_isolation(daemon):
    jobs = [("rank0", f"tenant-{i}", 100 + i, [1 + 4 * i + j for j in range(4)], [30 + 4 * i + j for j in range(4)])
            for i in range(4)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: run_worker("roundtrip", daemon.target, *job), jobs))
    assert all(r["same"] for r in results)
    # Same token ids in another namespace: nothing visible, nothing restorable.
    probe = run_worker("namespace_probe", daemon.target, "rank0", "tenant-other", results[0]["keys"])
    assert probe == {"hits": 0, "restore": ["not_found"]}


def test_stale_epoch_and_unknown_pool_are_refused(daemon):
    with grpc.insecure_channel(daemon.target) as channel:
        stub = pb_grpc.KVTransferStub(channel)
        epoch = stub.GetPoolInfo(pb.GetPoolInfoRequest(pool_id="rank0")).pools[0].epoch
        for ref, text in ((pb.PoolRef(pool_id="rank0", epoch=epoch + 1), "stale epoch"),
                          (pb.PoolRef(pool_id="nope", epoch=epoch), "unknown pool")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Offload(pb.OffloadRequest(pool=ref, namespace="ns", slots=[1], keys=[b"k"]))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and text in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.GetPoolInfo(pb.GetPoolInfoRequest(pool_id="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


MALFORMED = {
    "null block": dict(slots=[0], keys=[b"k"]),
    "slot out of range": dict(slots=[64], keys=[b"k"]),
    "huge slot": dict(slots=[2**32 - 1], keys=[b"k"]),
    "duplicate slots": dict(slots=[1, 1], keys=[b"a", b"b"]),
    "duplicate keys": dict(slots=[1, 2], keys=[b"a", b"a"]),
    "empty key": dict(slots=[1], keys=[b""]),
    "oversized key": dict(slots=[1], keys=[b"x" * 257]),
    "length mismatch": dict(slots=[1, 2], keys=[b"a"]),
    "bad namespace": dict(slots=[1], keys=[b"a"], namespace="bad namespace!"),
    "empty namespace": dict(slots=[1], keys=[b"a"], namespace=""),
    "no pool id": dict(slots=[1], keys=[b"a"], pool=pb.PoolRef()),
}


def test_malformed_requests_change_nothing_and_daemon_stays_healthy(daemon):
    with grpc.insecure_channel(daemon.target) as channel:
        stub = pb_grpc.KVTransferStub(channel)
        info = stub.GetPoolInfo(pb.GetPoolInfoRequest(pool_id="rank0")).pools[0]
        ref = pb.PoolRef(pool_id="rank0", epoch=info.epoch)
        before = stub.Stats(pb.StatsRequest(pool_id="rank0")).pools[0]
        for case, fields in MALFORMED.items():
            fields = {"pool": ref, "namespace": "malformed", **fields}
            for request in (pb.OffloadRequest(**fields),
                            pb.RestoreRequest(pool=fields["pool"], namespace=fields["namespace"],
                                              keys=fields["keys"], slots=fields["slots"])):
                method = stub.Offload if isinstance(request, pb.OffloadRequest) else stub.Restore
                with pytest.raises(grpc.RpcError) as err:
                    method(request, timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
                assert "Traceback" not in err.value.details()
        for bad_lookup in (pb.LookupRequest(namespace="malformed", keys=[b"a"]),  # no pool
                           pb.LookupRequest(pools=[ref, ref], namespace="malformed", keys=[b"a"]),
                           pb.LookupRequest(pools=[ref], namespace="malformed", keys=[b""])):
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(bad_lookup)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        after = stub.Stats(pb.StatsRequest(pool_id="rank0")).pools[0]
        assert after.tiers == before.tiers and after.offloaded == before.offloaded
        assert stub.Lookup(pb.LookupRequest(pools=[ref], namespace="malformed", keys=[b"a", b"k"])).hits == 0
    assert daemon.health() == health_pb2.HealthCheckResponse.SERVING
    assert "rpc refused" in daemon.log_text()


def test_client_raises_typed_errors_with_outcomes(daemon):
    with Client(daemon.target, "typed", pool_id="rank0") as client:
        with pytest.raises(InvalidArgument, match="null block"):
            client.offload([(0, b"k")])
        with pytest.raises(BlockFailures) as err:
            client.restore([(b"absent", 5)])
        assert err.value.code == "NOT_FOUND" and err.value.outcomes == [Outcome.NOT_FOUND]
        assert client.restore([(b"absent", 5)], partial=True).outcomes == [Outcome.NOT_FOUND]
        with pytest.raises(NotFound):
            client.pool_info("nope")
        assert client.delete([b"absent"]) == 0
        stats = client.stats("rank0")[0]
        assert stats.tiers[0].capacity_blocks == (2 << 20) // (4 * 2 * 2 * 16 * 32 * 2)


def test_client_fails_fast_when_no_daemon(tmp_path):
    with pytest.raises(Unavailable):  # Unavailable, not DeadlineExceeded: it did not wait for a daemon
        Client(f"unix:{tmp_path}/absent.sock", timeout=30).pools()


def test_sigterm_mid_batch_exits_cleanly_and_never_showed_incomplete_keys(make_daemon):
    daemon = make_daemon({"grace_period_s": 20})
    progress = str(daemon.dir / "progress")
    writer = start_worker("offload_forever", daemon.target, "rank0", "term", 16, 60.0, progress)
    reader = start_worker("verify_present", daemon.target, "rank0", "term", 16, 60.0, progress)
    for worker in (writer, reader):
        assert '"started"' in worker.stdout.readline()
    time.sleep(2.0)  # let them run a while
    assert daemon.stop(signal.SIGTERM) == 0
    written, read = (_result(w) for w in (writer, reader))
    assert written["acknowledged"] > 0 and read["checked"] > 0, (written, read)
    assert read["bad"] == []
    assert not any(os.path.exists(daemon.socket + suffix) for suffix in ("", ".fd", ".lane"))
    log = daemon.log_text()
    assert '"shutting down"' in log and '"stopped"' in log


def _result(proc) -> dict:
    import json

    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_second_daemon_on_the_same_socket_refuses(make_daemon):
    first = make_daemon()
    second = make_daemon({"socket": first.socket}, wait=False)
    assert second.proc.wait(timeout=60) == 1
    assert "another daemon is serving" in second.log_text()
    assert first.health() == health_pb2.HealthCheckResponse.SERVING


def test_stale_socket_file_is_reclaimed(make_daemon):
    first = make_daemon()
    first.stop(signal.SIGKILL)
    assert os.path.exists(first.socket)  # SIGKILL left it
    second = make_daemon({"socket": first.socket})
    assert second.health() == health_pb2.HealthCheckResponse.SERVING
    assert "removed a stale socket file" in second.log_text()
    # The killed daemon's pools were memfds: the kernel freed them with the process.
    with Client(second.target) as client:
        assert client.map_pool().descriptor.handle.medium is Medium.MEMFD


def test_a_cuda_event_handle_is_refused_cleanly_for_a_cpu_pool(daemon):
    with Client(daemon.target, "ev") as client, grpc.insecure_channel(daemon.target) as channel:
        epoch = client.pool_info("rank0").epoch
        stub = pb_grpc.KVTransferStub(channel)
        request = pb.OffloadRequest(pool=pb.PoolRef(pool_id="rank0", epoch=epoch), namespace="ev", slots=[3],
                                    keys=[b"e"], cuda_event_handle=bytes(64))
        with pytest.raises(grpc.RpcError) as err:
            stub.Offload(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "CUDA pool" in err.value.details()
        assert client.lookup([b"e"], pool_ids=["rank0"]).hits == 0  # nothing changed


def test_a_transfer_past_the_engines_deadline_moves_nothing(daemon):
    """The deadline travels on the wire (this host's CLOCK_MONOTONIC): past it, no copy starts."""
    with Client(daemon.target, "deadline", pool_id="rank0") as client:
        pool = client.map_pool()
        keys = [b"deadline-%d" % i for i in range(3)]
        past, future = time.monotonic() - 0.001, time.monotonic() + 30
        late = client.offload(list(zip([5, 6, 7], keys)), deadline=past, partial=True)
        assert late.outcomes == [Outcome.DEADLINE_EXCEEDED] * 3 and client.lookup(keys).hits == 0
        assert client.offload(list(zip([5, 6, 7], keys)), deadline=future).outcomes == [Outcome.DONE] * 3
        before = bytes(pool.storage.numpy())
        late = client.restore(list(zip(keys, [20, 21, 22])), deadline=past, partial=True)
        assert late.outcomes == [Outcome.DEADLINE_EXCEEDED] * 3 and bytes(pool.storage.numpy()) == before
        job = client.submit_restore(list(zip(keys, [20, 21, 22])), deadline=past)
        assert client.wait_jobs([job], wait_s=5, wait_all=True)[job].outcomes == [Outcome.DEADLINE_EXCEEDED] * 3
        assert client.restore(list(zip(keys, [20, 21, 22])), deadline=future).outcomes == [Outcome.DONE] * 3
        with pytest.raises(InvalidArgument, match="time.monotonic"):
            client.restore(list(zip(keys, [20, 21, 22])), deadline=-1.0)
