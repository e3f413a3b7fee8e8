"""This daemon's NIXL agent (UCX backend): what it exposes, whom it knows, the reads it makes.

Three rules shape it:
- Memory is exposed per lease: a peer gets the NIXL descriptors of exactly the slots it
  leased (registered for the lease, reference-counted, deregistered at its end), and the
  connection information it is sent names no memory at all.
- No busy-polling thread: NIXL's own progress thread spins a core for as long as the agent
  lives (on 2 cores that halved every copy). The worker is progressed here instead, every
  ``progress_interval_us``, only while a lease granted here is open (a peer's reads of it may need
  this side's progress: over TCP, UCX emulates them with messages); an idle daemon spends nothing.
  A transfer made from here progresses the worker itself, as it polls for its end.
- A read that misses its deadline is cancelled, and if NIXL cannot cancel it the peer's
  endpoint is torn down, so that no byte lands after the reader gave its slots back.
"""

from __future__ import annotations

import enum
import importlib
import logging
import os
import threading
import time
from collections.abc import Sequence

from kvxfer.core.errors import FailedPrecondition, PermissionDenied
from kvxfer.peering.settings import PeeringSettings

log = logging.getLogger("kvxfer.peering")
DRAM = "DRAM"
UCX = "UCX"


class XferResult(enum.Enum):
    DONE = "done"
    FAILED = "failed"  # the transfer failed (the peer went away, a transport error)
    TIMEOUT = "timeout"  # still running at the deadline: cancelled


def _nixl():
    """NIXL's Python API, bindings and error classes (imported only where peering is configured): the
    wheel built for CUDA 13 (it runs on a CPU too), or for CUDA 12 on such a node. Not the ``nixl``
    meta package: it would pull a CUDA build of torch."""
    for wheel in ("nixl_cu13", "nixl_cu12"):
        try:
            api = importlib.import_module(f"{wheel}._api")
            bindings = importlib.import_module(f"{wheel}._bindings")
            break
        except ImportError:
            continue
    else:
        raise FailedPrecondition("peering needs NIXL: pip install 'kvxfer[peering]' (nixl-cu13, or nixl-cu12 on "
                                 "a CUDA 12 node)")
    errors = tuple(getattr(bindings, n) for n in dir(bindings) if n.startswith("nixl") and n.endswith("Error"))
    return api, bindings, errors


_MD_HEAD = b"nixlSerDes|Agent"  # NIXL 1.5's serialized agent metadata: this, the name's length (8 bytes LE), the name


def metadata_agent(metadata: bytes) -> str | None:
    """The agent name NIXL metadata carries (None: not NIXL agent metadata), read without loading it, so that
    metadata of another agent is refused before NIXL could replace that agent's connection."""
    head = len(_MD_HEAD)
    if not metadata.startswith(_MD_HEAD) or len(metadata) < head + 8:
        return None
    n = int.from_bytes(metadata[head:head + 8], "little")
    if not 0 < n <= 256 or len(metadata) < head + 8 + n:
        return None
    return metadata[head + 8:head + 8 + n].decode("utf-8", "replace")


class Agent:
    """One NIXL agent named ``settings.name``; thread-safe."""

    def __init__(self, settings: PeeringSettings) -> None:
        if settings.ucx_tls:  # read when the UCX context is made, below; the daemon owns its environment
            os.environ["UCX_TLS"] = settings.ucx_tls
        if settings.ucx_modules:  # read when UCX loads its modules (the first context): see PeeringSettings
            os.environ["UCX_MODULES"] = settings.ucx_modules
        api, bindings, self.errors = _nixl()
        self._bindings = bindings
        config = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.name = settings.name
        self._nixl = api.nixl_agent(settings.name, config)
        self._nixl.create_backend(UCX, {"ucx_devices": settings.ucx_net_devices} if settings.ucx_net_devices else {})
        self._interval = settings.progress_interval_us / 1e6
        self._lock = threading.Lock()
        self._exposed: dict[int, int] = {}  # slot address -> leases exposing it
        self._peers: set[str] = set()
        self._busy = 0  # open leases and reads: the worker is progressed while any is
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._progress = threading.Thread(target=self._progress_loop, name="kvxfer-nixl-progress", daemon=True)
        self._progress.start()

    # -- agents ---------------------------------------------------------------------
    def connection_info(self) -> bytes:
        """What a peer needs to reach this agent, and nothing about its memory."""
        empty = self._bindings.nixlRegDList(self._nixl.nixl_mems[DRAM], [])
        return self._nixl.get_partial_agent_metadata(empty, True, [UCX])

    def add_peer(self, name: str, metadata: bytes) -> None:
        """Know peer ``name`` from its metadata (again, when it restarted). Metadata of another name, or that NIXL
        cannot load, is refused and changes nothing: a known peer's connection stays as it was."""
        self._check_named(name, metadata, "metadata")
        with self._lock:
            self._load(name, metadata, "metadata")  # validated: loaded, or refused with nothing changed
            if name in self._peers:  # a restarted peer: its old endpoint goes, then the new one is made
                self._forget(name)
                self._load(name, metadata, "metadata")
            self._peers.add(name)

    def learn(self, name: str, metadata: bytes) -> None:
        """Load the descriptors a lease of peer ``name`` exposes; refuses another agent's (changing nothing)."""
        self._check_named(name, metadata, "lease's NIXL metadata")
        with self._lock:
            self._load(name, metadata, "lease's NIXL metadata")

    @staticmethod
    def _check_named(name: str, metadata: bytes, what: str) -> None:
        got = metadata_agent(metadata)
        if got != name:
            raise PermissionDenied(f"peer {name!r}: its {what} names agent {got!r}" if got is not None else
                                   f"peer {name!r}: its {what} is not NIXL agent metadata")

    def _load(self, name: str, metadata: bytes, what: str) -> None:
        """(lock held)"""
        try:
            got = self._nixl.add_remote_agent(metadata)
        except self.errors as exc:
            raise PermissionDenied(f"peer {name!r}: its {what} was refused ({type(exc).__name__})") from None
        got = got.decode() if isinstance(got, bytes) else got
        if got != name:  # (checked before: NIXL read another name than its header says)
            self._forget(got)
            raise PermissionDenied(f"peer {name!r} sent the NIXL metadata of agent {got!r}")

    def forget_peer(self, name: str) -> None:
        """Drop a peer's endpoint: its transfers in flight are cut (it must connect again)."""
        with self._lock:
            self._forget(name)

    def knows(self, name: str) -> bool:
        return name in self._peers

    def _forget(self, name: str) -> None:
        self._peers.discard(name)
        try:
            self._nixl.remove_remote_agent(name)
        except self.errors as exc:  # not known to NIXL (never added, or removed already)
            log.debug("remove_remote_agent", extra={"peer": name, "error": type(exc).__name__})

    # -- memory -----------------------------------------------------------------------
    def register(self, address: int, nbytes: int):
        """Register local memory reads land in (never exposed); returns what ``deregister`` takes."""
        with self._lock:
            return self._nixl.register_memory([(address, nbytes, 0, "")], DRAM)

    def deregister(self, registration) -> None:
        with self._lock:
            self._nixl.deregister_memory(registration)

    def expose(self, addresses: Sequence[int], nbytes: int) -> bytes:
        """Register these slots (each ``nbytes``) for a lease; returns the metadata a peer reads them with."""
        with self._lock:
            fresh = [a for a in addresses if a not in self._exposed]
            if fresh:
                self._nixl.register_memory([(a, nbytes, 0, "") for a in fresh], DRAM)
            for a in addresses:
                self._exposed[a] = self._exposed.get(a, 0) + 1
            descs = self._nixl.get_reg_descs([(a, nbytes, 0, "") for a in addresses], DRAM)
            return self._nixl.get_partial_agent_metadata(descs, False, [UCX])

    def withdraw(self, addresses: Sequence[int], nbytes: int) -> None:
        """A lease ended: slots no other lease exposes are deregistered."""
        with self._lock:
            gone = []
            for a in addresses:
                left = self._exposed[a] - 1
                if left:
                    self._exposed[a] = left
                else:
                    del self._exposed[a]
                    gone.append(a)
            if gone:
                self._nixl.deregister_memory(self._nixl.get_reg_descs([(a, nbytes, 0, "") for a in gone], DRAM))

    # -- transfers ------------------------------------------------------------------------
    def hold(self) -> None:
        """Progress the worker until ``unhold`` (while leases granted here are open)."""
        with self._lock:
            self._busy += 1
            self._wake.notify()

    def unhold(self) -> None:
        with self._lock:
            self._busy -= 1

    def read(self, peer: str, pairs: Sequence[tuple[int, int]], nbytes: int, deadline: float) -> XferResult:
        """READ ``nbytes`` from each remote address into each local one (``pairs``: local, remote), by
        ``deadline`` (monotonic); on TIMEOUT or FAILED nothing more lands afterwards."""
        return self._transfer("READ", peer, pairs, nbytes, deadline)

    def write(self, peer: str, pairs: Sequence[tuple[int, int]], nbytes: int, deadline: float) -> XferResult:
        """WRITE ``nbytes`` from each local address to each remote one (``pairs``: local, remote)."""
        return self._transfer("WRITE", peer, pairs, nbytes, deadline)

    def _transfer(self, op: str, peer: str, pairs: Sequence[tuple[int, int]], nbytes: int,
                  deadline: float) -> XferResult:
        n = self._nixl
        try:
            local = n.get_xfer_descs([(mine, nbytes, 0) for mine, _ in pairs], DRAM)
            remote = n.get_xfer_descs([(theirs, nbytes, 0) for _, theirs in pairs], DRAM)
            handle = n.initialize_xfer(op, local, remote, peer)
        except self.errors as exc:
            log.warning("peer transfer refused", extra={"peer": peer, "op": op, "error": type(exc).__name__})
            return XferResult.FAILED
        state, pause = "PROC", 20e-6
        try:  # (each check_xfer_state progresses the worker: the progress thread is not woken for it)
            state = n.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(pause * 2, self._interval)
                state = n.check_xfer_state(handle)
        except self.errors as exc:
            log.warning("peer transfer failed", extra={"peer": peer, "op": op, "error": type(exc).__name__})
            state = "ERR"
        finally:
            self._release(handle, peer)
        if state == "DONE":
            return XferResult.DONE
        return XferResult.TIMEOUT if state == "PROC" else XferResult.FAILED

    def _release(self, handle, peer: str) -> None:
        """Free a transfer; one still running is cancelled, and if it cannot be, its endpoint goes."""
        try:
            self._nixl.release_xfer_handle(handle)
            return
        except self.errors:
            self.forget_peer(peer)
        try:
            self._nixl.release_xfer_handle(handle)
        except self.errors as exc:
            log.error("a cancelled peer read could not be released", extra={"peer": peer, "error": type(exc).__name__})

    def _progress_loop(self) -> None:
        while True:
            with self._lock:
                while not self._busy and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            try:
                self._nixl.get_new_notifs()  # progresses the UCX worker (and discards notifications)
            except self.errors as exc:
                log.debug("progress", extra={"error": type(exc).__name__})
            time.sleep(self._interval)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._progress.join(timeout=2.0)
