"""Registered pools end with the process that registered them.

An engine that dies without unregistering would otherwise leave its pool served for
ever: on a GPU the daemon's IPC mapping keeps the dead engine's whole KV cache
allocated, and the restarted engine runs out of memory. The daemon learns the
registering process from the descriptor socket (SO_PEERCRED) and holds a pidfd for
it (Linux 5.3+): a pidfd names that process, never a later one with the same pid,
and becomes readable when it exits. One thread polls them all.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class ProcessWatch:
    """Calls ``on_exit(key)`` (from its own thread) when the process watched under ``key`` exits."""

    def __init__(self, on_exit: Callable[[str], None]) -> None:
        self._on_exit = on_exit
        self._fds: dict[int, str] = {}  # pidfd -> key
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvxfer-pidwatch", daemon=True)
        self._thread.start()

    def watch(self, key: str, pid: int, uid: int) -> bool:
        """Watch ``pid`` (owned by ``uid``); False when it cannot be watched (not visible from this
        PID namespace, or already gone): the pool then lives until unregistered."""
        if pid <= 0:
            return False
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:  # the pid was reused since the hand-off
                os.close(fd)
                return False
        except OSError:
            os.close(fd)
            return False
        with self._lock:
            self._fds[fd] = key
        os.write(self._wake_w, b"w")
        return True

    def forget(self, key: str) -> None:
        with self._lock:
            gone = [fd for fd, k in self._fds.items() if k == key]
            for fd in gone:
                del self._fds[fd]
                os.close(fd)
        os.write(self._wake_w, b"w")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
        os.write(self._wake_w, b"w")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        while True:
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            with self._lock:
                if self._closed:
                    return
                for fd in self._fds:
                    poller.register(fd, select.POLLIN)
            ready = [fd for fd, events in poller.poll() if events & select.POLLIN]
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            exited = []
            with self._lock:
                for fd in ready:
                    key = self._fds.pop(fd, None)
                    if key is not None:
                        os.close(fd)
                        exited.append(key)
            for key in exited:
                try:
                    self._on_exit(key)
                except Exception:  # a bug in the callback must not stop the watch of the others
                    log.exception("ending a dead process's pool failed", extra={"pool": key})


class UntilLanded:
    """Teardown that outlives late GPU copies: a pool unregistered, or whose engine died, while a copy that
    missed its deadline may still run keeps what that copy touches (the IPC mapping, the pinned host tier,
    the staging buffers: the references ``free`` holds) until the copy lands. Freed earlier, the copy would
    touch unmapped memory (a sticky fault: the daemon exits) or ``cuMemFree`` would wait behind it. One
    thread polls what is held, and ends when nothing is."""

    def __init__(self, poll_s: float = 0.1) -> None:
        self.poll_s = poll_s
        self._held: list[tuple[Callable[[], int], Callable[[], None], str]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def release(self, late: Callable[[], int], free: Callable[[], None], what: str) -> bool:
        """``free()`` now if ``late()`` (the copies still running) is 0, else once it is; True if now."""
        if late() == 0:
            free()
            return True
        log.warning("a pool's late GPU copies may still land: its memory is freed once they have",
                    extra={"pool": what})
        with self._lock:
            self._held.append((late, free, what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvxfer-until-landed", daemon=True)
                self._thread.start()
        return False

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            with self._lock:
                held = list(self._held)
            for entry in held:
                late, free, what = entry
                if late() == 0:
                    with self._lock:
                        self._held.remove(entry)
                    try:
                        free()
                    except Exception:  # a bug in one release must not keep the others' memory for ever
                        log.exception("freeing a pool after its late copies landed failed", extra={"pool": what})
            with self._lock:
                if not self._held:
                    self._thread = None
                    return
