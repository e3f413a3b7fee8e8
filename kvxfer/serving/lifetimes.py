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
