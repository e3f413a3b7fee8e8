"""What a vLLM engine's blocks are called in kvxfer: pool ids, cache groups, namespaces, geometry.

Pure functions of the engine's configuration, shared by the scheduler process and every
worker so that they agree without talking to each other. A namespace binds the model, the
geometry and the tenant (vLLM's ``cache_salt``): another model or tenant never matches.

Every rank registers with its ``Sharding`` and the engine's blocks are stored canonically
(every head, one order): engines of the same model share them whatever their tensor-
parallel size and layout. With pipeline or context parallelism (whose ranks hold different
layers or tokens) each rank has a cache group of its own, and the namespace binds the split
and the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.client import KVSpec, Layout, Sharding, dtype_name
from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import digest
from kvxfer.integrations.identity import safe_group_prefix

#: vLLM's KV-cache layouts (vllm.v1.kv_cache_layout) in kvxfer's axes. vLLM's content axis C
#: holds a token's K then its V vector, which is kvxfer's KV,D.
VLLM_LAYOUTS: dict[str, str] = {
    "BLHNC": "B,L,H,N,KV,D", "BLNHC": "B,L,N,H,KV,D", "BHLNC": "B,H,L,N,KV,D",
    "LBHNC": "L,B,H,N,KV,D", "LBNHC": "L,B,N,H,KV,D", "LHBNC": "L,H,B,N,KV,D",
}




def kvxfer_layout(vllm_layout: str) -> Layout:
    """kvxfer's Layout for a vLLM layout name; a layout kvxfer cannot address is refused."""
    try:
        return Layout.parse(VLLM_LAYOUTS[vllm_layout])
    except KeyError:
        raise InvalidArgument(f"vLLM KV-cache layout {vllm_layout!r} is not supported; "
                              f"use one of {', '.join(VLLM_LAYOUTS)} (BLHNC recommended)") from None


@dataclass(frozen=True)
class EngineNames:
    """The names of one vLLM engine's pools and blocks at the daemon."""

    engine_id: str
    model: str
    spec: KVSpec
    layout: Layout
    world_size: int
    group_prefix: str = ""  # kv_connector_extra_config "cache_group": share a host tier across engines
    total_kv_heads: int = 0  # the model's, over all ranks: > 0 stores canonical blocks (``sharding``)
    kv_format: str = ""  # quantisation and its scales (``Sharding.kv_format``); empty: plain values

    @property
    def canonical(self) -> bool:
        return self.total_kv_heads > 0

    @property
    def fingerprint(self) -> str:
        """Changes whenever a block's bytes would mean something else (not with num_blocks; for canonical
        blocks, not with the split or the layout either)."""
        s = self.spec
        latent = ("latent",) if s.kv_parts == 1 else ()  # (K/V engines keep the names they had)
        latent += (self.kv_format,) if self.kv_format else ()
        if self.canonical:
            return digest("canonical", self.model, s.num_layers, s.block_size, self.total_kv_heads, s.head_size,
                           dtype_name(s.dtype), *latent)
        return digest(self.model, self.layout.spelled, s.num_layers, s.block_size, s.num_kv_heads, s.head_size,
                       dtype_name(s.dtype), self.world_size, *latent)

    def sharding(self, rank: int) -> Sharding | None:
        """What rank ``rank`` registers: its share of the model's heads (None: per-rank groups)."""
        if not self.canonical:
            return None
        return Sharding(digest(self.model, size=32), rank, self.world_size, self.total_kv_heads, self.kv_format)

    def pool_id(self, rank: int) -> str:
        """Unique to this engine instance and rank (a restarted engine registers anew)."""
        return f"vllm-{digest(self.engine_id, size=12)}-r{rank}"

    def pool_ids(self) -> list[str]:
        return [self.pool_id(rank) for rank in range(self.world_size)]

    def cache_group(self, rank: int) -> str:
        """Stable across engine restarts and shared by engines of the same model and split on one node."""
        prefix = safe_group_prefix(self.group_prefix, "vllm")
        return f"{prefix}-{self.fingerprint}" + ("" if self.canonical else f"-r{rank}")

    def namespace(self, cache_salt: str | None, generation: int = 0) -> str:
        """``generation``: how many times the engine forgot what it stored (``forget_on_reset``)."""
        tenant = digest(cache_salt) if cache_salt else "shared"
        return f"vllm:{self.fingerprint}:{tenant}" + (f":g{generation}" if generation else "")
