"""Cache groups: a host tier and its index, shared by pools whose blocks are interchangeable.

An engine that restarts allocates a new pool; if it registers that pool in the same
cache group as before, it finds the blocks its previous process offloaded (the warm
cache outlives the engine). Tensor-parallel ranks hold different shards under the
same keys, so each rank has a group of its own (``model-tp0``, ``model-tp1``, ...).
Pools join a group only if their blocks have the same format byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.errors import FailedPrecondition
from kvxfer.geometry.layout import PoolLayout, dtype_name
from kvxfer.index.block_index import BlockIndex
from kvxfer.tiers.host import HostTier


@dataclass(frozen=True)
class BlockFormat:
    """What makes two pools' blocks interchangeable: everything but the number of blocks."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    layout: str  # the general form, outermost first

    @classmethod
    def of(cls, layout: PoolLayout) -> BlockFormat:
        s = layout.spec
        return cls(s.num_layers, s.block_size, s.num_kv_heads, s.head_size, dtype_name(s.dtype), layout.layout.spelled)


class CacheGroup:
    """One host tier and the index over it."""

    def __init__(self, name: str, layout: PoolLayout, capacity_blocks: int, pin_device: int | None = None) -> None:
        self.name = name
        self.format = BlockFormat.of(layout)
        self.host = HostTier(capacity_blocks, layout.block_bytes, pin_device=pin_device)
        self.index = BlockIndex(self.host.kind, self.host.slots)

    def check_joins(self, layout: PoolLayout) -> None:
        """Refuse a pool whose blocks are not byte-compatible with this group's."""
        fmt = BlockFormat.of(layout)
        if fmt != self.format:
            raise FailedPrecondition(f"cache group {self.name!r} holds blocks of {self.format}; a pool of {fmt} "
                                     "cannot join it (use another cache group)")
