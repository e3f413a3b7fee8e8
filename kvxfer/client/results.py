"""What the client's calls return besides their results: the outcomes that count as success, the
exception a partly failed batch raises, and ``wait_jobs``' answer (and the call in flight of
``wait_jobs_async``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc

from kvxfer.client.lane_client import LaneCall
from kvxfer.core.errors import DeadlineExceeded, KvxferError, ResourceExhausted, Unavailable, error_for_code
from kvxfer.core.records import Outcome, TransferResult
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire import messages as wire

SUCCESS = frozenset({Outcome.DONE, Outcome.ALREADY_PRESENT, Outcome.NOT_ADMITTED})  # (declined: not a failure)
#: Which status a failed batch reports, worst first.
FAILURE_CODES = [(Outcome.DATA_LOSS, "DATA_LOSS"), (Outcome.FAILED, "INTERNAL"),
                  (Outcome.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
                  (Outcome.CANCELLED, "CANCELLED"), (Outcome.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"),
                  (Outcome.NOT_FOUND, "NOT_FOUND")]


class BlockFailures(KvxferError):
    """Some blocks of a well-formed request failed; ``outcomes`` has every block's outcome."""

    def __init__(self, message: str, outcomes: list[Outcome], code: str) -> None:
        super().__init__(message)
        self.outcomes = outcomes
        self.code = code


class FinishedJobs(dict):
    """``wait_jobs``'s answer: job id -> result, and in ``unknown`` the ids the daemon does not
    know (never submitted there, reported already, or dropped when their lease ran out)."""

    def __init__(self, results: dict[int, TransferResult], unknown: Sequence[int] = ()) -> None:
        super().__init__(results)
        self.unknown: list[int] = list(unknown)


def finished(response: pb.WaitJobsResponse) -> FinishedJobs:
    return FinishedJobs({j.job_id: TransferResult([wire.STATUS_TO_OUTCOME[s] for s in j.statuses], j.bytes,
                                                  j.seconds) for j in response.finished},
                        response.unknown_job_ids)


class PendingJobs:
    """A WaitJobs in flight (``Client.wait_jobs_async``), over gRPC or the local lane: ``done()`` never blocks."""

    def __init__(self, call: grpc.Future | LaneCall, session: object,
                 to_error: Callable[[grpc.RpcError], KvxferError]) -> None:
        self._call = call
        self.session = session  # the Client that sent it: closing it cancels the call
        self._to_error = to_error

    def done(self) -> bool:
        return self._call.done()

    def wait(self, timeout: float) -> bool:
        """Block until answered (True) or ``timeout`` seconds passed (False)."""
        if isinstance(self._call, LaneCall):
            return self._call.wait(timeout)
        try:
            self._call.exception(timeout=timeout)
        except grpc.FutureTimeoutError:
            return False
        except grpc.FutureCancelledError:
            pass
        return True

    def result(self) -> FinishedJobs:
        """The answer, or the call's ``KvxferError`` (blocks until answered)."""
        if isinstance(self._call, LaneCall):
            return finished(self._call.result())
        try:
            return finished(self._call.result())
        except grpc.RpcError as exc:
            raise self._to_error(exc) from None
        except grpc.FutureCancelledError:
            raise error_for_code("CANCELLED")("the wait was cancelled (its session closed)") from None

    def cancel(self) -> None:
        self._call.cancel()


#: Errors after which a best-effort offload is dropped instead of raised: the daemon is
#: down, slow or full. A dropped offload costs a cache hit later, never correctness.
DROPPABLE = (Unavailable, DeadlineExceeded, ResourceExhausted)


def failures(result: TransferResult) -> None:
    """Raise ``BlockFailures`` (with the worst failure's code) unless every block of ``result`` succeeded."""
    if any(o not in SUCCESS for o in result.outcomes):
        code = next(c for o, c in FAILURE_CODES if o in result.outcomes)
        failed = sum(o not in SUCCESS for o in result.outcomes)
        raise BlockFailures(f"{failed} of {len(result.outcomes)} blocks failed", result.outcomes, code)


__all__ = ["DROPPABLE", "SUCCESS", "BlockFailures", "FinishedJobs", "PendingJobs", "failures", "finished"]
