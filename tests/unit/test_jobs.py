"""JobRunner and cancellation over a real pool: ordering, leases, bounds, chunk-level stops."""

import threading
import time

import pytest
import torch

from kvxfer.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvxfer.core.records import Outcome, TransferResult
from kvxfer.geometry.layout import PRESETS, KVSpec
from kvxfer.memory.pool import Pool
from kvxfer.serving.batch import TransferBatch
from kvxfer.serving.jobs import JOB_WEIGHT, JobRunner
from kvxfer.serving.pool_manager import PoolManager
from tests.helpers import read_block

# 64 KiB blocks
SPEC = KVSpec(num_layers=4, num_blocks=300, block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16)
NS = "jobs"


def offload(pairs):
    return TransferBatch.offload(NS, pairs, SPEC.num_blocks)


def restore(pairs):
    return TransferBatch.restore(NS, pairs, SPEC.num_blocks)


@pytest.fixture
def manager(shm_dir):
    with Pool.create("j", SPEC, PRESETS["BLHNC"], shm_dir=shm_dir) as pool:
        pool.storage.copy_(torch.randint(0, 256, (pool.layout.nbytes,), dtype=torch.uint8))
        manager = PoolManager(pool, 280)
        manager.copier.chunk = 64  # several chunks per 200-block batch: cancellation is asked between them
        yield manager


def test_cancelled_offload_publishes_nothing(manager):
    calls = []
    result = manager.offload(NS, [(1 + i, f"k{i}".encode()) for i in range(200)],
                             cancelled=lambda: calls.append(1) or len(calls) > 1)  # stop after one chunk
    assert result.outcomes == [Outcome.CANCELLED] * 200
    stats = manager.group.index.stats()
    assert (stats.used, stats.pinned, stats.ready) == (0, 0, 0)


def test_cancelled_restore_stops_writing_at_a_chunk(manager):
    pairs = [(1 + i, f"k{i}".encode()) for i in range(200)]
    manager.offload(NS, pairs)
    before = manager.pool.storage.clone()
    calls = []
    result = manager.restore(NS, [(k, s) for s, k in pairs], cancelled=lambda: calls.append(1) or len(calls) > 1)
    chunk = manager.copier.chunk
    assert result.outcomes == [Outcome.DONE] * chunk + [Outcome.CANCELLED] * (200 - chunk)
    assert manager.group.index.stats().pinned == 0
    # restored into the slots they came from: bytes unchanged either way, and nothing else touched
    assert torch.equal(manager.pool.storage, before)


def test_jobs_run_in_submission_order_and_sync_waits_its_turn(manager):
    runner = JobRunner(manager)
    src = read_block(manager.pool.storage, manager.pool.layout, 5)
    ids = [runner.submit(offload([(1 + j, f"big{i}-{j}".encode()) for j in range(60)]), "c")
           for i in range(3)]
    ids.append(runner.submit(offload([(5, b"five")]), "c"))
    result = runner.run(restore([(b"five", 250)]))  # queued behind all of them
    assert result.outcomes == [Outcome.DONE]
    assert torch.equal(read_block(manager.pool.storage, manager.pool.layout, 250), src)
    done, unknown = runner.wait("c", ids, timeout=10)
    assert sorted(j.job_id for j in done) == sorted(ids) and unknown == []
    assert runner.wait("c", ids) == ([], sorted(ids))  # reported once
    runner.close()


def test_expired_queued_jobs_are_cancelled_and_results_dropped(manager):
    runner = JobRunner(manager)
    gate = threading.Event()
    original = manager.run

    def slow_offload(*args, **kwargs):
        gate.wait(5)
        return original(*args, **kwargs)

    manager.run = slow_offload
    submitted = time.monotonic()
    first = runner.submit(offload([(1, b"a")]), "gone", lease_s=2.0)
    runner.submit(offload([(2, b"b")]), "gone", lease_s=2.0)
    while not runner.stats().running:  # the first is running (held at the gate), the second queued behind it
        assert time.monotonic() < submitted + 2.0, "the first job did not start within its lease"
        time.sleep(0.01)
    time.sleep(max(0.0, submitted + 2.3 - time.monotonic()))  # both leases run out (no WaitJobs renews them)
    gate.set()
    deadline = time.monotonic() + 5
    while runner.stats().running or runner.stats().unclaimed or runner.stats().queued:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    stats = runner.stats()
    assert stats.cancelled == 1 and stats.expired == 2
    assert runner.wait("gone", [first]) == ([], [first])
    assert manager.lookup(NS, [b"a", b"b"]).tiers == [None, None]  # the running one stopped before its copy
    assert manager.group.index.stats().pinned == 0
    runner.close()


def test_a_clients_bound_counts_its_running_job_too(manager):
    """max_jobs_per_client 2 admits 2 jobs, whatever state they are in (it admitted 3: one running, 2 queued)."""
    runner = JobRunner(manager, max_queued=8, max_per_client=2)
    gate = threading.Event()
    manager.run = lambda *a, **k: gate.wait(5) or TransferResult([])
    runner.submit(offload([(1, b"a")]), "c")
    deadline = time.monotonic() + 10
    while runner.stats().running == 0 and time.monotonic() < deadline:  # (the first is running now)
        time.sleep(0.01)
    runner.submit(offload([(2, b"b")]), "c")
    with pytest.raises(ResourceExhausted, match="at most 2 per client"):
        runner.submit(offload([(3, b"c")]), "c")
    runner.submit(offload([(3, b"c")]), "other")  # another client's place
    gate.set()
    assert runner.close(drain_timeout=5) == 0


def test_queue_is_bounded_and_requests_are_validated_at_submit(manager):
    runner = JobRunner(manager, max_queued=2)
    gate = threading.Event()
    manager.run = lambda *a, **k: gate.wait(5) or TransferResult([])
    runner.submit(offload([(1, b"a")]), "c")
    time.sleep(0.1)  # the first is running now
    runner.submit(offload([(2, b"b")]), "d")
    runner.submit(offload([(3, b"c")]), "e")
    with pytest.raises(ResourceExhausted):
        runner.submit(offload([(4, b"d")]), "f")
    for bad in ([(0, b"x")], [(1, b"")]):
        with pytest.raises(InvalidArgument):
            runner.submit(offload(bad), "c")
    with pytest.raises(InvalidArgument):
        runner.submit(offload([(1, b"x")]), "")  # no client id
    with pytest.raises(InvalidArgument):
        runner.submit(offload([(1, b"x")]), "c", lease_s=10_000)
    gate.set()
    assert runner.close(drain_timeout=5) == 0
    with pytest.raises(FailedPrecondition):
        runner.submit(offload([(1, b"x")]), "c")


def test_close_cancels_what_does_not_drain_in_time(manager):
    runner = JobRunner(manager)
    gate = threading.Event()
    manager.run = lambda *a, **k: gate.wait(5) or TransferResult([])
    for i in range(4):
        runner.submit(offload([(1 + i, b"k%d" % i)]), "c")
    time.sleep(0.1)
    closer = threading.Thread(target=lambda: setattr(runner, "cancelled_on_close", runner.close(0.2)))
    closer.start()
    time.sleep(0.4)
    gate.set()
    closer.join(5)
    assert runner.cancelled_on_close == 3  # one was running; three never started


def test_wait_all_returns_when_every_named_job_finished(manager):
    runner = JobRunner(manager)
    ids = [runner.submit(offload([(1 + 10 * i + j, f"w{i}-{j}".encode()) for j in range(10)]), "c")
           for i in range(5)]
    done, unknown = runner.wait("c", ids, timeout=10, wait_all=True)
    assert sorted(j.job_id for j in done) == sorted(ids) and unknown == []
    with pytest.raises(InvalidArgument):
        runner.wait("c", [], wait_all=True)
    runner.close()


def test_a_job_that_breaks_fails_alone_and_the_queue_goes_on(manager):
    runner = JobRunner(manager)
    original = manager.run
    manager.run = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bug"))
    broken = runner.submit(offload([(1, b"a"), (2, b"b")]), "c")
    done, _ = runner.wait("c", [broken], timeout=5, wait_all=True)
    assert done[0].result.outcomes == [Outcome.FAILED, Outcome.FAILED]
    manager.run = original
    fine = runner.submit(offload([(3, b"c")]), "c")
    done, _ = runner.wait("c", [fine], timeout=5, wait_all=True)
    assert done[0].result.outcomes == [Outcome.DONE]
    runner.close()


def test_uncollected_results_count_against_the_bound(manager):
    runner = JobRunner(manager, max_queued=2)
    ids = [runner.submit(offload([(1 + i, f"u{i}".encode())]), "lazy") for i in range(2)]
    deadline = time.monotonic() + 5
    while runner.stats().unclaimed < 2:  # both finished, nobody collected them
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert runner.stats().queued == 0
    with pytest.raises(ResourceExhausted, match="not collected"):
        runner.submit(offload([(5, b"more")]), "lazy")
    done, _ = runner.wait("lazy", ids)
    assert len(done) == 2
    runner.submit(offload([(5, b"more")]), "lazy")  # collecting frees room
    runner.close()


def test_an_inline_transfer_with_nothing_queued_leaves_the_worker_asleep(manager, monkeypatch):
    """The worker wakes for queued jobs (and its sweep), never for an inline run that leaves nothing behind it:
    each such wake took the GIL from the next copy."""
    import kvxfer.serving.jobs as jobs_module

    monkeypatch.setattr(jobs_module, "SWEEP_S", 600.0)  # no sweep in this test: every wake is a notify
    wakes = []
    monkeypatch.setattr(manager, "reap", lambda: wakes.append(1))  # the worker's idle branch runs it on each wake
    runner = JobRunner(manager)
    try:
        time.sleep(0.2)  # the worker reaches its wait
        before = len(wakes)
        for i in range(50):
            assert runner.run(offload([(1 + i, f"inline-{i}".encode())])).outcomes == [Outcome.DONE]
        assert len(wakes) == before
        # A job queued behind a running transfer is still started when it ends.
        started, release = threading.Event(), threading.Event()
        real_run = manager.run
        monkeypatch.setattr(manager, "run", lambda batch, cancelled=None: (started.set(), release.wait(30),
                                                                            real_run(batch, cancelled))[-1])
        inline = threading.Thread(target=runner.run, args=(offload([(100, b"held")]),))
        inline.start()
        assert started.wait(30)
        job = runner.submit(offload([(101, b"queued")]), "c")
        release.set()
        inline.join(30)
        finished, _ = runner.wait("c", [job], timeout=30, wait_all=True)
        assert [j.result.outcomes for j in finished] == [[Outcome.DONE]]
    finally:
        runner.close()


def test_an_answer_of_bounded_weight_reports_the_oldest_jobs_and_keeps_the_rest(manager):
    runner = JobRunner(manager)
    ids = [runner.submit(offload([(1 + 10 * i + j, f"b{i}-{j}".encode()) for j in range(10)]), "c")
           for i in range(4)]
    runner.run(offload([(299, b"after")]))  # runs after them: all four have finished
    taken = []
    for _ in range(2):  # two jobs a call: 2 x (10 outcomes + JOB_WEIGHT) fits, a third does not
        done, _ = runner.wait("c", timeout=10, max_weight=2 * (10 + JOB_WEIGHT) + 5)
        assert len(done) == 2
        taken += [j.job_id for j in done]
    assert taken == ids  # oldest first, each once, none lost
    runner.submit(offload([(i + 1, f"big-{i}".encode()) for i in range(200)]), "c")
    done, _ = runner.wait("c", timeout=10, max_weight=1)  # one job is always reported, however heavy
    assert len(done) == 1 and len(done[0].result.outcomes) == 200
    with pytest.raises(InvalidArgument, match="bounded size"):
        runner.wait("c", ids, wait_all=True, max_weight=1000)
    runner.close()


def test_a_wait_with_a_stop_answers_soon_after_it_is_set(manager):
    runner = JobRunner(manager)
    stop = threading.Event()
    got = []
    waiter = threading.Thread(target=lambda: got.append(runner.wait("nobody", timeout=60, stop=stop)))
    waiter.start()
    stop.set()
    waiter.join(30)  # (60 s without the stop)
    assert not waiter.is_alive() and got == [([], [])]
    runner.close()
