"""What peering needs of a cache group (``kvxfer.serving.group.CacheGroup`` is one): the lease and push
code reach a group through these methods alone, and peering imports nothing of ``kvxfer.serving``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvxfer.index.block_index import Plan


class Fingerprinted(Protocol):
    @property
    def fingerprint(self) -> bytes:
        """The block format's fingerprint: peers match groups by it."""


class PeeredGroup(Protocol):
    name: str
    format: Fingerprinted

    @property
    def slot_bytes(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    def slot_address(self, slot: int) -> int: ...

    def slot_checksums(self, slots: list[int]) -> list[int]: ...

    def holds(self, namespace: str, keys: list[bytes]) -> list[bool]: ...

    def pin(self, namespace: str, keys: list[bytes]) -> Plan: ...

    def unpin(self, slots: Sequence[int], corrupt: set[int] = frozenset()) -> None: ...

    def publish(self, slots: Sequence[int], checksums: list[int | None]) -> None: ...

    def give_up(self, slots: Sequence[int]) -> None: ...

    def prepare_store(self, namespace: str, keys: list[bytes], engine: bool = True) -> Plan: ...

