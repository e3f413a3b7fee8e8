"""kvxfer's events in vLLM's KV event wire format (``vllm.distributed.kv_events``, vLLM 0.33).

A router that consumes vLLM's ``KVEventBatch`` (msgpack: the batch an array, each event a map
tagged with its class name) consumes these with no code of its own. The structs here mirror
vLLM's field for field (names, order, which have defaults); ``tests/vllm/test_kv_events.py``
decodes what they encode with vLLM's own decoder. ``medium`` names the tier, ``ownership`` is
"kvxfer" (vLLM: "secondary offloading tier identifier"), ``locality`` says whether the tier is
this node's own. Block hashes are the engine's where the blocks' keys are vLLM offload keys (the
backend says so with each offload, and every tier keeps that key format with the block, also across
restarts, so that every later event of it names it alike), else the keys themselves.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from kvxfer.core.records import TierKind
from kvxfer.events.event_records import EngineBlocks, EventKind, KeyFormat, TierEvent, engine_hash

OWNERSHIP = "kvxfer"

#: (medium, locality) of the host tier, as vLLM's events name them; the lower tiers' are on their rows
#: (``kvxfer.tiers.registry.placements``), given to the encoder by the daemon.
HOST_PLACEMENT = {TierKind.HOST: ("CPU", "LOCAL")}
MAX_NAMESPACES = 4096  # block sizes remembered (namespaces whose offloads described their blocks lately)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class VllmEncoder:
    """Encodes runs of kvxfer events as vLLM ``KVEventBatch`` payloads. One per publisher thread."""

    def __init__(self, int_hashes: bool = False, data_parallel_rank: int | None = None,
                 placement: dict[TierKind, tuple[str, str]] | None = None) -> None:
        """``placement``: each tier's (medium, locality) in the events (``kvxfer.tiers.registry.placements``)."""
        self._placement = placement or HOST_PLACEMENT
        self._int_hashes = int_hashes  # as vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1
        self._rank = data_parallel_rank
        self._block_sizes: OrderedDict[str, int] = OrderedDict()  # namespace -> tokens a block (offloads said)
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, events: list[TierEvent], ts: float) -> bytes:
        return self._encoder.encode(KVEventBatch(ts, [e for event in events for e in self.convert(event)], self._rank))

    def cleared(self, ts: float) -> bytes:
        """A batch that tells a subscriber to forget what it knows of this publisher (a resync)."""
        return self._encoder.encode(KVEventBatch(ts, [AllBlocksCleared()], self._rank))

    def convert(self, event: TierEvent) -> list[KVCacheEvent]:
        """vLLM's events for one of kvxfer's (a CLEARED tier was announced block by block already; vLLM has no
        event for a router's hint)."""
        if event.kind in (EventKind.CLEARED, EventKind.HINTED):
            return []
        engine = event.engine
        if engine is not None and engine.block_size:
            self._block_sizes[event.namespace] = engine.block_size
            self._block_sizes.move_to_end(event.namespace)
            while len(self._block_sizes) > MAX_NAMESPACES:
                self._block_sizes.popitem(last=False)
        key_format = engine.key_format if engine is not None else KeyFormat.OPAQUE  # (kept with the blocks)
        block_size = self._block_sizes.get(event.namespace, 0)
        runs: dict[int | None, list[bytes | int]] = {}  # by KV cache group (vLLM keys carry theirs)
        for key in event.keys:
            block_hash, group = engine_hash(key, key_format)
            runs.setdefault(group, []).append(self._hash(block_hash))
        medium, locality = self._placement[event.tier]
        if event.kind is EventKind.REMOVED:
            return [BlockRemoved(hashes, medium, group, locality, OWNERSHIP) for group, hashes in runs.items()]
        out: list[KVCacheEvent] = []
        for group, hashes in runs.items():
            keys = [k for k in event.keys if engine_hash(k, key_format)[1] == group] if len(runs) > 1 else event.keys
            tokens = [t for k in keys for t in engine.tokens_of(k)] if engine is not None else []
            parent = None
            if engine is not None:
                before = engine.parent_of(keys[0])
                parent = engine.parent_block_hash or None if before is None else engine_hash(before, key_format)[0]
            lora, extras = (engine.lora_name or None, _extras(engine, keys)) if engine is not None else (None, None)
            out.append(BlockStored(hashes, None if parent is None else self._hash(parent), tokens, block_size,
                                   engine.lora_id or None if engine is not None else None, medium, lora, extras,
                                   group_idx=group, locality=locality, ownership=OWNERSHIP))
        return out

    def _hash(self, block_hash: bytes) -> bytes | int:
        return int.from_bytes(block_hash, "big") & ((1 << 64) - 1) if self._int_hashes else block_hash


def _extras(engine: EngineBlocks, keys: tuple[bytes, ...] | list[bytes]) -> list[tuple[Any, ...] | None] | None:
    """vLLM's per-block extra keys of these blocks (None for a block with none; None: not given)."""
    if not engine.extra_keys:
        return None
    return [tuple(extras) or None for extras in (engine.extras_of(k) or () for k in keys)]


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEventBatch", "VllmEncoder"]
