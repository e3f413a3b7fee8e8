"""One engine process's connection to its kvxfer sidecar, built so that the daemon can never hurt the engine
(shared by the vLLM and SGLang backends).

Every call has a short deadline. A daemon that is gone (``UNAVAILABLE``; or restarted,
which makes the epoch the engine holds stale: ``FAILED_PRECONDITION``) or slow
(``DEADLINE_EXCEEDED``) turns the link *down*: callers get ``LinkDown`` at once, without
an RPC, until ``retry_s`` has passed; then one call tries again, re-running ``on_connect``
(register the pool again, learn the new epochs) if the daemon was gone. Each change of
state is logged once. Calls may come from several threads (SGLang's prefetch and backup
threads): one lock guards the session, never an RPC.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvxfer.client import Client
from kvxfer.client.results import FinishedJobs, PendingJobs
from kvxfer.core.errors import DeadlineExceeded, FailedPrecondition, KvxferError, NotFound, Unavailable

T = TypeVar("T")

#: How soon a daemon that answered but did not know the pool is asked again.
SETTLE_S = 0.1
#: Errors after which the daemon no longer knows this engine's pools or jobs.
GONE = (Unavailable, FailedPrecondition, NotFound)


class LinkState(enum.Enum):
    STARTING = "starting"  # no call made yet
    UP = "up"
    SLOW = "slow"  # the daemon may still run our jobs: keep the session, retry later
    GONE = "gone"  # the daemon lost our pools and jobs: reconnect and register again


class LinkDown(Exception):
    """The daemon is not reachable now. ``gone``: it lost this engine's pools and jobs.
    ``unsure``: this call was sent and timed out, so the daemon may still carry it out."""

    def __init__(self, gone: bool, unsure: bool = False, cause: str = "") -> None:
        super().__init__(f"kvxfer daemon {'gone' if gone else 'slow'}{': ' + cause if cause else ''}")
        self.gone = gone
        self.unsure = unsure


class DaemonLink:
    """A Client that is rebuilt after the daemon went away, and calls that never wait on a dead daemon."""

    def __init__(self, target: str, *, timeout_s: float, retry_s: float, role: str,
                 on_connect: Callable[[Client], None] | None = None, engine: str = "vLLM",
                 lane: bool = True, token: str | None = None) -> None:
        self.target = target
        self.token = token  # the daemon's bearer token, where it asks for one (a daemon with a TCP listener)
        self.lane = lane  # the daemon's local lane for transfers and lookups (``Client``'s ``lane``)
        self.engine = engine
        self.log = logging.getLogger(f"kvxfer.{engine.lower()}")  # the backend's own logger: kvxfer.vllm, ...
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.role = role
        self._on_connect = on_connect
        self._client: Client | None = None
        self.state = LinkState.STARTING
        self._next_try = 0.0
        self._cause = ""  # why the link is down, for the LinkDown of calls made while it rests
        self.connects = 0
        self._lock = threading.RLock()  # the session's state; a thread that finds it connecting waits for it

    def call(self, fn: Callable[[Client], T]) -> T:
        """Run ``fn(client)``; raises ``LinkDown`` if the daemon is down (now or recently), or the
        ``KvxferError`` of a refusal (the daemon is up but said no: full, invalid)."""
        connecting = False
        try:
            with self._lock:
                if self.resting:
                    raise LinkDown(self.state is LinkState.GONE, cause=self._cause)
                if self._client is None:
                    connecting = True
                    self._client = self._connect()
                    connecting = False
                client = self._client
            result = fn(client)
        except (*GONE, DeadlineExceeded) as exc:
            raise self._failed(exc, settling=not connecting, client=None if connecting else client) from None
        self._served()
        return result

    def collect(self, pending: PendingJobs) -> FinishedJobs:
        """The answer of a WaitJobs sent earlier (``Client.wait_jobs_async``), with its errors read as
        ``call``'s are; asked even while the link rests, so that no finished job's report is dropped."""
        try:
            result = pending.result()
        except (*GONE, DeadlineExceeded) as exc:
            raise self._failed(exc, settling=False, client=pending.session) from None
        self._served()
        return result

    def _failed(self, exc: KvxferError, settling: bool, client: Client | None) -> LinkDown:
        """The link after a call that failed for want of a daemon (gone, or too slow), and what to raise."""
        if isinstance(exc, DeadlineExceeded):
            self._down(LinkState.SLOW, exc)
            return LinkDown(False, unsure=True, cause=self._cause)
        self._down(LinkState.GONE, exc, settling=settling, client=client)
        return LinkDown(True, cause=self._cause)

    def _served(self) -> None:
        if self.state is not LinkState.UP:
            self.log.warning("kvxfer %s: daemon at %s is serving; offloading on", self.role, self.target)
            self.state = LinkState.UP

    def _connect(self) -> Client:
        """A new session: a fresh Client, and ``on_connect`` (registration) run on it."""
        client = Client(self.target, timeout=self.timeout_s, lane=self.lane, token=self.token)
        try:
            if self._on_connect is not None:
                self._on_connect(client)
        except KvxferError as exc:
            client.close()
            if isinstance(exc, (*GONE, DeadlineExceeded)):
                raise
            self._down(LinkState.GONE, exc)  # refused (e.g. too many pools): try the whole session again later
            raise LinkDown(True, cause=self._cause) from None
        self.connects += 1
        return client

    def _down(self, state: LinkState, exc: KvxferError, settling: bool = False, client: Client | None = None) -> None:
        """The link is down; ``settling``: the daemon answered a call (not a registration) but did not
        know the pool: a restarted daemon while this engine's workers register again. ``client``: the
        session the failed call used (a newer one, made by another thread meanwhile, is kept)."""
        with self._lock:
            if state is LinkState.GONE and self._client is not None and client in (None, self._client):
                self._client.close()
                self._client = None
            self._cause = str(exc)
            if self.state is not state:  # once per change, with where and why
                self.log.warning("kvxfer %s: daemon at %s is %s (%s); %s goes on without it and retries every %.1f s",
                            self.role, self.target, state.value, exc, self.engine, self.retry_s)
            self.state = state
            # Such a daemon is asked again soon; one that does not answer, or refuses a registration, after retry_s.
            settling = settling and isinstance(exc, (FailedPrecondition, NotFound))
            self._next_try = time.monotonic() + (min(SETTLE_S, self.retry_s) if settling else self.retry_s)

    @property
    def resting(self) -> bool:
        """True while the link is down and not yet due to try again (a call would raise LinkDown)."""
        return self.state is not LinkState.UP and time.monotonic() < self._next_try

    @property
    def client(self) -> Client | None:
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
