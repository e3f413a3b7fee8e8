"""One validated transfer request: the shape every layer below the edge receives.

Built once where a request enters (the servicer, or a library caller), validated
whole there: a malformed batch is refused before anything is queued, reserved or
copied, and nothing below validates it again.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

from kvxfer.errors import InvalidArgument
from kvxfer.memory.cuda_driver import IPC_HANDLE_BYTES
from kvxfer.validate import MAX_BATCH_BLOCKS, check_blocks, check_namespace, checked_keys


class TransferKind(enum.Enum):
    OFFLOAD = "offload"  # pool blocks -> tier, under keys
    RESTORE = "restore"  # tier -> pool blocks the engine chose


@dataclass(frozen=True)
class TransferBatch:
    """Move pool block ``blocks[i]`` to or from the entry of ``keys[i]`` in ``namespace``, for every i."""

    kind: TransferKind
    namespace: str
    blocks: list[int]
    keys: list[bytes]
    ready_event: bytes = b""  # offload of a CUDA pool: the engine's IPC event to wait for
    deadline: float | None = None  # time.monotonic(): no pool copy starts after it, none ending after it counts

    def __len__(self) -> int:
        return len(self.blocks)

    @classmethod
    def build(cls, kind: TransferKind, namespace: str, blocks: Sequence[int], keys: Sequence[bytes],
              num_blocks: int, limit: int = MAX_BATCH_BLOCKS, ready_event: bytes = b"",
              deadline: float | None = None) -> TransferBatch:
        """Validate a request whole (namespace, blocks of a pool of ``num_blocks``, keys) and build it."""
        check_namespace(namespace)
        blocks = list(blocks)
        if len(blocks) != len(keys):
            raise InvalidArgument(f"slots and keys must have the same length ({len(blocks)} != {len(keys)})")
        check_blocks(blocks, num_blocks, limit)
        keys = checked_keys(keys, limit=limit)
        if ready_event and (kind is not TransferKind.OFFLOAD or len(ready_event) != IPC_HANDLE_BYTES):
            raise InvalidArgument(f"a CUDA event handle has {IPC_HANDLE_BYTES} bytes and goes with an offload")
        return cls(kind, namespace, blocks, keys, bytes(ready_event), deadline)

    @classmethod
    def offload(cls, namespace: str, pairs: Sequence[tuple[int, bytes]], num_blocks: int,
                deadline: float | None = None) -> TransferBatch:
        """From (block, key) pairs."""
        blocks, keys = _columns(pairs)
        return cls.build(TransferKind.OFFLOAD, namespace, blocks, keys, num_blocks, deadline=deadline)

    @classmethod
    def restore(cls, namespace: str, pairs: Sequence[tuple[bytes, int]], num_blocks: int,
                deadline: float | None = None) -> TransferBatch:
        """From (key, block) pairs."""
        keys, blocks = _columns(pairs)
        return cls.build(TransferKind.RESTORE, namespace, blocks, keys, num_blocks, deadline=deadline)


def _columns(pairs: Sequence[tuple]) -> tuple[list, list]:
    """The two columns of a list of pairs (refused whole when an item is not a pair)."""
    try:
        return list(map(itemgetter(0), pairs)), list(map(itemgetter(1), pairs))
    except (TypeError, IndexError, KeyError):
        raise InvalidArgument("each item must be a (slot, key) or (key, slot) pair") from None
