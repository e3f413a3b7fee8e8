"""What an engine needs: asynchronous jobs with leases, registered pools, ranks, never blocking."""

import json
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

from kvxfer.client import Client
from kvxfer.core.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvxfer.core.records import Medium, Outcome, TierKind
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import PoolHandle
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from tests.e2e.conftest import SMALL_POOL, run_worker, start_worker

pytestmark = pytest.mark.e2e
DONE = Outcome.DONE


def test_async_jobs_complete_out_of_sight_and_are_reported_once(make_daemon):
    daemon = make_daemon()
    with Client(daemon.target, "async") as client:
        k, v = client.kv_views()[0]
        k[3].fill_(7.0)
        first = client.submit_offload([(3, b"a"), (4, b"b")])
        second = client.submit_offload([(5, b"c")])
        third = client.submit_restore([(b"a", 20), (b"c", 21), (b"zz", 22)])  # runs after the offloads
        assert len({first, second, third}) == 3
        finished = {}
        deadline = time.monotonic() + 10
        while len(finished) < 3 and time.monotonic() < deadline:
            batch = client.wait_jobs(wait_s=1.0)
            assert not set(batch) & set(finished)  # never reported twice
            finished.update(batch)
        assert finished[first].outcomes == [DONE, DONE] and finished[second].outcomes == [DONE]
        assert finished[third].outcomes == [DONE, DONE, Outcome.NOT_FOUND]
        assert bool((k[20] == 7.0).all())
        assert client.wait_jobs() == {}  # reported once
        assert client.wait_jobs([first]) == {}
    with grpc.insecure_channel(daemon.target) as channel:  # unknown ids are named as such
        stub = pb_grpc.KVTransferStub(channel)
        info = stub.GetPoolInfo(pb.GetPoolInfoRequest()).pools[0]
        reply = stub.WaitJobs(pb.WaitJobsRequest(pool=pb.PoolRef(pool_id="rank0", epoch=info.epoch),
                                                 client_id="someone", job_ids=[first, 999]))
        assert list(reply.unknown_job_ids) == [first, 999] and not reply.finished
        with pytest.raises(grpc.RpcError) as err:  # async without a client id is malformed
            stub.Offload(pb.OffloadRequest(pool=pb.PoolRef(pool_id="rank0", epoch=info.epoch), namespace="n",
                                           slots=[1], keys=[b"k"], wait=False))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_wait_in_flight_is_answered_when_a_job_submitted_after_it_finishes(make_daemon):
    """wait_jobs_async: the engine sends one WaitJobs and reads it when done, with no call per step."""
    daemon = make_daemon()
    with Client(daemon.target, "inflight") as client:
        pending = client.wait_jobs_async(wait_s=30)
        assert not pending.done()  # held by the daemon: nothing has finished
        job = client.submit_offload([(3, b"a"), (4, b"b")])
        assert pending.wait(timeout=20)  # answered when the job finished, long before its 30 s
        assert pending.result()[job].outcomes == [DONE, DONE]
        assert client.wait_jobs([job], wait_s=0).unknown == [job]  # reported once
        refused = client.wait_jobs_async(range(1, 10_000))  # over the daemon's limit of job ids
        with pytest.raises(InvalidArgument, match="job ids"):  # the call's error, mapped as a blocking call's is
            refused.result()


def test_a_synchronous_request_waits_for_the_jobs_before_it(make_daemon):
    pool = {**SMALL_POOL, "spec": {**SMALL_POOL["spec"], "num_layers": 32, "head_size": 128},
            "host_capacity_mib": 200}  # 1 MiB blocks: jobs that take a while
    daemon = make_daemon({"pools": [pool]})
    with Client(daemon.target, "order", timeout=60) as client:
        views = client.kv_views()
        views[0][0][10].fill_(1.0)  # slot 10 holds "old"
        for i in range(6):  # a queue of big jobs ahead
            client.submit_offload([(11 + j, f"big{i}-{j}".encode()) for j in range(40)])
        last = client.submit_offload([(10, b"old")])
        views[0][0][9].fill_(2.0)
        client.offload([(9, b"new")])
        client.restore([(b"new", 10)])  # synchronous: must not overtake the offload of slot 10
        results = {}
        while last not in results:
            results.update(client.wait_jobs(wait_s=5))
        client.restore([(b"old", 30)])
        assert bool((views[0][0][30] == 1.0).all())  # "old" holds what slot 10 had when it was offloaded
        assert bool((views[0][0][10] == 2.0).all())


def test_leases_expire_when_the_client_is_killed(make_daemon):
    # 4 MiB blocks: 18 GB of jobs, seconds of copying on one thread, submitted faster than
    # that: many are still queued when the client dies, however fast the copies run
    pool = {**SMALL_POOL, "spec": {**SMALL_POOL["spec"], "num_layers": 256, "head_size": 128},
            "host_capacity_mib": 200}
    daemon = make_daemon({"pools": [pool], "max_jobs_per_client": 256, "max_queued_jobs": 512, "copy_threads": 1})  # a core for the client
    worker = start_worker("submit_and_hang", daemon.target, "rank0", 100, 30, 0.05)
    submitted = json.loads(worker.stdout.readline())["submitted"]
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=30)
    assert len(submitted) == 150
    with Client(daemon.target, "orphan") as client:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            stats = client.stats("rank0")[0]
            jobs, tier = stats.jobs, stats.tiers[0]
            if jobs.queued == jobs.running == jobs.unclaimed == 0:
                break
            time.sleep(0.1)
        assert (jobs.queued, jobs.running, jobs.unclaimed) == (0, 0, 0), jobs
        assert jobs.cancelled > 0 and jobs.expired > 0, jobs  # some never ran; finished ones were dropped
        assert tier.pinned_blocks == 0 and tier.used_blocks == tier.ready_blocks  # no pin, no half-stored key
        assert client.health() == "SERVING"


def test_registered_pool_offloaded_by_one_engine_restored_by_another(make_daemon):
    daemon = make_daemon()
    spec = {"num_layers": 3, "num_blocks": 40, "block_size": 8, "num_kv_heads": 2, "head_size": 16,
            "dtype": "bfloat16"}
    for layout in ("flash_attn", "BLHNC"):  # an engine's own layout, and block-major
        group = f"engine-{layout}"
        stored = run_worker("registered_offload", daemon.target, str(daemon.shm_dir), f"a-{layout}", group, spec,
                            layout, 5, [3, 9, 27, 14])
        assert stored["done"] == ["done"] * 4
        restored = run_worker("registered_restore", daemon.target, str(daemon.shm_dir), f"b-{layout}", group, spec,
                              layout, 5, stored["keys"], [30, 2, 7, 21])
        assert restored == {"hits": 4, "outcomes": ["done"] * 4, "same": True}
    with Client(daemon.target) as client:
        assert [p.pool_id for p in client.pools()] == ["rank0"]  # both engines unregistered


def test_lookup_across_ranks_answers_the_minimum(make_daemon):
    daemon = make_daemon({"pools": [{**SMALL_POOL, "id": "tp0"}, {**SMALL_POOL, "id": "tp1"}]})
    with Client(daemon.target, "ranks") as client:
        keys = client.block_keys(list(range(64)), 16)
        client.offload([(1 + i, k) for i, k in enumerate(keys)], pool_id="tp0")
        client.offload([(1 + i, k) for i, k in enumerate(keys[:2])], pool_id="tp1")
        assert client.lookup(keys, pool_ids=["tp0"]).hits == 4
        both = client.lookup(keys, pool_ids=["tp0", "tp1"])
        assert both.hits == 2 and both.tiers == [TierKind.HOST, TierKind.HOST, None, None]
        # Ranks never share blocks: tp1 cannot restore what only tp0 stored.
        assert client.restore([(keys[3], 9)], pool_id="tp1", partial=True).outcomes == [Outcome.NOT_FOUND]
        stats = {s.pool_id: s for s in client.stats()}
        assert stats["tp0"].cache_group == "tp0" and stats["tp0"].tiers[0].ready_blocks == 4
        assert stats["tp1"].tiers[0].ready_blocks == 2


def test_a_killed_daemon_fails_the_client_fast(make_daemon):
    daemon = make_daemon()
    worker = start_worker("offload_until_error", daemon.target, "rank0", 2.0)
    assert '"started"' in worker.stdout.readline()
    time.sleep(0.5)
    daemon.stop(signal.SIGKILL)
    out, err = worker.communicate(timeout=120)
    assert worker.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["error"] in ("Unavailable", "DeadlineExceeded")
    # Its calls' deadline is 2 s: a client that waited on the dead daemon would hang past the 120 s above.
    assert result["best_effort"] is None  # a best-effort offload is dropped, not raised


def test_bad_registrations_are_refused(make_daemon, tmp_path):
    daemon = make_daemon({"registered_host_capacity_mib": 8})
    spec = KVSpec(2, 16, 4, 2, 8, torch.float16)
    layout = Layout.parse("BLHNC")
    good = Path(daemon.shm_dir) / "engine-file"
    good.write_bytes(bytes(spec.nbytes))
    small = Path(daemon.shm_dir) / "small"
    small.write_bytes(bytes(spec.nbytes - 1))
    shm = lambda path, offset=0: PoolHandle(Medium.SHM, str(path), offset=offset)  # noqa: E731
    with Client(daemon.target) as client:
        cases = [
            (InvalidArgument, "does not fit", dict(pool_id="x", handle=shm(small))),
            (InvalidArgument, "does not fit", dict(pool_id="x", handle=shm(good, offset=8))),
            (FailedPrecondition, "cannot open", dict(pool_id="x", handle=shm(Path(daemon.shm_dir) / "missing"))),
            (AlreadyExists, "exists", dict(pool_id="rank0", handle=shm(good))),
            (InvalidArgument, "pool id", dict(pool_id="bad/id", handle=shm(good))),
            (InvalidArgument, "host_capacity_mib", dict(pool_id="x", handle=shm(good), host_capacity_mib=9)),
            (PermissionDenied, "another party", dict(pool_id="x", handle=shm(good), cache_group="rank0")),
            (FailedPrecondition, "cannot serve one", dict(pool_id="x", handle=PoolHandle(Medium.CUDA, ipc_handle=b"\0" * 64,
                                                                                          device_uuid="GPU-0"))),
        ]
        for error, text, kwargs in cases:
            with pytest.raises(error, match=text):
                client.register_pool(spec=kwargs.pop("spec", spec), layout=layout, **kwargs)
        with grpc.insecure_channel(daemon.target) as channel:
            stub = pb_grpc.KVTransferStub(channel)
            for request in (pb.RegisterPoolRequest(pool_id="x", spec=pb.KVSpec(num_layers=2), layout="BLHNC",
                                                   handle=pb.PoolHandle(medium=pb.MEDIUM_SHM, path=str(good))),
                            pb.RegisterPoolRequest(pool_id="x", spec=pb.KVSpec(num_layers=2, num_blocks=16,
                                                   block_size=4, num_kv_heads=2, head_size=8, dtype="float16"),
                                                   layout="XYZ", handle=pb.PoolHandle(medium=pb.MEDIUM_SHM,
                                                                                      path=str(good))),
                            pb.RegisterPoolRequest(pool_id="x", spec=pb.KVSpec(num_layers=2, num_blocks=16,
                                                   block_size=4, num_kv_heads=2, head_size=8, dtype="float16"),
                                                   layout="BLHNC", handle=pb.PoolHandle(path=str(good)))):
                with pytest.raises(grpc.RpcError) as err:
                    stub.RegisterPool(request)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(FailedPrecondition, match="owned by the daemon"):
            client.unregister_pool("rank0")
        assert [p.pool_id for p in client.pools()] == ["rank0"]
        desc = client.register_pool("ok", spec, layout, shm(good))  # and a good one works
        assert desc.epoch and not desc.owned
        assert client.offload([(3, b"k")], pool_id="ok").outcomes == [DONE]
        assert client.unregister_pool("ok") == 0
        with pytest.raises(NotFound):  # the client looks the pool up first
            client.offload([(3, b"k")], pool_id="ok")
