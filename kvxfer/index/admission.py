"""Admission: which of an offload's new blocks a cache group stores at all.

Two rules, both off by default, both bookkeeping only (keys and counts, never bytes):

- ``store_threshold``: a new block is stored only once it was offered N times (vLLM's
  ``store_threshold``): a prefix seen once is not worth a slot that a repeated one could hold.
  Offers are counted per (namespace, key) in a table of at most ``tracked_keys`` entries; the
  least recently offered is forgotten first, so memory stays bounded whatever clients send.
- ``max_blocks_per_request``: an offload stores at most this many new blocks, the first ones of
  the request (a block is useless without the ones before it): one long request cannot flush
  a tier.

A block declined is reported ``NOT_ADMITTED`` (not a failure: offered again, it may be stored);
the counts of both are the host tier's ``declined_store_threshold`` and ``declined_request_cap``
events.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AdmissionSettings:
    """The ``admission`` config section."""

    store_threshold: int = 0  # store a new block once it was offered this many times (0 or 1: at once)
    max_blocks_per_request: int = 0  # new blocks an offload stores at most (0: no cap)
    tracked_keys: int = 1 << 16  # offers remembered for store_threshold (the least recent forgotten)

    @property
    def active(self) -> bool:
        return self.store_threshold > 1 or self.max_blocks_per_request > 0


class Admission:
    """One cache group's admission. Thread-safe."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        self._offers: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._lock = threading.Lock()
        self.declined_threshold = self.declined_cap = 0

    def admit(self, namespace: str, keys: Sequence[bytes], present: Sequence[bool]) -> list[bool]:
        """For each key, whether the offload may store it: held keys always (nothing is stored for them), new
        keys as the two rules say. Counts this offer of every new key."""
        s = self.settings
        if s.store_threshold <= 1:  # the cap alone: no offers to count, no loop over keys
            admitted = np.asarray(present, dtype=bool)
            over = np.flatnonzero(~admitted)[s.max_blocks_per_request:]
            admitted[~admitted] = True
            admitted[over] = False
            with self._lock:
                self.declined_cap += len(over)
            return admitted.tolist()
        admitted = list(present)
        new = 0
        with self._lock:
            for i, key in enumerate(keys):
                if present[i]:
                    continue
                if s.store_threshold > 1 and self._offered(namespace, key) < s.store_threshold:
                    self.declined_threshold += 1
                    continue
                if s.max_blocks_per_request and new >= s.max_blocks_per_request:
                    self.declined_cap += 1
                    continue
                new += 1
                admitted[i] = True
        return admitted

    def _offered(self, namespace: str, key: bytes) -> int:
        """(lock held) Count one more offer of the key; its count now."""
        name = (namespace, key)
        count = self._offers.pop(name, 0) + 1
        self._offers[name] = count  # (most recent last)
        if len(self._offers) > self.settings.tracked_keys:
            self._offers.popitem(last=False)
        return count

    @property
    def tracked(self) -> int:
        return len(self._offers)


__all__ = ["Admission", "AdmissionSettings"]
