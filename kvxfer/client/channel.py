"""The gRPC channel a client's calls go over, and the deadline clock they share with the local lane."""

from __future__ import annotations

import time

import grpc

from kvxfer.core.errors import DeadlineExceeded, InvalidArgument, KvxferError, error_for_code


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
