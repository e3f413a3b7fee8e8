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

import numpy as np

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import HintAction
from kvxfer.core.validate import (MAX_BATCH_BLOCKS, MAX_KEY_BYTES, check_blocks, check_namespace, checked_extra_keys,
                                  checked_keys)
from kvxfer.events.event_records import EngineBlocks, KeyFormat
from kvxfer.memory.cuda_driver import IPC_HANDLE_BYTES

MAX_BLOCK_TOKENS = 1 << 12  # an engine's block of tokens, at most
MAX_EVENT_TOKENS = 1 << 20  # token ids one offload may describe


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
    engine: EngineBlocks | None = None  # offload: what the engine said of its blocks (for the KV events)
    hint: tuple[HintAction, int] | None = None  # offload: RETAIN (its TTL, seconds) or RELEASE, once stored
    peer: str = ""  # restore: the peer that holds the blocks this daemon lacks, read from first (its name)

    def __len__(self) -> int:
        return len(self.blocks)

    @classmethod
    def build(cls, kind: TransferKind, namespace: str, blocks: Sequence[int], keys: Sequence[bytes],
              num_blocks: int, limit: int = MAX_BATCH_BLOCKS, ready_event: bytes = b"",
              deadline: float | None = None, engine: EngineBlocks | None = None,
              hint: tuple[HintAction, int] | None = None, peer: str = "") -> TransferBatch:
        """Validate a request whole (namespace, blocks of a pool of ``num_blocks``, keys) and build it."""
        check_namespace(namespace)
        blocks = list(blocks)
        if len(blocks) != len(keys):
            raise InvalidArgument(f"slots and keys must have the same length ({len(blocks)} != {len(keys)})")
        check_blocks(blocks, num_blocks, limit)
        keys = checked_keys(keys, limit=limit)
        if ready_event and (kind is not TransferKind.OFFLOAD or len(ready_event) != IPC_HANDLE_BYTES):
            raise InvalidArgument(f"a CUDA event handle has {IPC_HANDLE_BYTES} bytes and goes with an offload")
        if engine is not None:
            engine = _checked_engine(kind, engine, keys)
        if hint is not None and kind is not TransferKind.OFFLOAD:
            raise InvalidArgument("a hint for blocks goes with an offload (a Restore is a read)")
        if peer and kind is not TransferKind.RESTORE:
            raise InvalidArgument("a peer to read from goes with a restore")
        return cls(kind, namespace, blocks, keys, bytes(ready_event), deadline, engine, hint, peer)

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


def _checked_engine(kind: TransferKind, engine: EngineBlocks, keys: list[bytes]) -> EngineBlocks:
    """The engine's description of an offload's blocks, checked against its keys."""
    if kind is not TransferKind.OFFLOAD:
        raise InvalidArgument("an engine block description goes with an offload")
    if len(engine.parent_block_hash) > MAX_KEY_BYTES:
        raise InvalidArgument(f"parent_block_hash is {len(engine.parent_block_hash)} bytes; at most {MAX_KEY_BYTES}")
    if not 0 <= engine.block_size <= MAX_BLOCK_TOKENS:
        raise InvalidArgument(f"block_size is {engine.block_size}; at most {MAX_BLOCK_TOKENS}")
    if engine.token_ids and len(engine.token_ids) != engine.block_size * len(keys):
        raise InvalidArgument(f"token_ids holds {len(engine.token_ids)} tokens; block_size x keys is "
                              f"{engine.block_size * len(keys)} (or none)")
    if len(engine.token_ids) > MAX_EVENT_TOKENS:
        raise InvalidArgument(f"token_ids holds {len(engine.token_ids)} tokens; at most {MAX_EVENT_TOKENS}")
    ids = engine.token_ids
    exact = ids.dtype.kind in "iu" if isinstance(ids, np.ndarray) else set(map(type, ids)) <= {int}  # (no bools)
    tokens = np.asarray(ids, dtype=np.int64) if exact and (not len(ids) or max(ids) < 1 << 63) else None
    if tokens is None or tokens.ndim != 1 or (tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 32)):
        raise InvalidArgument("token_ids are 32-bit unsigned ints")
    if not isinstance(engine.key_format, KeyFormat):
        raise InvalidArgument(f"key_format must be a KeyFormat, got {type(engine.key_format).__name__}")
    extras = checked_extra_keys(engine.extra_keys, len(keys), engine.lora_name, engine.lora_id)
    return EngineBlocks(engine.key_format, tuple(keys), bytes(engine.parent_block_hash), engine.block_size,
                        tokens.astype(np.uint32), engine.lora_name, engine.lora_id, extras)


def _columns(pairs: Sequence[tuple]) -> tuple[list, list]:
    """The two columns of a list of pairs (refused whole when an item is not a pair)."""
    try:
        return list(map(itemgetter(0), pairs)), list(map(itemgetter(1), pairs))
    except (TypeError, IndexError, KeyError):
        raise InvalidArgument("each item must be a (slot, key) or (key, slot) pair") from None
