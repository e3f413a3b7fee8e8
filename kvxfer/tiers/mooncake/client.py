"""The Mooncake Store client as the tier uses it: every call bounded, the store's codes read.

One ``MooncakeDistributedStore`` per tier, joined in the background at start; a master down then
leaves the tier degraded (its breaker open) until the breaker's probe joins it, within about a
second of the master answering. Every call runs
on a bounded pool of threads and is waited for at most ``timeout_s``: a stalled master or peer
never holds a request longer; a call past it is abandoned (its thread is freed when the store
answers) and opens the tier's circuit breaker, whose probe (a health check) closes it again.
The store's calls return codes, never raise: they are read here (``Code``).
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kvxfer.core.breaker import Breaker
from kvxfer.tiers.mooncake.reachable import CONNECT_S, unreachable
from kvxfer.tiers.mooncake.settings import MooncakeSettings

T = TypeVar("T")


class Code(enum.IntEnum):
    """The Mooncake Store's codes this tier reads (its ``ErrorCode``, mooncake-store/include/types.h)."""

    OK = 0
    NO_AVAILABLE_HANDLE = -200  # no space for a put (the store evicts on its own; this put is dropped)
    INVALID_PARAMS = -600  # a get's buffer smaller than the value: larger than any value of ours
    REPLICA_IS_NOT_READY = -703  # a put of this name still in flight: not there yet
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706  # a remove of a value a reader holds a lease on: retried, forced
    LEASE_EXPIRED = -707  # a read outlasted its lease: the value may have been evicted meanwhile
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    RPC_TIMEOUT = -901


#: Codes of a read that mean "not there (now)": a miss, never the medium failing.
ABSENT = frozenset({Code.OBJECT_NOT_FOUND, Code.REPLICA_IS_NOT_READY, Code.LEASE_EXPIRED})
PROBE = "kvxfer-probe/absent"  # a name no block has


class Unanswered(Exception):
    """The store did not answer within the deadline, or its breaker is open, or it could not be joined."""


class NotSent(Unanswered):
    """Refused before anything was sent: the breaker is open, or the tier is closed."""


class MooncakeClient:
    """The tier's connection to the cluster: ``call(fn, ...)`` runs ``fn(store, ...)`` under the deadline."""

    def __init__(self, settings: MooncakeSettings, name: str, buffers: list[tuple[int, int]]) -> None:
        """``buffers``: (address, bytes) of memory registered with every store made (zero-copy puts and gets)."""
        self.settings = settings
        self._buffers = buffers
        self._store: Any = None
        self._made = threading.Lock()
        self._calls = concurrent.futures.ThreadPoolExecutor(settings.workers, thread_name_prefix=f"kvxfer-mc-{name}")
        self.breaker = Breaker(settings.master, tier="mooncake tier", probe=self._probe)
        # Joined now, in the background: a daemon that lends memory (``segment_bytes``) must be in the cluster
        # before anyone calls, for other nodes' puts land there. (A master down now: the first call joins.)
        self._calls.submit(self._join_quietly)

    def call(self, fn: Callable[..., T], *args, timeout: float | None = None, always: bool = False) -> T:
        """``fn(store, *args)`` on a store thread, waited for at most ``timeout`` (default ``timeout_s``);
        ``Unanswered`` past it, or while the breaker is open (unless ``always``: a Delete is sent anyway)."""
        if not (always or self.breaker.allows()):
            raise NotSent(f"mooncake master {self.settings.master}: not answering (backing off)")
        try:
            future = self._calls.submit(self._run, fn, args)
        except RuntimeError:  # closed
            raise NotSent("the tier is closed") from None
        try:
            result = future.result(timeout=self.settings.timeout_s if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            exc = Unanswered(f"mooncake master {self.settings.master}: no answer within {self.settings.timeout_s:g} s")
            self.breaker.failed(exc)
            raise exc from None
        except Unanswered as exc:
            self.breaker.failed(exc)
            raise
        return result

    def failed(self, code: int, what: str) -> Unanswered:
        """A call that answered with a failing code (an RPC failure: the master down or restarting): the breaker
        opens. (The store itself stays: a client mounts its segment again at a restarted master, within about
        a second, by itself.)"""
        name = Code(code).name if code in Code._value2member_map_ else "unknown"
        exc = Unanswered(f"mooncake {what}: code {code} ({name})")
        self.breaker.failed(exc)
        return exc

    def succeeded(self) -> None:
        self.breaker.succeeded()

    def _run(self, fn: Callable[..., T], args: tuple) -> T:
        return fn(self._joined(), *args)

    def _joined(self) -> Any:
        """The store, joined to the cluster now if it is not (on a store thread). Mooncake's setup is called only
        once the master and metadata server answer (``reachable``): against a master that does not, it retries
        for tens of seconds holding the GIL, and the whole daemon would stand still meanwhile."""
        with self._made:
            if self._store is None:
                from mooncake.store import MooncakeDistributedStore  # (the wheel: only where this tier is used)

                s = self.settings
                why = unreachable(s, min(CONNECT_S, s.timeout_s))
                if why is not None:
                    raise Unanswered(f"not joined: {why}")
                store = MooncakeDistributedStore()
                code = store.setup(s.hostname, s.metadata, s.segment_bytes, s.buffer_bytes, s.protocol, s.device,
                                   s.master)
                if code != 0:
                    raise Unanswered(f"mooncake master {s.master}: joining the cluster failed (code {code})")
                for address, nbytes in self._buffers:
                    if store.register_buffer(address, nbytes) != 0:
                        store.close()
                        raise Unanswered("mooncake: registering the staging buffers failed")
                self._store = store
            return self._store

    def _join_quietly(self) -> None:
        """The join at start: one that fails opens the breaker (the tier says it is degraded), whose probe joins
        as soon as the cluster answers."""
        try:
            self._joined()
        except Unanswered as exc:
            self.breaker.failed(exc)

    def _probe(self) -> None:
        """The breaker's question while the store failed: a lookup of a name no block has answers (its health
        check says 0 with the master down: not asked)."""
        code = self._calls.submit(lambda: self._joined().is_exist(PROBE)).result(timeout=self.settings.timeout_s)
        if code not in (0, 1):
            raise Unanswered(f"mooncake lookup: code {code}")

    def close(self, timeout: float = 2.0) -> None:
        """Stop: calls still in the store get ``timeout`` to end; the store is closed if they did (else the
        process's exit releases it: closing under a call in flight is not safe)."""
        self.breaker.close()
        ender = threading.Thread(target=self._calls.shutdown, kwargs={"cancel_futures": True}, daemon=True)
        ender.start()
        ender.join(timeout)
        with self._made:
            store, self._store = self._store, None
        if store is not None and not ender.is_alive():
            store.close()
