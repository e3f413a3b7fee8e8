"""One configured peer as the reading daemon sees it: its TLS channel, its token, its NIXL agent.

Every call has the peering deadline; a peer that fails (unreachable, refusing, too slow)
opens a breaker, so that lookups and restores skip it for a backoff instead of waiting on
it each time. The NIXL connection is made on first use and again after a failure (the
peer may have restarted with a new agent).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from kvxfer.core.breaker import Breaker
from kvxfer.core.errors import PermissionDenied, Unavailable
from kvxfer.peering.agent import Agent
from kvxfer.peering.releaser import Releaser
from kvxfer.peering.settings import PeerAddress
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc

log = logging.getLogger("kvxfer.peering")


class PeerUnavailable(Unavailable):
    """A peer call failed; ``cause`` is the failure's label (``unreachable``, ``refused``, ``timeout``)."""

    def __init__(self, peer: str, cause: str, detail: str) -> None:
        super().__init__(f"peer {peer}: {cause}: {detail}")
        self.cause = cause


_CAUSES = {grpc.StatusCode.DEADLINE_EXCEEDED: "timeout", grpc.StatusCode.UNAVAILABLE: "unreachable",
           grpc.StatusCode.UNAUTHENTICATED: "refused", grpc.StatusCode.PERMISSION_DENIED: "refused"}


class PeerLink:
    def __init__(self, me: str, peer: PeerAddress, agent: Agent, timeout_s: float, cert: str = "",
                 key: str = "") -> None:
        """``cert``, ``key``: this daemon's certificate (its name in it) and key, shown to the peer (mutual TLS)."""
        self.me = me
        self.peer = peer
        self.agent = agent
        self.timeout_s = timeout_s
        self.breaker = Breaker(peer.address, tier=f"peer {peer.name}")
        options = [("grpc.ssl_target_name_override", peer.server_name)] if peer.server_name else []
        creds = grpc.ssl_channel_credentials(root_certificates=Path(peer.tls_ca).read_bytes(),
                                             private_key=Path(key).read_bytes() if key else None,
                                             certificate_chain=Path(cert).read_bytes() if cert else None)
        self._channel = grpc.secure_channel(peer.address, creds, options=options)
        self._stub = pb_grpc.KVPeerStub(self._channel)
        self._auth = (("authorization", f"Bearer {peer.token}"),)
        self._connect_lock = threading.Lock()
        self._releaser = Releaser(f"kvxfer-release-{peer.name}", self._release_now)

    @property
    def name(self) -> str:
        return self.peer.name

    def _call(self, method: str, request):
        """One call, waited for on this thread. (Blocking, not a future: a future's answer comes through a
        channel thread started for it, which cost a fixed 0.1-0.4 ms a call on 2 cores.)"""
        self._allowed()
        return self._answered(lambda: getattr(self._stub, method)(request, timeout=self.timeout_s,
                                                                  metadata=self._auth))

    def _start(self, method: str, request) -> grpc.Future:
        """Send a call without waiting for its answer (``_finish`` waits): peers asked at once."""
        self._allowed()
        return getattr(self._stub, method).future(request, timeout=self.timeout_s, metadata=self._auth)

    def _finish(self, call: grpc.Future):
        return self._answered(call.result)

    def _allowed(self) -> None:
        if not self.breaker.allows():
            raise PeerUnavailable(self.name, "backoff", "skipped after a recent failure")

    def _answered(self, wait: Callable):
        try:
            answer = wait()
        except grpc.RpcError as exc:
            code = exc.code()
            error = PeerUnavailable(self.name, _CAUSES.get(code, "refused"), f"{code.name}: {exc.details()}")
            if code in _CAUSES:  # the peer is down, slow or refuses us: back off (a bad request does not)
                self.breaker.failed(error)
            raise error from None
        self.breaker.succeeded()
        return answer

    def ensure_connected(self) -> None:
        """Exchange NIXL agents' connection information once (and after ``disconnect``)."""
        with self._connect_lock:
            if self.agent.knows(self.name):
                return
            answer = self._call("PeerConnect", pb.PeerConnectRequest(peer=self.me,
                                                                    agent_metadata=self.agent.connection_info()))
            try:
                self.agent.add_peer(self.name, answer.agent_metadata)
            except PermissionDenied as exc:
                raise PeerUnavailable(self.name, "refused", str(exc)) from None
            log.info("peer connected", extra={"peer": self.name, "address": self.peer.address})

    def disconnect(self) -> None:
        self.agent.forget_peer(self.name)

    def lookup(self, group: str, namespace: str, block_format: bytes, keys: list[bytes]) -> Callable[[], list[bool]]:
        """Ask which keys the peer holds in its cache group ``group``; returns the wait for the answer (so that
        peers are asked at once)."""
        call = self._start("PeerLookup", pb.PeerLookupRequest(peer=self.me, namespace=namespace, cache_group=group,
                                                             block_format=block_format, keys=keys))

        def answer() -> list[bool]:
            present = list(self._finish(call).present)
            return present if len(present) == len(keys) else [False] * len(keys)

        return answer

    def lease(self, group: str, namespace: str, block_format: bytes, keys: list[bytes], lease_ms: int
              ) -> pb.PeerLeaseResponse:
        self.ensure_connected()
        return self._call("PeerLease", pb.PeerLeaseRequest(peer=self.me, namespace=namespace, cache_group=group,
                                                          block_format=block_format, keys=keys, lease_ms=lease_ms))

    def reserve(self, group: str, namespace: str, block_format: bytes, keys: list[bytes], lease_ms: int
                ) -> pb.PeerReserveResponse:
        self.ensure_connected()
        return self._call("PeerReserve", pb.PeerReserveRequest(peer=self.me, namespace=namespace, cache_group=group,
                                                              block_format=block_format, keys=keys, lease_ms=lease_ms))

    def commit(self, reservation_id: bytes, checksums: list[int]) -> list[bool]:
        answer = self._call("PeerCommit", pb.PeerCommitRequest(peer=self.me, reservation_id=reservation_id,
                                                               checksums=checksums))
        stored = list(answer.stored)
        return stored if len(stored) == len(checksums) else [False] * len(checksums)

    def release(self, lease_id: bytes, corrupt_positions: list[int], failed: Callable[[str], None]) -> None:
        """End a lease without waiting for the answer (a stalled peer must not hold a restore; its
        lease ends there at its deadline anyway); ``failed(cause)`` hears of a release that failed."""
        if not self.breaker.allows():
            failed("backoff")
            return
        self._releaser.send(pb.PeerReleaseRequest(peer=self.me, lease_id=lease_id,
                                                  corrupt_positions=corrupt_positions), failed)

    def _release_now(self, request: pb.PeerReleaseRequest, failed: Callable[[str], None]) -> None:
        """(the releaser's thread)"""
        try:
            self._stub.PeerRelease(request, timeout=self.timeout_s, metadata=self._auth)
        except grpc.RpcError as exc:
            failed("release")
            log.warning("peer lease not released", extra={"peer": self.name, "error": f"{exc.code().name}"})

    def close(self, until: float | None = None) -> None:
        """Stop: the releases queued are sent until ``until`` (``time.monotonic()``; else 2 s from now)."""
        self._releaser.close(2.0 if until is None else max(0.0, until - time.monotonic()))
        self._channel.close()
