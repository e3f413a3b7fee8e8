"""What the client's calls return besides their results: the outcomes that count as success, the
exception a partly failed batch raises, ``wait_jobs``' answer (and the call in flight of ``wait_jobs_async``),
and the wire's deadline clock; and the channel the calls go over (``open_channel``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import grpc

from kvxfer import wire
from kvxfer.errors import DeadlineExceeded, InvalidArgument, KvxferError, ResourceExhausted, Unavailable, error_for_code
from kvxfer.lane import LaneCall
from kvxfer.records import Outcome, TransferResult
from kvxfer.v1 import kvxfer_pb2 as pb

SUCCESS = frozenset({Outcome.DONE, Outcome.ALREADY_PRESENT, Outcome.NOT_ADMITTED})  # (declined: not a failure)
#: Which status a failed batch reports, worst first.
FAILURE_CODES = [(Outcome.DATA_LOSS, "DATA_LOSS"), (Outcome.FAILED, "INTERNAL"),
                  (Outcome.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
                  (Outcome.CANCELLED, "CANCELLED"), (Outcome.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"),
                  (Outcome.NOT_FOUND, "NOT_FOUND")]


def open_channel(target: str, token: str | None, root_certificates: bytes | None, certificate_chain: bytes | None,
                 private_key: bytes | None) -> tuple[grpc.Channel, tuple]:
    """The gRPC channel to a ``unix:`` or TLS ``host:port`` target, and the metadata each call sends with it."""
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    if target.startswith("unix:"):
        return grpc.insecure_channel(target, options=options), (("authorization", f"Bearer {token}"),) if token else ()
    if target.startswith("/"):  # a socket path without its scheme: the commonest slip
        raise InvalidArgument(f"target {target!r} looks like a socket path: write unix:{target}")
    if root_certificates is None:
        raise InvalidArgument(f"target {target!r}: a TCP target needs root_certificates (the daemon serves "
                              "TCP with TLS only); a Unix socket is written unix:/path/to.sock")
    creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(target, creds, options=options), ()


def time_left(deadline: float, timeout: float) -> float:
    """Seconds left until ``deadline`` (``time.monotonic()``) of a call given ``timeout``; DeadlineExceeded once
    none is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(f"the daemon did not answer within {timeout:g} s")
    return left


def rpc_error(exc: grpc.RpcError, target: str) -> KvxferError:
    """The kvxfer error of a failed gRPC call to ``target``."""
    if exc.code() is grpc.StatusCode.UNAVAILABLE:  # gRPC's own text names sockets and subchannels
        details = (exc.details() or "").lower()
        if any(word in details for word in ("ssl", "tls", "handshake", "certificate")):
            return error_for_code("UNAVAILABLE")(
                f"the TLS handshake with {target} failed: a daemon answers, but its certificate is not "
                "signed by the CA given (root_certificates, --ca) or does not carry the name or address dialled")
        return error_for_code("UNAVAILABLE")(f"no daemon answers at {target} (is it running, and is that its socket?)")
    return error_for_code(exc.code().name)(exc.details() or exc.code().name)


def monotonic_ns(deadline: float | None) -> int:
    """A ``time.monotonic()`` deadline as the wire's CLOCK_MONOTONIC nanoseconds (0: none)."""
    if deadline is None:
        return 0
    if not 0 < deadline < 2 ** 63 / 1e9:
        raise InvalidArgument(f"deadline must be a time.monotonic() value, got {deadline!r}")
    return max(1, int(deadline * 1e9))


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


__all__ = ["DROPPABLE", "SUCCESS", "BlockFailures", "FinishedJobs", "PendingJobs", "failures", "finished",
           "monotonic_ns"]
