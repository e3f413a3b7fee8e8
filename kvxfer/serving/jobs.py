"""One pool's transfers, in submission order, synchronous or as jobs with leases.

Every Offload and Restore of a pool runs in the order it was submitted, whether
the caller waits or not: a synchronous request runs inline when nothing is queued
or running, else it queues behind the jobs before it. (Were a restore into block B
allowed to overtake an earlier queued offload of B, the offload would store the
restored bytes under the wrong key.)

A job holds a lease that the client renews by waiting or polling. When the lease
runs out (the client is gone), a queued job is cancelled without touching its
blocks, a running job stops at its next chunk (its pins are released, its blocks no
longer touched), and a finished result nobody claimed is dropped. Results are
reported once. Queued jobs plus uncollected results are bounded: excess
submissions get RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvxfer.core.errors import FailedPrecondition, InvalidArgument, KvxferError, ResourceExhausted
from kvxfer.core.records import JobStats, Outcome, TransferResult
from kvxfer.serving.batch import TransferBatch
from kvxfer.serving.pool_manager import PoolManager

SWEEP_S = 0.05  # how often leases are checked while the runner is idle
STOP_S = 0.2  # how often a wait looks at its ``stop`` (a finished job wakes it at once)
#: What a finished job weighs in a WaitJobs answer beside its outcomes (a byte each on the wire): its
#: id, byte count, seconds and framing, in bytes, generously.
JOB_WEIGHT = 64
log = logging.getLogger(__name__)


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Job:
    job_id: int
    batch: TransferBatch
    client_id: str
    lease_s: float
    expires: float  # time.monotonic() when the lease runs out
    state: JobState = JobState.QUEUED
    result: TransferResult | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    callbacks: list[Callable[[], None]] = field(default_factory=list)

    def renew(self, now: float) -> None:
        self.expires = now + self.lease_s


class JobRunner:
    """Runs one pool's transfers on one worker thread (or inline when idle)."""

    def __init__(self, manager: PoolManager, job_ids: Iterator[int] | None = None, max_queued: int = 256,
                 default_lease_s: float = 30.0, max_lease_s: float = 600.0, max_per_client: int | None = None) -> None:
        self.manager = manager
        self.max_queued = max_queued
        self.max_per_client = max_queued if max_per_client is None else max_per_client
        self._listeners: set[Callable[[], None]] = set()  # told whenever a job finishes
        self.default_lease_s = default_lease_s
        self.max_lease_s = max_lease_s
        self._ids = job_ids if job_ids is not None else itertools.count(1)
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}  # every job not yet reported or expired
        self._busy = False  # a transfer (job or inline) is running
        self._closing = False
        self._completed = self._cancelled = self._expired = 0
        self._worker = threading.Thread(target=self._loop, name=f"kvxfer-jobs-{manager.pool.descriptor.pool_id}",
                                        daemon=True)
        self._worker.start()

    # -- submitting --------------------------------------------------------------
    def run(self, batch: TransferBatch) -> TransferResult:
        """A synchronous transfer, in order with the jobs submitted before it."""
        job = self.begin(batch)
        if job is None:
            return self.run_inline(batch)
        job.finished.wait()
        return self.collect(job)

    def begin(self, batch: TransferBatch) -> Job | None:
        """Start a synchronous transfer: None when the pool is idle and the caller now runs it
        (``run_inline``); else a queued job to wait for (``on_finish``) and ``collect``."""
        with self._cond:
            self._check_open()
            if not self._busy and not self._queue:
                self._busy = True
                return None
            return self._enqueue(batch, "", self.max_lease_s)

    def run_or_queue(self, batch: TransferBatch) -> TransferResult | Job:
        """``begin`` and, when the pool is idle, ``run_inline`` in one call (one thread hop for
        the caller): the result, or the queued job to wait for."""
        job = self.begin(batch)
        return self.run_inline(batch) if job is None else job

    def run_inline(self, batch: TransferBatch) -> TransferResult:
        """Run a transfer ``begin`` admitted inline; frees the pool for the next one."""
        try:
            return self.manager.run(batch)
        finally:
            with self._cond:
                self._busy = False
                if self._queue or self._closing:  # the worker (or close) waits for the pool to be free
                    self._cond.notify_all()  # (woken for nothing, the worker took the GIL from the next copy)

    def on_finish(self, job: Job, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the worker thread, or now) once ``job`` has finished."""
        with self._cond:
            if job.state is not JobState.FINISHED:
                job.callbacks.append(callback)
                return
        callback()

    def collect(self, job: Job) -> TransferResult:
        """The result of a finished synchronous job."""
        with self._cond:
            self._jobs.pop(job.job_id, None)
        return job.result  # type: ignore[return-value]

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the worker thread) whenever a job finishes, until removed."""
        with self._cond:
            self._listeners.add(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        with self._cond:
            self._listeners.discard(callback)

    def submit(self, batch: TransferBatch, client_id: str, lease_s: float = 0.0) -> int:
        """Queue a job; returns its id at once."""
        if not client_id:
            raise InvalidArgument("an asynchronous request needs a client_id")
        if lease_s < 0 or lease_s > self.max_lease_s:
            raise InvalidArgument(f"lease must be in (0, {self.max_lease_s}] seconds, got {lease_s}")
        with self._cond:
            self._check_open()
            job = self._enqueue(batch, client_id, lease_s or self.default_lease_s)
            return job.job_id

    def wait(self, client_id: str, job_ids: Sequence[int] = (), timeout: float = 0.0,
             wait_all: bool = False, *, max_weight: int | None = None,
             stop: threading.Event | None = None) -> tuple[list[Job], list[int]]:
        """Finished jobs of this client (those named, or all), each reported once, and the ids
        not known (never submitted here, reported already, or expired). Waits up to ``timeout``
        for one to finish, or with ``wait_all`` for every named one. Renews the client's leases.

        ``max_weight``: report the finished jobs, oldest first, only while their outcomes plus
        ``JOB_WEIGHT`` a job add up to at most this (always one job; the others stay for the next
        call): an answer that must fit one message. Not with ``wait_all``, whose answer it would cut.
        ``stop``: once set (looked at every ``STOP_S``), answer with what has finished."""
        if max_weight is not None and wait_all:
            raise InvalidArgument("an answer of bounded size cannot wait for all the named jobs")
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                now = time.monotonic()
                final = now >= deadline or (stop is not None and stop.is_set())
                answer = self._poll(client_id, job_ids, wait_all, final, max_weight)
                if answer is not None:
                    return answer
                self._cond.wait(deadline - now if stop is None else min(deadline - now, STOP_S))

    def poll(self, client_id: str, job_ids: Sequence[int] = (), wait_all: bool = False,
             final: bool = False) -> tuple[list[Job], list[int]] | None:
        """``wait`` without blocking: the answer once there is one (or ``final``), else None
        (nothing is consumed then). Renews the client's leases either way."""
        with self._cond:
            return self._poll(client_id, job_ids, wait_all, final)

    def _poll(self, client_id: str, job_ids: Sequence[int], wait_all: bool, final: bool,
              max_weight: int | None = None) -> tuple[list[Job], list[int]] | None:
        if wait_all and not job_ids:
            raise InvalidArgument("wait_all needs job_ids")
        if not client_id:
            raise InvalidArgument("client_id is required")
        now = time.monotonic()
        mine = [j for j in self._jobs.values() if j.client_id == client_id]
        for job in mine:
            job.renew(now)
        wanted = set(job_ids)
        unknown = sorted(wanted - {j.job_id for j in mine})
        done = [j for j in mine if j.state is JobState.FINISHED and (not wanted or j.job_id in wanted)]
        enough = len(done) + len(unknown) == len(wanted) if wait_all else bool(done)
        if not (enough or final or (wanted and len(unknown) == len(wanted))):
            return None
        if max_weight is not None:
            done = _heading(done, max_weight)
        for job in done:
            del self._jobs[job.job_id]
        return done, unknown

    # -- lifecycle ---------------------------------------------------------------
    def close(self, drain_timeout: float = 10.0) -> int:
        """Refuse new work, let queued jobs finish for up to ``drain_timeout``, cancel the rest.
        Returns how many were cancelled."""
        deadline = time.monotonic() + drain_timeout
        with self._cond:
            self._closing = True
            while (self._queue or self._busy) and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            cancelled = len(self._queue)
            callbacks: list[Callable[[], None]] = []
            for job in self._queue:  # never started: their blocks were not touched
                job.result = TransferResult([Outcome.CANCELLED] * len(job.batch))
                job.state = JobState.FINISHED
                job.finished.set()
                callbacks += job.callbacks
                self._jobs.pop(job.job_id, None)
            self._queue.clear()
            self._cancelled += cancelled
            self._cond.notify_all()
        for callback in callbacks:
            callback()
        with self._cond:
            while self._busy:
                self._cond.wait()
        self._worker.join(timeout=5 * SWEEP_S + drain_timeout)
        return cancelled

    def stats(self) -> JobStats:
        with self._cond:
            return JobStats(len(self._queue), int(self._busy), self._unclaimed(), self._completed, self._cancelled,
                            self._expired)

    # -- internals ---------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closing:
            raise FailedPrecondition(f"pool {self.manager.pool.descriptor.pool_id} is being unregistered")

    def _unclaimed(self) -> int:
        """Finished asynchronous jobs whose results nobody collected yet (lock held)."""
        return sum(j.state is JobState.FINISHED and j.client_id != "" for j in self._jobs.values())

    def _enqueue(self, batch: TransferBatch, client_id: str, lease_s: float) -> Job:
        # Uncollected results hold memory until their lease runs out, so they count
        # against the bound too: a client that never calls WaitJobs is refused, not buffered.
        held = len(self._queue) + self._unclaimed()
        if held >= self.max_queued:
            raise ResourceExhausted(f"{held} jobs queued or finished but not collected on pool "
                                    f"{self.manager.pool.descriptor.pool_id}; at most {self.max_queued}")
        if client_id:  # one client may not take every place (fairness): its own bound too
            # Every job it holds counts: queued, running, or finished and not collected.
            own = sum(j.client_id == client_id for j in self._jobs.values())
            if own >= self.max_per_client:
                raise ResourceExhausted(f"this client holds {own} jobs queued or not collected on pool "
                                        f"{self.manager.pool.descriptor.pool_id}; at most {self.max_per_client} "
                                        "per client (collect results with WaitJobs)")
        job = Job(next(self._ids), batch, client_id, lease_s, time.monotonic() + lease_s)
        self._jobs[job.job_id] = job
        self._queue.append(job)
        self._cond.notify_all()
        return job

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._expire(time.monotonic())
                idle = self._busy or not self._queue
                if idle:
                    if self._closing and not self._queue and not self._busy:
                        return
                    self._cond.wait(SWEEP_S)
                else:
                    job = self._queue.popleft()
                    job.state = JobState.RUNNING
                    self._busy = True
            if idle:
                self.manager.reap()  # late GPU copies that landed give their slots back
                continue
            try:
                job.result = self.manager.run(job.batch, lambda: time.monotonic() > job.expires)
            except KvxferError as exc:  # refused as a whole (the engine's event handle did not open)
                log.warning("job refused", extra={"job_id": job.job_id, "kind": job.batch.kind.value,
                                                  "error": str(exc)})
                job.result = TransferResult([Outcome.FAILED] * len(job.batch))
            except Exception:  # a bug: report the job failed, keep the pool's queue running
                log.exception("job failed", extra={"job_id": job.job_id, "kind": job.batch.kind.value})
                job.result = TransferResult([Outcome.FAILED] * len(job.batch))
            finally:
                with self._cond:
                    job.state = JobState.FINISHED
                    self._busy = False
                    self._completed += 1
                    job.finished.set()
                    self._cond.notify_all()
                    callbacks, job.callbacks = [*job.callbacks, *self._listeners], []
                for callback in callbacks:
                    callback()

    def _expire(self, now: float) -> None:
        """Cancel queued jobs and drop finished results whose lease ran out (lock held)."""
        for job in [j for j in self._jobs.values() if j.client_id and j.expires < now]:
            if job.state is JobState.QUEUED:
                self._queue.remove(job)
                self._cancelled += 1
            elif job.state is JobState.RUNNING:
                continue  # it stops at its next chunk; dropped once finished
            self._expired += 1
            del self._jobs[job.job_id]


def _heading(done: list[Job], max_weight: int) -> list[Job]:
    """The oldest of ``done`` whose outcomes plus ``JOB_WEIGHT`` each add up to at most ``max_weight``
    (one at least)."""
    taken, weight = [], 0
    for job in sorted(done, key=lambda j: j.job_id):
        weight += len(job.batch) + JOB_WEIGHT
        if taken and weight > max_weight:
            break
        taken.append(job)
    return taken
