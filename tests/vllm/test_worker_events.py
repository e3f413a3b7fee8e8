"""The worker's books: a GPU rank's stores carry the event the daemon's copy waits for, alive until
their job ends; every job carries a deadline, and no wait outlasts it."""

import gc
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np

from kvxfer.client import FinishedJobs
from kvxfer.core.records import Outcome, TransferResult
from kvxfer.integrations.vllm import worker as worker_module
from kvxfer.integrations.vllm.manager import KvxferBlocks
from kvxfer.integrations.vllm.worker import KvxferWorker, no_event


class ReadyEvent:
    """Stands for a torch.cuda.Event(interprocess=True) recorded on vLLM's stream (no GPU here)."""


class RecordingDaemon:
    """The daemon as the worker's link sees it: it records submissions and reports what it is told."""

    retry_s = 0.1
    timeout_s = 0.1
    target = "unix:/nowhere"
    client = None

    def __init__(self) -> None:
        self.offloads: list[weakref.ref | None] = []
        self.deadlines: list[float] = []
        self.finished: dict[int, TransferResult] = {}
        self.polls = 0  # WaitJobs calls sent

    def call(self, fn):
        return fn(self)

    def collect(self, pending: "Answer") -> FinishedJobs:
        return pending.result()

    def submit_offload(self, pairs, cuda_event=None, deadline=None, **kwargs) -> int:
        self.offloads.append(weakref.ref(cuda_event) if cuda_event is not None else None)  # the daemon holds none
        self.deadlines.append(deadline)
        return len(self.offloads)

    def submit_restore(self, pairs, deadline=None, **kwargs) -> int:
        self.offloads.append(None)
        self.deadlines.append(deadline)
        return len(self.offloads)

    def wait_jobs(self, job_ids=(), wait_s=0.0, **kwargs) -> FinishedJobs:
        self.polls += 1
        return Answer(self, wait_s).result(block=True)

    def wait_jobs_async(self, job_ids=(), wait_s=0.0, **kwargs) -> "Answer":
        self.polls += 1
        return Answer(self, wait_s)


class Answer:
    """A WaitJobs in flight at the RecordingDaemon: answered once a job is finished, or empty after its wait."""

    session = None  # the RecordingDaemon's client

    def __init__(self, daemon: RecordingDaemon, wait_s: float) -> None:
        self._daemon, self._until = daemon, time.monotonic() + wait_s

    def done(self) -> bool:
        return bool(self._daemon.finished) or time.monotonic() >= self._until

    def wait(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not self.done() and time.monotonic() < end:
            time.sleep(0.001)
        return self.done()

    def result(self, block: bool = False) -> FinishedJobs:
        if block:
            self.wait(self._until - time.monotonic())
        done, self._daemon.finished = self._daemon.finished, {}
        return FinishedJobs(done)

    def cancel(self) -> None:
        pass


def _recorder(made: list[weakref.ref]):
    """A ready_event factory that keeps a weak reference to every event it makes."""

    def record() -> ReadyEvent:
        event = ReadyEvent()
        made.append(weakref.ref(event))
        return event

    return record


def _store(worker: KvxferWorker, job_id: int, blocks: list[int]) -> None:
    keys = [b"k%d" % b for b in blocks]
    worker.submit_store(job_id, SimpleNamespace(block_ids=np.array(blocks)), KvxferBlocks(keys, "ns"))


def test_each_store_carries_its_ready_event_until_its_job_ends():
    daemon = RecordingDaemon()
    made: list[weakref.ref] = []
    record = _recorder(made)
    worker = KvxferWorker(daemon, "pool0", lease_s=5, deadline_s=5, ready_event=record)
    _store(worker, 10, [1, 2])
    _store(worker, 11, [3])
    assert [o() for o in daemon.offloads] == [m() for m in made] and all(m() for m in made)
    daemon.finished = {1: TransferResult([Outcome.DONE] * 2)}
    assert [r.job_id for r in worker.get_finished()] == [10]
    gc.collect()
    assert made[0]() is None and made[1]() is not None  # the first job ended: its event may go
    daemon.finished = {2: TransferResult([Outcome.DONE])}
    worker.get_finished()
    gc.collect()
    assert made[1]() is None


def test_a_cpu_rank_passes_no_event():
    daemon = RecordingDaemon()
    worker = KvxferWorker(daemon, "pool0", lease_s=5, deadline_s=5, ready_event=no_event)
    _store(worker, 1, [4])
    assert daemon.offloads == [None]


def _load(worker: KvxferWorker, job_id: int, blocks: list[int]) -> None:
    keys = [b"k%d" % b for b in blocks]
    worker.submit_load(job_id, KvxferBlocks(keys, "ns"), SimpleNamespace(block_ids=np.array(blocks)))


def test_no_wait_outlasts_the_deadline_and_the_late_answer_is_dropped(monkeypatch):
    monkeypatch.setattr(worker_module, "LANDING_S", 0.05)
    daemon = RecordingDaemon()
    worker = KvxferWorker(daemon, "pool0", lease_s=5, deadline_s=0.2, ready_event=no_event)
    before = time.monotonic()
    _load(worker, 7, [5, 6])
    assert before + 0.2 <= daemon.deadlines[0] <= time.monotonic() + 0.2  # sent with the job
    worker.wait({7})  # a sync load: the daemon never answers
    waited = time.monotonic() - before
    assert 0.25 <= waited < 0.25 + 0.3
    assert worker.take_load_errors() == {5, 6} and worker.given_up == 1  # vLLM recomputes them
    assert [r.job_id for r in worker.get_finished()] == [7]
    daemon.finished = {1: TransferResult([Outcome.DONE] * 2)}  # the daemon's late answer: dropped
    assert worker.get_finished() == [] and worker.take_load_errors() == set()
    assert not worker._running


def test_get_finished_gives_up_on_an_asynchronous_job_at_its_deadline(monkeypatch):
    monkeypatch.setattr(worker_module, "LANDING_S", 0.0)
    daemon = RecordingDaemon()
    made: list[weakref.ref] = []
    record = _recorder(made)
    worker = KvxferWorker(daemon, "pool0", lease_s=5, deadline_s=0.1, ready_event=record)
    _store(worker, 3, [1])
    _load(worker, 4, [2])
    assert worker.get_finished() == []
    time.sleep(0.12)
    assert sorted(r.job_id for r in worker.get_finished()) == [3, 4]
    assert worker.take_load_errors() == {2} and worker.dropped_stores == 1
    gc.collect()
    assert made[0]() is not None  # the daemon may still wait on the store's event: kept until it answers
    daemon.finished = {1: TransferResult([Outcome.DEADLINE_EXCEEDED]), 2: TransferResult([Outcome.DEADLINE_EXCEEDED])}
    assert worker.get_finished() == []
    gc.collect()
    assert made[0]() is None


def test_steps_send_no_rpc_while_a_job_runs_and_learn_of_it_in_the_next_step():
    daemon = RecordingDaemon()
    worker = KvxferWorker(daemon, "pool0", lease_s=5, deadline_s=5, ready_event=no_event)
    _store(worker, 1, [1, 2])
    for _ in range(50):  # decoding steps while the store runs: one WaitJobs in flight, none sent per step
        assert worker.get_finished() == []
    assert daemon.polls == 1
    daemon.finished = {1: TransferResult([Outcome.DONE] * 2)}
    assert [r.job_id for r in worker.get_finished()] == [1]
    worker.get_finished()
    assert daemon.polls == 1  # nothing in flight: no poll either


def test_a_step_without_a_forward_pass_waits_for_the_answer_and_a_busy_step_does_not():
    daemon = RecordingDaemon()
    worker = KvxferWorker(daemon, "pool0", lease_s=5, deadline_s=30, ready_event=no_event, idle_wait_s=20.0)
    _load(worker, 1, [3])
    finish = threading.Timer(0.05, lambda: daemon.finished.update({1: TransferResult([Outcome.DONE])}))
    worker.idle_step = False
    assert worker.get_finished() == []  # returns at once: the forward pass of others goes on
    finish.start()
    worker.idle_step = True  # every request waits on transfers: waiting costs no one anything
    assert [r.job_id for r in worker.get_finished()] == [1]  # within the one call, long before idle_wait_s
    finish.join()


def test_a_job_given_up_on_leaves_the_table_and_no_later_step_polls_for_it(monkeypatch):
    """A load given up on (the daemon stopped past its deadline, its request aborted meanwhile) stayed in the
    worker's table of running jobs: every later step polled the daemon for it, for ever."""
    monkeypatch.setattr(worker_module, "LANDING_S", 0.0)
    daemon = RecordingDaemon()
    worker = KvxferWorker(daemon, "pool0", lease_s=5, deadline_s=0.05, ready_event=no_event)
    _load(worker, 9, [3])
    time.sleep(0.1)
    assert [r.job_id for r in worker.get_finished()] == [9] and worker.given_up == 1
    assert worker.take_load_errors() == {3}  # vLLM recomputes it
    assert not worker._running  # out of the table at once, not when (if ever) the daemon answers
    polls = daemon.polls
    for _ in range(20):  # idle engine steps
        assert worker.get_finished() == []
    assert daemon.polls == polls  # none of them asks the daemon about it
    daemon.finished = {1: TransferResult([Outcome.DONE])}  # a late answer, if one comes: read and dropped
    _load(worker, 10, [4])
    daemon.finished[2] = TransferResult([Outcome.DONE])
    assert [r.job_id for r in worker.get_finished()] == [10] and worker.take_load_errors() == set()
