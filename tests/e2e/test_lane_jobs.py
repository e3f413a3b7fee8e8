"""WaitJobs over the local lane against real daemons: jobs collected with no gRPC call, an answer split
to fit one message with nothing lost, its refusals, and a wait in flight answered when the daemon stops."""

import signal

import pytest
import torch

from kvxfer.client import Client
from kvxfer.client import lane_client as lane
from kvxfer.core.records import Outcome
from kvxfer.v1 import kvxfer_pb2 as pb
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.redis_server import free_port
from tests.e2e.test_lane import _ask, _connect, _grpc_handled, _lane_calls

pytestmark = pytest.mark.e2e

#: Many small blocks: a job of 2,000 blocks is 2,000 outcomes in an answer and copies little.
WIDE_POOL = {**SMALL_POOL, "spec": {**SMALL_POOL["spec"], "num_layers": 1, "num_blocks": 2048, "head_size": 8},
             "host_capacity_mib": 64}


def test_jobs_are_collected_over_the_lane_with_their_bytes(make_daemon):
    port = free_port()
    daemon = make_daemon({"metrics_listen": f"127.0.0.1:{port}"})
    with Client(daemon.target, namespace="lj") as client:
        pool = client.map_pool()
        pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, dtype=torch.uint8))
        size = pool.layout.block_bytes
        expected = [pool.storage[b * size:(b + 1) * size].clone() for b in range(1, 9)]
        keys = [b"lj-%d" % i for i in range(8)]
        stored = client.submit_offload(list(zip(range(1, 9), keys)))
        pending = client.wait_jobs_async(wait_s=20)
        assert pending.wait(60)
        assert pending.result()[stored].outcomes == [Outcome.DONE] * 8
        loaded = client.submit_restore(list(zip(keys, range(30, 38))))
        done = {}
        while loaded not in done:  # any finished job of this client: the restore, once it is done
            done.update(client.wait_jobs(wait_s=20))
        assert done[loaded].outcomes == [Outcome.DONE] * 8 and done[loaded].bytes == 8 * size
        for i, b in enumerate(range(30, 38)):
            assert torch.equal(pool.storage[b * size:(b + 1) * size], expected[i])
        unknown = client.wait_jobs([loaded, 12345], wait_s=0)  # reported already, never submitted
        assert sorted(unknown.unknown) == [loaded, 12345] and not unknown
    calls = _lane_calls(port)
    assert calls[("WaitJobs", "OK")] >= 3
    assert _grpc_handled(port, "WaitJobs") == 0


def test_an_answer_larger_than_the_lane_carries_is_split_and_nothing_is_lost(make_daemon):
    daemon = make_daemon({"pools": [WIDE_POOL]})
    with Client(daemon.target, namespace="split") as client:
        jobs = [client.submit_restore([(b"absent-%d-%d" % (j, s), s) for s in range(1, 2001)]) for j in range(60)]
        client.restore([(b"absent", 1)], partial=True)  # runs after the 60 jobs: all have finished
        answers = []
        while sum(len(a) for a in answers) < len(jobs):
            answers.append(client.wait_jobs(wait_s=20))  # over the lane: at most MAX_ANSWER bytes each
        assert len(answers) >= 2  # 120,000 outcomes do not fit one answer of 96 KiB
        got = [job_id for answer in answers for job_id in answer]
        assert sorted(got) == jobs  # each job once
        assert all(r.outcomes == [Outcome.NOT_FOUND] * 2000 for a in answers for r in a.values())
        # gRPC's answer (wait_all) has no such bound: the same client's next jobs come in one.
        more = [client.submit_restore([(b"more-%d" % s, s) for s in range(1, 2001)]) for _ in range(60)]
        assert sorted(client.wait_jobs(more, wait_s=60, wait_all=True)) == more


def test_the_lanes_wait_jobs_refuses_what_it_cannot_answer(make_daemon):
    daemon = make_daemon()
    with Client(daemon.target, namespace="r") as client:
        ref = client._ref(None)
    conn = _connect(daemon)
    header = lane.HEADER.pack(lane.Method.WAIT_JOBS, 0)
    cases = [
        (pb.WaitJobsRequest(pool=ref, client_id="c", job_ids=[1], wait_all=True), "INVALID_ARGUMENT", "wait_all"),
        (pb.WaitJobsRequest(pool=ref, client_id="bad id!"), "INVALID_ARGUMENT", "client_id"),
        (pb.WaitJobsRequest(pool=ref, client_id="c", job_ids=list(range(300))), "INVALID_ARGUMENT", "job ids"),
        (pb.WaitJobsRequest(pool=pb.PoolRef(pool_id="nope"), client_id="c"), "FAILED_PRECONDITION", "nope"),
    ]
    for request, code, words in cases:
        got, body = _ask(conn, header + request.SerializeToString())
        assert (got, words in body.decode()) == (code, True), body
    got, body = _ask(conn, header + pb.WaitJobsRequest(pool=ref, client_id="c").SerializeToString())
    assert got == "OK" and pb.WaitJobsResponse.FromString(body) == pb.WaitJobsResponse()  # a poll: nothing


def test_a_wait_in_flight_is_answered_when_the_daemon_stops(make_daemon):
    daemon = make_daemon()
    with Client(daemon.target, namespace="stop") as client:
        client.offload([(1, b"k")])  # the pool's ref is known: the wait below sends one call, nothing else
        pending = client.wait_jobs_async(wait_s=50, timeout=90)
        daemon.proc.send_signal(signal.SIGTERM)
        assert pending.wait(90)
        assert pending.result() == {}  # answered (nothing finished), not cut off at the end of the grace period
