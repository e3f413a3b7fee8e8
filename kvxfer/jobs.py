"""One pool's transfers, in submission order, synchronous or as jobs with leases.

Every Offload and Restore of a pool runs in the order it was submitted, whether
the caller waits or not: a synchronous request runs inline when nothing is queued
or running, else it queues behind the jobs before it. (Were a restore into slot S
allowed to overtake an earlier queued offload of S, the offload would store the
restored bytes under the wrong key.)

A job holds a lease that the client renews by waiting or polling. When the lease
runs out (the client is gone), a queued job is cancelled without touching its
slots, a running job stops at its next chunk (its pins are released, its slots no
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvxfer.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvxfer.manager import PoolManager, TransferResult
from kvxfer.store import Outcome

SWEEP_S = 0.05  # how often leases are checked while the runner is idle
log = logging.getLogger(__name__)


class JobKind(enum.Enum):
    OFFLOAD = "offload"
    RESTORE = "restore"


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Job:
    job_id: int
    kind: JobKind
    namespace: str
    pairs: list
    client_id: str
    lease_s: float
    expires: float  # time.monotonic() when the lease runs out
    state: JobState = JobState.QUEUED
    result: TransferResult | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    def renew(self, now: float) -> None:
        self.expires = now + self.lease_s


@dataclass(frozen=True)
class JobStats:
    queued: int
    running: int
    unclaimed: int
    completed: int
    cancelled: int
    expired: int


class JobRunner:
    """Runs one pool's transfers on one worker thread (or inline when idle)."""

    def __init__(self, manager: PoolManager, job_ids: Iterator[int] | None = None, max_queued: int = 256,
                 default_lease_s: float = 30.0, max_lease_s: float = 600.0) -> None:
        self.manager = manager
        self.max_queued = max_queued
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
    def run(self, kind: JobKind, namespace: str, pairs: Sequence[tuple]) -> TransferResult:
        """A synchronous transfer, in order with the jobs submitted before it."""
        self._validate(kind, namespace, pairs)
        with self._cond:
            self._check_open()
            inline = not self._busy and not self._queue
            if inline:
                self._busy = True
            else:
                job = self._enqueue(kind, namespace, pairs, "", self.max_lease_s)
        if inline:
            try:
                return self._execute(kind, namespace, pairs)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        job.finished.wait()
        with self._cond:
            self._jobs.pop(job.job_id, None)
        return job.result  # type: ignore[return-value]

    def submit(self, kind: JobKind, namespace: str, pairs: Sequence[tuple], client_id: str,
               lease_s: float = 0.0) -> int:
        """Queue a job; returns its id at once. The request is validated now."""
        if not client_id:
            raise InvalidArgument("an asynchronous request needs a client_id")
        if lease_s < 0 or lease_s > self.max_lease_s:
            raise InvalidArgument(f"lease must be in (0, {self.max_lease_s}] seconds, got {lease_s}")
        self._validate(kind, namespace, pairs)
        with self._cond:
            self._check_open()
            job = self._enqueue(kind, namespace, pairs, client_id, lease_s or self.default_lease_s)
            return job.job_id

    def wait(self, client_id: str, job_ids: Sequence[int] = (), timeout: float = 0.0,
             wait_all: bool = False) -> tuple[list[Job], list[int]]:
        """Finished jobs of this client (those named, or all), each reported once, and the ids
        not known (never submitted here, reported already, or expired). Waits up to ``timeout``
        for one to finish, or with ``wait_all`` for every named one. Renews the client's leases."""
        if wait_all and not job_ids:
            raise InvalidArgument("wait_all needs job_ids")
        if not client_id:
            raise InvalidArgument("client_id is required")
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                now = time.monotonic()
                mine = [j for j in self._jobs.values() if j.client_id == client_id]
                for job in mine:
                    job.renew(now)
                wanted = set(job_ids)
                unknown = sorted(wanted - {j.job_id for j in mine})
                done = [j for j in mine if j.state is JobState.FINISHED and (not wanted or j.job_id in wanted)]
                enough = len(done) + len(unknown) == len(wanted) if wait_all else bool(done)
                if enough or now >= deadline or (wanted and len(unknown) == len(wanted)):
                    for job in done:
                        del self._jobs[job.job_id]
                    return done, unknown
                self._cond.wait(deadline - now)

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
            for job in self._queue:  # never started: their slots were not touched
                job.result = TransferResult([Outcome.CANCELLED] * len(job.pairs))
                job.state = JobState.FINISHED
                job.finished.set()
                self._jobs.pop(job.job_id, None)
            self._queue.clear()
            self._cancelled += cancelled
            self._cond.notify_all()
            while self._busy:
                self._cond.wait()
        self._worker.join(timeout=5 * SWEEP_S + drain_timeout)
        return cancelled

    def stats(self) -> JobStats:
        with self._cond:
            return JobStats(len(self._queue), int(self._busy), self._unclaimed(), self._completed, self._cancelled,
                            self._expired)

    # -- internals ---------------------------------------------------------------
    def _validate(self, kind: JobKind, namespace: str, pairs: Sequence[tuple]) -> None:
        if kind is JobKind.OFFLOAD:
            self.manager.check_offload(namespace, pairs)
        else:
            self.manager.check_restore(namespace, pairs)

    def _check_open(self) -> None:
        if self._closing:
            raise FailedPrecondition(f"pool {self.manager.pool.descriptor.pool_id} is being unregistered")

    def _unclaimed(self) -> int:
        """Finished asynchronous jobs whose results nobody collected yet (lock held)."""
        return sum(j.state is JobState.FINISHED and j.client_id != "" for j in self._jobs.values())

    def _enqueue(self, kind: JobKind, namespace: str, pairs: Sequence[tuple], client_id: str, lease_s: float) -> Job:
        # Uncollected results hold memory until their lease runs out, so they count
        # against the bound too: a client that never calls WaitJobs is refused, not buffered.
        held = len(self._queue) + self._unclaimed()
        if held >= self.max_queued:
            raise ResourceExhausted(f"{held} jobs queued or finished but not collected on pool "
                                    f"{self.manager.pool.descriptor.pool_id}; at most {self.max_queued}")
        job = Job(next(self._ids), kind, namespace, list(pairs), client_id, lease_s, time.monotonic() + lease_s)
        self._jobs[job.job_id] = job
        self._queue.append(job)
        self._cond.notify_all()
        return job

    def _execute(self, kind: JobKind, namespace: str, pairs: list, job: Job | None = None) -> TransferResult:
        cancelled = None if job is None else (lambda: time.monotonic() > job.expires)
        if kind is JobKind.OFFLOAD:
            return self.manager.offload(namespace, pairs, cancelled=cancelled)
        return self.manager.restore(namespace, pairs, cancelled=cancelled)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._expire(time.monotonic())
                if self._busy or not self._queue:
                    if self._closing and not self._queue and not self._busy:
                        return
                    self._cond.wait(SWEEP_S)
                    continue
                job = self._queue.popleft()
                job.state = JobState.RUNNING
                self._busy = True
            try:
                job.result = self._execute(job.kind, job.namespace, job.pairs, job)
            except Exception:  # a bug: report the job failed, keep the pool's queue running
                log.exception("job failed", extra={"job_id": job.job_id, "kind": job.kind.value})
                job.result = TransferResult([Outcome.FAILED] * len(job.pairs))
            finally:
                with self._cond:
                    job.state = JobState.FINISHED
                    self._busy = False
                    self._completed += 1
                    job.finished.set()
                    self._cond.notify_all()

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
