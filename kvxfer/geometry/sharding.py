"""Tensor-parallel shards and the canonical stored block.

A model's KV cache has ``total_kv_heads`` heads a layer (1 for an MLA latent). A tensor-
parallel engine splits them over ``tp_size`` ranks as vLLM does (``QKVParallelLinear``):
with ``tp_size <= total_kv_heads`` each rank holds ``total_kv_heads / tp_size``
consecutive heads; with more ranks than heads each head is replicated on
``tp_size / total_kv_heads`` ranks and rank r holds head ``r // replicas``. A split that
divides neither way is refused, as vLLM refuses it.

The **canonical block** of a model is one block's KV over every layer and every head, in
the order L, H, N, KV, D (the block of a TP=1 pool of layout BLHNC). Pools of any TP size
and any layout store and restore the same canonical blocks: a rank's heads are one slice
of each layer. A latent (MLA), the same on every rank, is stored once.

A **manifest** names what a canonical block's bytes mean: the model, the KV dtype and scale
format, the geometry and this format's version. It is hashed into the fingerprint every
stored block carries, so blocks of engines whose manifests differ never match.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from kvxfer.core.errors import InvalidArgument
from kvxfer.geometry.layout import BLHNC, KVSpec, PoolLayout, dtype_name, parse_dtype

#: The canonical block's format; a change of its byte order is a new version (never served as the old).
FORMAT_VERSION = 1
#: The longest model identity a manifest takes.
MAX_MODEL_CHARS = 512
#: The longest KV element format a manifest takes.
MAX_FORMAT_CHARS = 128
#: The most ranks one model may be split over.
MAX_TP_SIZE = 1024


def head_range(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The canonical heads ``[first, end)`` that rank ``tp_rank`` of ``tp_size`` holds (vLLM's split)."""
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise InvalidArgument(f"{total_kv_heads} KV heads do not split evenly over {tp_size} ranks "
                                  "(vLLM refuses this split too)")
        per_rank = total_kv_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if tp_size % total_kv_heads:
        raise InvalidArgument(f"{tp_size} ranks do not replicate {total_kv_heads} KV heads evenly "
                              "(vLLM refuses this split too)")
    head = tp_rank // (tp_size // total_kv_heads)
    return head, head + 1


@dataclass(frozen=True)
class Sharding:
    """One pool's place in a tensor-parallel model: which of the model's KV heads it holds."""

    model: str  # the model's identity: weights, config and precision (what else the bytes depend on)
    tp_rank: int
    tp_size: int
    total_kv_heads: int
    # How an element encodes KV beyond its dtype: quantisation and its scales, e.g. "fp8:per_tensor" (scales
    # in the weights) or "fp8_per_token_head:k128v128:inline_f32" (each head's token cell holds its K codes
    # and fp32 scale, then V's: the scales travel with the head). Empty: plain values.
    kv_format: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not 1 <= len(self.model) <= MAX_MODEL_CHARS \
                or not self.model.isprintable():
            raise InvalidArgument(f"sharding.model: a printable identity of 1-{MAX_MODEL_CHARS} characters")
        if not isinstance(self.kv_format, str) or len(self.kv_format) > MAX_FORMAT_CHARS \
                or not self.kv_format.isprintable():
            raise InvalidArgument(f"sharding.kv_format: printable, at most {MAX_FORMAT_CHARS} characters")
        for name, value, low, high in (("tp_size", self.tp_size, 1, MAX_TP_SIZE),
                                       ("tp_rank", self.tp_rank, 0, self.tp_size - 1),
                                       ("total_kv_heads", self.total_kv_heads, 1, 1 << 16)):
            if type(value) is not int or not low <= value <= high:
                raise InvalidArgument(f"sharding.{name} must be an integer in [{low}, {high}], got {value!r}")
        head_range(self.total_kv_heads, self.tp_size, self.tp_rank)  # validates the split

    @property
    def heads(self) -> tuple[int, int]:
        """The canonical heads this rank holds, ``[first, end)``."""
        return head_range(self.total_kv_heads, self.tp_size, self.tp_rank)

    def check(self, spec: KVSpec) -> None:
        """Refuse a pool whose head count is not this rank's share."""
        first, end = self.heads
        if spec.num_kv_heads != end - first:
            raise InvalidArgument(f"rank {self.tp_rank} of {self.tp_size} holds {end - first} of the model's "
                                  f"{self.total_kv_heads} KV heads, but its pool has {spec.num_kv_heads}")


@dataclass(frozen=True)
class Manifest:
    """What a canonical block's bytes mean. Equal manifests: interchangeable blocks."""

    model: str
    dtype: str
    block_size: int
    num_kv_heads: int  # the model's, all ranks together
    num_layers: int
    kv_parts: int
    head_size: int  # elements a part a head
    scale_format: str = "none"  # the element format (``Sharding.kv_format``): quantisation and its scales
    version: int = FORMAT_VERSION

    @classmethod
    def of(cls, spec: KVSpec, sharding: Sharding) -> Manifest:
        """The manifest of a rank pool's model (its spec is the rank's share)."""
        sharding.check(spec)
        return cls(sharding.model, dtype_name(spec.dtype), spec.block_size, sharding.total_kv_heads,
                   spec.num_layers, spec.kv_parts, spec.head_size, sharding.kv_format or "none")

    @property
    def digest(self) -> bytes:
        """SHA-256 of the manifest's canonical JSON: the same on every host and version of Python."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(b"kvxfer-manifest\0" + text.encode()).digest()

    def layout(self, num_blocks: int) -> PoolLayout:
        """``num_blocks`` canonical blocks, as a BLHNC pool of every head."""
        spec = KVSpec(self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_size,
                      parse_dtype(self.dtype), self.kv_parts)
        return PoolLayout(spec, BLHNC)


def stored_format(layout: PoolLayout, sharding: Sharding | None) -> tuple[PoolLayout, Manifest | None]:
    """What a pool's blocks are stored as: its own blocks, or (a rank pool) canonical blocks and their manifest."""
    if sharding is None:
        return layout, None
    manifest = Manifest.of(layout.spec, sharding)
    return manifest.layout(layout.spec.num_blocks), manifest


__all__ = ["FORMAT_VERSION", "MAX_FORMAT_CHARS", "Manifest", "Sharding", "head_range", "stored_format"]
