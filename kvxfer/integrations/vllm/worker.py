"""The worker side: vLLM's offloads and loads as the daemon's asynchronous jobs on this rank's pool.

A store is an Offload job and a load a Restore job (``wait=False``). On a GPU each store
carries an interprocess event recorded on vLLM's current stream behind the forward pass
that writes its blocks: the daemon copies once it has completed (with asynchronous
scheduling the pass may still be running when the store is submitted). ``get_finished``
collects them from one WaitJobs kept in flight while jobs are: the daemon answers it when one
finishes, so a step reads the answer if it has come and sends no RPC of its own. vLLM's
connector treats every job as a success, so failures are reported the way vLLM recomputes
them: a load's blocks that did not come back DONE (NOT_FOUND, DATA_LOSS, FAILED, CANCELLED)
are returned by ``take_load_errors`` and vLLM recomputes exactly those blocks. A store the
daemon refused or lost is simply not there later (a future miss).

A job is reported finished when the daemon says so, when the daemon is gone (its
process exited or restarted: nothing of it can touch the pool any more), or when its
deadline has passed: every job carries one (``deadline_s`` after its submission) and
the daemon starts no copy of the job's blocks after it and counts none that lands
after it, so once it has passed, plus ``LANDING_S`` for a copy started just before
it, vLLM may reuse the blocks (a load's blocks are then recomputed, a store is
dropped). No step waits longer than that on a slow or stopped daemon; the daemon's
late answer is read and dropped. A submission that timed out is
*uncertain* (the daemon may have queued it or not). The daemon runs a pool's jobs in
submission order, so a *fence* settles it: a one-block restore of a key nobody stores
(it writes nothing), submitted after it. When the fence finishes, every uncertain job
the daemon had queued has finished before it and its result came back with it (as an
id this worker never learnt); one result per uncertain job matches them in order,
otherwise they all count as failed, which is safe: none of them can run any more.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult

from kvxfer.client import SUCCESS, Client, CudaEvent, EngineBlocks, KeyFormat
from kvxfer.client.results import PendingJobs
from kvxfer.core.errors import KvxferError
from kvxfer.core.records import HintAction, Outcome
from kvxfer.integrations.sidecar_link import DaemonLink, LinkDown
from kvxfer.integrations.vllm.manager import KvxferBlocks
from kvxfer.integrations.vllm.scheduler_hints import HintCall

log = logging.getLogger("kvxfer.vllm")


#: Every store says its keys are vLLM's OffloadKeys, so that the daemon's KV events (and its
#: vLLM-format publisher) name the blocks by the block hashes vLLM's scheduler computed.
VLLM_KEYS = EngineBlocks(KeyFormat.VLLM)

class Direction(enum.Enum):
    STORE = "store"
    LOAD = "load"


#: How long after a job's deadline a copy the daemon started just before it may still land (one
#: chunk: milliseconds; this allows for a loaded host).
LANDING_S = 0.5
#: How long one WaitJobs waits at the daemon for a job of this worker to finish (it answers at once when one
#: does); far below any lease, which every WaitJobs renews.
POLL_S = 0.5
#: Jobs given up on whose late answers are recognised and dropped (older ones: dropped as strays).
MAX_GIVEN_UP = 4096


@dataclass
class _Job:
    job_id: int  # vLLM's
    direction: Direction
    blocks: list[int]
    deadline: float  # time.monotonic(): the daemon moves none of the blocks after it
    event: CudaEvent = None  # a store's readiness on the GPU: alive until the job ends
    ended: bool = False  # reported to vLLM (the daemon's answer, if one comes, is dropped)

    @property
    def give_up_at(self) -> float:
        return self.deadline + LANDING_S


def no_event() -> CudaEvent:
    """A CPU pool's readiness: vLLM's forward pass has written the blocks when it returns."""
    return None


def cuda_ready_event(device: torch.device) -> Callable[[], CudaEvent]:
    """A GPU pool's readiness: an interprocess event recorded on vLLM's current stream, behind the
    forward pass that writes the blocks (with asynchronous scheduling it may still be running)."""

    def record() -> CudaEvent:
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(device))
        return event

    return record


FENCE_NAMESPACE = "kvxfer-fence"
FENCE_KEY = b"kvxfer-fence"  # never stored: its restore finds nothing and writes nothing


def described(blocks: KvxferBlocks) -> EngineBlocks:
    """What the store's events say of its blocks: vLLM keys, and their tokens and parent where the scheduler
    knew them (a router recomputes each block hash from those)."""
    if not blocks.token_ids:
        return VLLM_KEYS
    return EngineBlocks(KeyFormat.VLLM, tuple(blocks.keys), blocks.parent, blocks.block_size, tuple(blocks.token_ids),
                        blocks.lora_name, blocks.lora_id, blocks.extra_keys)


class KvxferWorker(OffloadingWorker):
    """Submits this rank's transfers to the daemon and reports them as vLLM expects."""

    def __init__(self, link: DaemonLink, pool_id: str, *, lease_s: float, deadline_s: float,
                 ready_event: Callable[[], CudaEvent] = no_event, idle_wait_s: float = 0.0) -> None:
        """``deadline_s``: how long after its submission a job may move its blocks (then it fails).
        ``ready_event``: makes the event each store's copy waits for (``cuda_ready_event`` for a GPU pool).
        ``idle_wait_s``: how long ``get_finished`` waits for the daemon's answer in a step that runs no forward
        pass (``idle_step``: every request waits on transfers, and the engine would only spin)."""
        self._idle_wait_s = idle_wait_s
        self.idle_step = False  # set by the connector each step, from the scheduler's metadata
        self._link = link
        self._ready_event = ready_event
        self._pool_id = pool_id
        self._lease_s = lease_s
        self._deadline_s = deadline_s
        self._running: dict[int, _Job] = {}  # the daemon's job id -> the job
        self._uncertain: list[_Job] = []  # submissions that timed out, oldest first
        self._fence: int | None = None  # the daemon's id of the fence settling them
        self._poll: PendingJobs | None = None  # the WaitJobs in flight
        self._strays: dict[int, list[Outcome]] = {}  # results of ids we never learnt (uncertain jobs that ran)
        # Jobs given up on, by daemon id, until the daemon answers (a store's event is kept until then), oldest first.
        self._given_up: dict[int, _Job] = {}
        self._finished: list[TransferResult] = []
        self._load_errors: set[int] = set()
        self.dropped_stores = 0
        self.failed_load_blocks = 0
        self.given_up = 0  # jobs reported failed at their deadline, the daemon not having answered
        self.hints_sent = self.hints_dropped = 0

    # -- submitting ----------------------------------------------------------------
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KvxferBlocks)
        blocks = src_spec.block_ids.tolist()
        job = _Job(job_id, Direction.STORE, blocks, time.monotonic() + self._deadline_s, self._ready_event())
        self._submit(job, lambda c: c.submit_offload(list(zip(blocks, dst_spec.keys)), pool_id=self._pool_id,
                                                     namespace=dst_spec.namespace, lease_s=self._lease_s,
                                                     cuda_event=job.event, deadline=job.deadline,
                                                     engine=described(dst_spec), hint=dst_spec.hint))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        assert isinstance(src_spec, KvxferBlocks)
        blocks = dst_spec.block_ids.tolist()
        # A chunk's first blocks may be ones vLLM holds already: the last len(blocks) keys are to load.
        keys = src_spec.keys[len(src_spec.keys) - len(blocks):]
        job = _Job(job_id, Direction.LOAD, blocks, time.monotonic() + self._deadline_s)
        self._submit(job, lambda c: c.submit_restore(list(zip(keys, blocks)), pool_id=self._pool_id,
                                                     namespace=src_spec.namespace, lease_s=self._lease_s,
                                                     deadline=job.deadline))
        return True

    def _submit(self, job: _Job, submit) -> None:
        try:
            self._running[self._link.call(submit)] = job
        except LinkDown as down:
            if down.unsure:
                self._uncertain.append(job)  # it timed out: the daemon may have queued it
            else:
                self._end(job, None)  # never sent, or the daemon is gone: it never runs
        except KvxferError as exc:  # refused (full, invalid): it never runs
            log.warning("kvxfer: %s of %d blocks refused: %s", job.direction.value, len(job.blocks), exc)
            self._end(job, None)

    def send_hints(self, calls: list[HintCall]) -> None:
        """The scheduler's hints, one Hint each; a daemon that is down or refuses one (a full prefetch queue)
        costs that hint only."""
        for call in calls:
            try:
                self._link.call(lambda c: self._hint(c, call))
                self.hints_sent += 1
            except (LinkDown, KvxferError) as exc:
                self.hints_dropped += 1
                log.debug("kvxfer: %s hint for %s not sent: %s", call.action.value, call.request_id, exc)

    def _hint(self, client: Client, call: HintCall) -> None:
        namespace = call.namespace or None
        if call.action is HintAction.ENVELOPE:
            client.hint_envelope(call.envelope, call.keys, vllm_keys=True, request_id=call.request_id,
                                 pool_id=self._pool_id, namespace=namespace)
        else:
            client.hint(call.action, call.keys, request_id=call.request_id, pool_id=self._pool_id, namespace=namespace)

    # -- collecting ----------------------------------------------------------------
    def get_finished(self) -> list[TransferResult]:
        if self._running or self._uncertain or self._poll is not None:
            self._collect(block_s=self._idle_wait_s if self.idle_step else 0.0)
            self._give_up(time.monotonic())
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Until the named jobs finished (vLLM is about to reuse their blocks, or a forward pass reads
        them), the daemon is gone, or their deadlines passed (then they fail: vLLM recomputes)."""
        while True:
            pending = [job for job in [*self._running.values(), *self._uncertain]
                       if job.job_id in job_ids and not job.ended]
            now = time.monotonic()
            if not pending or now >= max(job.give_up_at for job in pending):
                break
            self._collect(block_s=min(1.0, max(job.give_up_at for job in pending) - now))
        self._give_up(time.monotonic(), job_ids)

    def _give_up(self, now: float, job_ids: set[int] | None = None) -> None:
        """Report as failed the (named) jobs whose deadline has passed: the daemon moves none of
        their blocks any more. Its answer, if one comes, is read and dropped."""
        late = [job for job in [*self._running.values(), *self._uncertain]
                if not job.ended and now >= job.give_up_at and (job_ids is None or job.job_id in job_ids)]
        for job in late:
            self.given_up += 1
            self._end(job, None, settled=False)  # a stopped daemon may still wait on a store's event
        for daemon_id in [i for i, job in self._running.items() if job.ended]:  # out of the table: no step polls
            self._given_up[daemon_id] = self._running.pop(daemon_id)            # for them any more
            if len(self._given_up) > MAX_GIVEN_UP:  # (the oldest: its event let go, its answer a stray)
                self._end(self._given_up.pop(next(iter(self._given_up))), None)
        if late:
            log.warning("kvxfer: %d transfers reached their deadline (%.1f s) without an answer from the daemon "
                        "at %s; their blocks count as failed (loads are recomputed)", len(late), self._deadline_s,
                        self._link.target)

    def _collect(self, block_s: float = 0.0) -> None:
        """Take the answer of the WaitJobs in flight if it has come (waiting up to ``block_s`` for it), and
        keep one in flight while jobs are: the daemon answers it the moment one of this worker's jobs
        finishes, so a step learns of it without a round trip of its own, and a step where none finished
        costs no RPC at all."""
        if self._uncertain and self._fence is None:
            self._submit_fence()
        if self._poll is None and not self._send_poll(block_s):
            return
        poll = self._poll
        if not poll.wait(block_s):
            return
        self._poll = None
        self._take(poll)
        if self._running or self._uncertain:
            self._send_poll(0.0)  # the next one at once: the daemon holds it until a job finishes

    def _send_poll(self, block_s: float) -> bool:
        try:
            self._poll = self._link.call(lambda c: c.wait_jobs_async(wait_s=POLL_S, pool_id=self._pool_id))
            return True
        except LinkDown as down:
            if down.gone:  # nothing of that daemon can touch the pool any more: every job ends, failed
                self._settle_all_failed()
        except KvxferError as exc:  # a refusal of the poll itself: the jobs stay in flight, asked again
            log.warning("kvxfer: WaitJobs refused: %s", exc)
        time.sleep(min(block_s, self._link.retry_s))  # a blocking wait tries again later: no busy loop
        return False

    def _take(self, poll: PendingJobs) -> None:
        """A WaitJobs' answer: the jobs it reports end (a poll sent on a session that has ended since is
        dropped: that session's end settled its jobs)."""
        if poll.session is not self._link.client:
            return
        try:
            finished = self._link.collect(poll)
        except LinkDown as down:
            if down.gone:
                self._settle_all_failed()
            return
        except KvxferError as exc:
            log.warning("kvxfer: WaitJobs refused: %s", exc)
            return
        for daemon_id, result in finished.items():
            late = self._given_up.pop(daemon_id, None)
            if late is not None:  # the answer of a job given up on: read, dropped (its event may go now)
                self._end(late, None)
                continue
            if daemon_id in self._running:
                self._end(self._running.pop(daemon_id), result.outcomes, result.bytes, result.seconds)
            elif daemon_id != self._fence:
                self._strays[daemon_id] = result.outcomes
        for daemon_id in finished.unknown:  # expired at the daemon: it ran or never will
            late = self._given_up.pop(daemon_id, None)
            if late is not None:
                self._end(late, None)
            if daemon_id in self._running:
                self._end(self._running.pop(daemon_id), None)
        if self._fence is not None and (self._fence in finished or self._fence in finished.unknown):
            self._settle_uncertain()

    def _submit_fence(self) -> None:
        try:
            self._fence = self._link.call(lambda c: c.submit_restore([(FENCE_KEY, 1)], pool_id=self._pool_id,
                                                                     namespace=FENCE_NAMESPACE,
                                                                     lease_s=self._lease_s))
        except (LinkDown, KvxferError):
            self._fence = None  # tried again at the next collection

    def _settle_uncertain(self) -> None:
        """The fence finished: every uncertain job that was queued has finished and reported."""
        strays = [self._strays[i] for i in sorted(self._strays)]
        matched = len(strays) == len(self._uncertain) and all(
            len(outcomes) == len(job.blocks) for outcomes, job in zip(strays, self._uncertain))
        for i, job in enumerate(self._uncertain):
            self._end(job, strays[i] if matched else None)
        self._uncertain, self._strays, self._fence = [], {}, None

    def _settle_all_failed(self) -> None:
        for daemon_id in list(self._running):
            self._end(self._running.pop(daemon_id), None)
        for job in self._uncertain:
            self._end(job, None)
        self._uncertain, self._strays, self._fence = [], {}, None

    def _end(self, job: _Job, outcomes: list[Outcome] | None, nbytes: int = 0, seconds: float = 0.0,
             settled: bool = True) -> None:
        """Report a job to vLLM (once); ``settled``: the daemon answered, or never will."""
        if settled:
            job.event = None  # the daemon's copy has run (or never will): the event may go
        if job.ended:  # given up at its deadline: reported already
            return
        job.ended = True
        failed = job.blocks if outcomes is None else [b for b, o in zip(job.blocks, outcomes) if o not in SUCCESS]
        if job.direction is Direction.LOAD:
            self._load_errors.update(failed)
            self.failed_load_blocks += len(failed)
        elif failed:
            self.dropped_stores += len(failed)
        # vLLM's connector supports no failed jobs: failures travel as load errors instead.
        self._finished.append(TransferResult(job.job_id, True, nbytes or None, seconds or None))

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        client: Client | None = self._link.client
        if client is not None:
            try:
                pending = {job.job_id for job in [*self._running.values(), *self._uncertain]}
                if pending:
                    self.wait(pending)
                client.unregister_pool(self._pool_id, drain_s=1.0)
            except (LinkDown, KvxferError) as exc:
                log.warning("kvxfer: could not unregister pool %s: %s", self._pool_id, exc)
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        self._link.close()
