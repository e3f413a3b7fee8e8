"""What a KV event says: a batch of blocks became restorable in a tier, or stopped being so."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvxfer.core.records import TierKind


class EventKind(enum.Enum):
    STORED = "stored"  # restorable from this tier now (copied and checksummed)
    REMOVED = "removed"  # not restorable from this tier any more
    CLEARED = "cleared"  # the tier of this cache group was dropped whole (its blocks' REMOVED came first)
    HINTED = "hinted"  # a router's hint envelope action for these blocks (residency unchanged): see its ``hint``


class Reason(enum.Enum):
    """Why blocks were removed."""

    EVICTED = "evicted"  # room for newer blocks (they may live on in a lower tier)
    DELETED = "deleted"  # a client's Delete
    CORRUPTED = "corrupted"  # their bytes failed the checksum: dropped
    EXPIRED = "expired"  # the medium dropped them on its own (a Redis value evicted or expired)
    CLEARED = "cleared"  # the tier went away with its cache group


class KeyFormat(enum.Enum):
    """How an engine builds its keys, so that events can name blocks by the engine's own hashes."""

    OPAQUE = "opaque"  # the key is the block's name, nothing more
    VLLM = "vllm"  # vLLM's OffloadKey: the block hash, then the KV cache group index (4 bytes, big-endian)


#: What besides its tokens entered one block's hash, as vLLM's events publish it (untagged): LoRA names and
#: cache salts (str), (media identifier, offset in the block) pairs, prompt-embedding digests (bytes).
ExtraKeys = tuple[str | bytes | tuple[str, int], ...]
VALUE_BYTES = 64  # a Python str, bytes or tuple's own cost beyond its contents, about


@dataclass(frozen=True)
class EngineBlocks:
    """What the engine said of an offload's blocks, for the events that announce them."""

    key_format: KeyFormat = KeyFormat.OPAQUE
    keys: tuple[bytes, ...] = ()  # the offload's keys, in request order (the tokens follow this order)
    parent_block_hash: bytes = b""  # the hash of the block before keys[0] (empty: none, a first block)
    block_size: int = 0  # tokens a block
    token_ids: Sequence[int] = ()  # block_size tokens a key, in request order (empty: not given)
    lora_name: str = ""  # the LoRA adapter the blocks were computed with (empty: none)
    lora_id: int = 0  # its id in the engine (0: none)
    extra_keys: tuple[ExtraKeys, ...] = ()  # one a key, in request order (empty: not given)

    def extras_of(self, key: bytes) -> ExtraKeys | None:
        """What besides tokens entered one block's hash (None: not given)."""
        if not self.extra_keys:
            return None
        i = self._positions().get(key)
        return None if i is None else self.extra_keys[i]

    def nbytes(self) -> int:
        """What the description holds in memory beyond the keys, near enough to bound a buffer by."""
        cached = self.__dict__.get("_nbytes")
        if cached is None:
            tokens = self.token_ids.nbytes if hasattr(self.token_ids, "nbytes") else 28 * len(self.token_ids)
            extras = sum(VALUE_BYTES + len(v if not isinstance(v, tuple) else v[0]) for b in self.extra_keys for v in b)
            cached = tokens + extras + VALUE_BYTES * len(self.extra_keys) + len(self.lora_name)
            object.__setattr__(self, "_nbytes", cached)
        return cached

    def tokens_of(self, key: bytes) -> list[int]:
        """The tokens of one of the offload's blocks (empty when not given)."""
        if not len(self.token_ids) or not self.block_size:
            return []
        i = self._positions().get(key)
        return [] if i is None else [int(t) for t in self.token_ids[i * self.block_size:(i + 1) * self.block_size]]

    def parent_of(self, key: bytes) -> bytes | None:
        """The key of the block before this one in the offload, or None for the first."""
        i = self._positions().get(key)
        return self.keys[i - 1] if i else None

    def _positions(self) -> dict[bytes, int]:
        cached = self.__dict__.get("_index")
        if cached is None:
            cached = {k: i for i, k in enumerate(self.keys)}
            object.__setattr__(self, "_index", cached)
        return cached


@dataclass(frozen=True)
class HintTrace:
    """A router's envelope action, by its ids, and what became of it (``outcome``: taken, or why it was set aside)."""

    message_id: str
    action_id: str
    action_type: str
    outcome: str


@dataclass(frozen=True)
class TierEvent:
    """One batch of blocks of one namespace in one tier of one cache group."""

    sequence: int  # per daemon, from 1, no gaps
    timestamp: float  # seconds since the epoch
    kind: EventKind
    tier: TierKind
    cache_group: str
    namespace: str
    keys: tuple[bytes, ...]
    reason: Reason | None = None  # REMOVED only
    engine: EngineBlocks | None = None  # the blocks' key format (and, STORED by an offload, what it said of them)
    scope: int = 0  # who may see it: 0 anyone; else only holders of a pool of that cache group (EventHub.scoped)
    hint: HintTrace | None = None  # HINTED only


KEY_FORMATS: tuple[KeyFormat, ...] = tuple(KeyFormat)  # a stored block's key format as one byte: its place here


def format_code(key_format: KeyFormat) -> int:
    """The byte a tier keeps with a block for its key format (0: opaque)."""
    return KEY_FORMATS.index(key_format)


def described(code: int) -> EngineBlocks | None:
    """What an event says of blocks kept in key format ``code`` (None: opaque keys, or a code not known here)."""
    return EngineBlocks(KEY_FORMATS[code]) if 0 < code < len(KEY_FORMATS) else None


def engine_hash(key: bytes, key_format: KeyFormat) -> tuple[bytes, int | None]:
    """The engine's block hash of a key and its cache group index (None: the format has none)."""
    if key_format is KeyFormat.VLLM and len(key) > 4:
        return key[:-4], int.from_bytes(key[-4:], "big")
    return key, None


__all__ = ["EngineBlocks", "EventKind", "ExtraKeys", "KEY_FORMATS", "KeyFormat", "Reason", "TierEvent", "described",
           "engine_hash", "format_code"]
