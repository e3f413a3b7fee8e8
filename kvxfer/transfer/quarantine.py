"""Late copies and what they hold: a copy past its deadline cannot be recalled, so the tier slots
(and buffers) it touches stay held until it lands, then are released once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvxfer.memory.cuda_driver import CudaError

log = logging.getLogger(__name__)


class Landing(Protocol):
    def landed(self) -> bool:
        """Whether the copy has finished (raises CudaError once the device is lost)."""


@dataclass(eq=False)
class _Held:
    handles: list[Landing]
    release: Callable[[], None]
    restore: bool  # a restore copy: it may still land in the engine's blocks


class Quarantine:
    """Late copies waiting to land. The job thread's idle sweep and a transfer's submit may reap at
    once: they take turns (two reapers would query and destroy one event twice, and release one
    entry's slots twice)."""

    def __init__(self) -> None:
        self._held: list[_Held] = []
        self._lock = threading.Lock()  # the list: adders and the reaper both look
        self._reaping = threading.Lock()  # one reaper at a time: ``landed`` destroys the events it finds done

    def add(self, handles: Sequence[Landing], release: Callable[[], None], restore: bool) -> None:
        """Hold ``release`` until every one of ``handles`` has landed."""
        with self._lock:
            self._held.append(_Held(list(handles), release, restore))

    def reap(self) -> int:
        """Release what landed copies held; returns how many entries are still late."""
        with self._reaping:
            with self._lock:
                pending = list(self._held)
            for entry in pending:
                try:
                    landed = all([h.landed() for h in entry.handles])
                except CudaError:
                    continue  # the device is lost: the slots stay held, nothing can land any more
                if landed:
                    with self._lock:
                        self._held.remove(entry)
                    entry.release()
                    log.info("late GPU copies landed; their slots are released", extra={"restore": entry.restore})
            with self._lock:
                return len(self._held)

    @property
    def restoring(self) -> bool:
        """Whether a late restore copy has not landed yet (the pool is then out of service)."""
        with self._lock:
            return any(entry.restore for entry in self._held)
