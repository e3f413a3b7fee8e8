"""A GPU rank's stores carry the event the daemon's copy waits for, alive until their job ends."""

import gc
import weakref
from types import SimpleNamespace

import numpy as np

from kvxfer.client import FinishedJobs
from kvxfer.integrations.vllm.manager import KvxferBlocks
from kvxfer.integrations.vllm.worker import KvxferWorker, no_event
from kvxfer.records import Outcome, TransferResult


class ReadyEvent:
    """Stands for a torch.cuda.Event(interprocess=True) recorded on vLLM's stream (no GPU here)."""


class RecordingDaemon:
    """The daemon as the worker's link sees it: it records submissions and reports what it is told."""

    retry_s = 0.1
    client = None

    def __init__(self) -> None:
        self.offloads: list[weakref.ref | None] = []
        self.finished: dict[int, TransferResult] = {}

    def call(self, fn):
        return fn(self)

    def submit_offload(self, pairs, cuda_event=None, **kwargs) -> int:
        self.offloads.append(weakref.ref(cuda_event) if cuda_event is not None else None)  # the daemon holds none
        return len(self.offloads)

    def wait_jobs(self, job_ids=(), **kwargs) -> FinishedJobs:
        done, self.finished = self.finished, {}
        return FinishedJobs(done)


def _store(worker: KvxferWorker, job_id: int, blocks: list[int]) -> None:
    keys = [b"k%d" % b for b in blocks]
    worker.submit_store(job_id, SimpleNamespace(block_ids=np.array(blocks)), KvxferBlocks(keys, "ns"))


def test_each_store_carries_its_ready_event_until_its_job_ends():
    daemon = RecordingDaemon()
    made: list[weakref.ref] = []

    def record() -> ReadyEvent:
        event = ReadyEvent()
        made.append(weakref.ref(event))
        return event

    worker = KvxferWorker(daemon, "pool0", lease_s=5, flush_wait_s=1, ready_event=record)
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
    worker = KvxferWorker(daemon, "pool0", lease_s=5, flush_wait_s=1, ready_event=no_event)
    _store(worker, 1, [4])
    assert daemon.offloads == [None]
